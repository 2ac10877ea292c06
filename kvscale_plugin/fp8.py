"""What an FP8 KV-cache scale is, for every part of kvscale (imports nothing, not even torch).

* The e4m3 range: ``FP8_E4M3_MAX`` (448) is the largest finite float8_e4m3fn value, so a
  scale of ``amax / 448`` maps the largest observed K or V element to the edge of the
  range, and a cache write is ``(x / scale).clamp(-448, 448)``.
* The float32 limits a scale lives within (``FLOAT32_EPS``, ``FLOAT32_MAX``): the values of
  ``torch.finfo(torch.float32)``, spelled out so that modules which must not import torch
  can use them (tests check them against torch).
* Head placement on disk: a per-tensor scale is ``[1]``; per-head scales (``strategy:
  attn_head``) are one value per KV head, ``[H, 1, 1]`` -- llm-compressor's layout, which
  ``kvscale calibrate`` writes (``scale_shape``); loaders also accept ``[H]``
  (``per_head_shape_ok``).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Largest finite FP8 e4m3 (float8_e4m3fn) value.
FP8_E4M3_MAX = 448.0
#: ``torch.finfo(torch.float32).eps``: the gap between 1.0 and the next float32.
FLOAT32_EPS = 2.0**-23
#: ``torch.finfo(torch.float32).max``: the largest finite float32.
FLOAT32_MAX = (2.0 - 2.0**-23) * 2.0**127
#: The range a calibrated scale lies in. A scale is ``amax / 448``; K and V of real models
#: peak between ~0.1 and a few hundred (SmolLM2-135M: K 10-25, V 0.6-18 per layer), so real
#: scales lie around 1e-4..1. Outside [2**-27 (7.5e-9), 1e4] the cache could hold nothing
#: above 3.3e-6, or would need K/V of 4.5 million (68x float16's largest value): no calibration
#: gives that; uninitialised memory does (llm-compressor's never-calibrated ``q_scale``:
#: 2e24, 8.8e-39). Wide on purpose: a refusal of a real checkpoint costs more than a scale
#: 100x off, which ``kvscale calibrate --check`` shows.
PLAUSIBLE_SCALE_MIN = 2.0**-27  # exact in float32, where loaded scales are judged
PLAUSIBLE_SCALE_MAX = 1e4


def scale_shape(num_heads: int | None) -> tuple[int, ...]:
    """Shape of a stored scale tensor: ``(1,)`` per tensor (``num_heads=None``), else one
    value per KV head, ``(num_heads, 1, 1)`` (llm-compressor's ``attn_head`` layout)."""
    return (1,) if num_heads is None else (num_heads, 1, 1)


def per_head_shape_ok(shape: Sequence[int], num_heads: int) -> bool:
    """A stored per-head scale shape the loaders accept: ``[H]``, ``[H, 1, 1]``
    (llm-compressor's layout) or any ``[H, 1, ...]``."""
    return len(shape) >= 1 and shape[0] == num_heads and all(d == 1 for d in shape[1:])
