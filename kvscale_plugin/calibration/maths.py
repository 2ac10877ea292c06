"""From observed maxima to scales: ``scale = amax / 448``, never below ``SCALE_FLOOR``.

448 (``fp8.FP8_E4M3_MAX``) is the largest FP8 e4m3 value, so the largest observed
element maps to the edge of the FP8 range. ``tensor``: one scale per layer (the max over
its KV heads), shape ``[1]``; ``attn_head``: one per KV head, ``[num_kv_heads, 1, 1]``
(``fp8.scale_shape``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from kvscale_plugin.calibration.common import check_scheme, sorted_modules
from kvscale_plugin.fp8 import FLOAT32_EPS, FP8_E4M3_MAX, scale_shape

if TYPE_CHECKING:
    from kvscale_plugin.calibration.observer import Observed

#: Smallest scale ever written. A dead layer (K or V all zeros) would get amax / 448 = 0,
#: which every engine rejects (division by zero -> NaN cache). This is the value that
#: compressed-tensors' own ``calculate_qparams`` puts in place of a zero float32 scale
#: (``torch.finfo(torch.float32).eps``, ~1.19e-7).
SCALE_FLOOR = FLOAT32_EPS


def scale_from_amax(amax: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32 scale tensor: ``[1]`` (max over heads) for ``tensor``, ``[H, 1, 1]`` per head."""
    check_scheme(scheme)
    amax = amax.detach().float().reshape(-1)
    if scheme == "tensor":
        return (amax.max() / FP8_E4M3_MAX).clamp(min=SCALE_FLOOR).reshape(scale_shape(None))
    return (amax / FP8_E4M3_MAX).clamp(min=SCALE_FLOOR).reshape(scale_shape(amax.numel()))


def scales_from_observed(
    obs: Observed, scheme: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """attention module name -> (k_scale, v_scale) tensors."""
    return {
        name: (scale_from_amax(obs.k_amax[name], scheme), scale_from_amax(obs.v_amax[name], scheme))
        for name in sorted_modules(obs.k_amax)
    }


def reads_other_cache(config: Mapping[str, Any], names: Iterable[str]) -> list[str]:
    """The attention modules of ``names`` that read another layer's KV cache, as the
    model's config (config.json's dict) wires it (``sharing.kv_sharing_targets``): they
    serve their target's scales and get none of their own."""
    from kvscale_plugin.inspection.config import text_config
    from kvscale_plugin.names import main_stack_index
    from kvscale_plugin.sharing import kv_sharing_targets

    shares = kv_sharing_targets(text_config(config))
    return [name for name in names if main_stack_index(name) in shares]
