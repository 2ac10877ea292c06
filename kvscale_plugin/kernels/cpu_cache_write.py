"""FP8 (e4m3fn) KV-cache write for vLLM's CPU attention cache layout, in plain torch.

vLLM's CPU build writes its FP8 cache with ``cpu_attn_reshape_and_cache``, which
rounds toward zero, turns NaN into 448 and -0 into +0. This module writes the
same cache locations with kvscale's contract instead, bit for bit::

    (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)   # round to nearest even

(saturation to +-448, NaN kept as NaN, -0 kept), padding slots (< 0) skipped.

Layout ("vec": x86 with AVX-512 and no AMX, what ``_get_attn_isa`` picks for an
FP8 cache there). One layer's cache is ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` bytes; each (block, head) owns ``2 * block_size * head_size``
contiguous bytes, K first, then V:

    K[t, d] at  d * block_size + t                        (transposed)
    V[t, d] at  block_size * head_size + t * head_size + d

(derived by writing position codes through vLLM's op and reading the bytes back;
the host adapter re-checks it against vLLM's own op before first use). Other ISAs
("amx", ...) lay the cache out differently and are not handled here.

Pure torch, no host import: vectorised (``index_put_`` on ``uint8`` views, no
Python loop over tokens), any strides for ``key`` / ``value`` (slices of a fused
qkv tensor are fine).
"""

from __future__ import annotations

import torch

FP8_E4M3_MAX = 448.0

#: Cache layouts this module writes (named after vLLM's CPU attention ISA strings).
LAYOUTS = ("vec",)

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# fp32 divisor tensors per scale value: dividing a bf16 / fp16 tensor by a
# dimensioned fp32 tensor promotes to fp32, so one ``div`` computes
# ``x.float() / s`` exactly. Bounded: scales change only on a weight reload.
_scale_tensors: dict[tuple[float, ...], torch.Tensor] = {}
_MAX_ENTRIES = 4096


def _scale_tensor(*scales: float) -> torch.Tensor:
    """``[1]`` for one scale; ``[2, 1, 1, 1]`` for a (K, V) pair."""
    t = _scale_tensors.get(scales)
    if t is None:
        if len(_scale_tensors) >= _MAX_ENTRIES:
            _scale_tensors.clear()
        shape = (1,) if len(scales) == 1 else (len(scales), 1, 1, 1)
        t = _scale_tensors[scales] = torch.tensor(scales, dtype=torch.float32).view(shape)
    return t


def _quantize_(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` (a fresh tensor, clamped in place) -> e4m3 bytes, round to nearest even."""
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() / scale).clamp(-448, 448)`` as float8_e4m3fn; ``scale`` is taken as fp32.

    One ``div`` (a 1-d fp32 divisor promotes bf16 / fp16 to fp32 exactly), an
    in-place clamp (keeps NaN) and torch's round-to-nearest-even conversion.
    """
    return _quantize_(torch.div(x, _scale_tensor(float(scale)))).view(torch.float8_e4m3fn)


def cpu_cache_views(
    kv_cache: torch.Tensor, layout: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8`` views ``[num_blocks, block_size, num_kv_heads, head_size]`` of one
    layer's CPU cache such that ``view[block, t, h, d]`` is the byte vLLM's CPU
    attention reads for token ``t`` of ``block``, head ``h``, element ``d`` (K, V).

    The views hold the cache's storage: keep them no longer than the cache itself."""
    if layout not in LAYOUTS:
        raise ValueError(f"unsupported CPU cache layout {layout!r}; supported: {LAYOUTS}")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            "expected one layer's cache [num_blocks, num_kv_heads, block_size, 2*head_size], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.element_size() != 1:
        raise ValueError(f"expected a 1-byte (FP8 / uint8) cache, got {kv_cache.dtype}")
    num_blocks, num_heads, block_size, two_hs = kv_cache.shape
    head_size = two_hs // 2
    raw = kv_cache.view(torch.uint8)
    if raw.stride(3) != 1 or raw.stride(2) != two_hs:
        raise ValueError("each (block, head) of the CPU cache must be one contiguous region")
    sb, sh = raw.stride(0), raw.stride(1)
    plane = block_size * head_size
    offset = raw.storage_offset()
    key_view = raw.as_strided(
        (num_blocks, block_size, num_heads, head_size), (sb, 1, sh, block_size), offset
    )
    value_view = raw.as_strided(
        (num_blocks, block_size, num_heads, head_size), (sb, head_size, sh, 1), offset + plane
    )
    return key_view, value_view


def cpu_fp8_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    layout: str = "vec",
    views: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Quantize K and V (round to nearest even) and scatter them into vLLM's CPU cache.

    ``key`` / ``value``: ``[num_tokens, num_kv_heads, head_size]`` bf16 / fp16 / fp32,
    any strides; only the first ``len(slot_mapping)`` rows are written.
    ``kv_cache``: one layer's ``[num_blocks, num_kv_heads, block_size, 2*head_size]``
    uint8 (or float8_e4m3fn) tensor, written in place. ``slot_mapping``: int32/int64
    ``[num_tokens]``, ``block * block_size + offset``; slots < 0 are left untouched.
    ``k_scale`` / ``v_scale``: the scales vLLM's CPU attention dequantizes with.
    ``views``: ``cpu_cache_views(kv_cache, layout)``, if the caller keeps them per cache.
    """
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    key_view, value_view = views if views is not None else cpu_cache_views(kv_cache, layout)
    block_size = key_view.shape[1]
    slots = slot_mapping
    if key.shape[0] != num_tokens:
        key, value = key[:num_tokens], value[:num_tokens]
    # K and V quantized together: one stack, one div by (k_scale, v_scale), one clamp,
    # one conversion (the write sits on every step, where op count is the cost).
    kv = torch.stack((key, value))
    if slots.min().item() < 0:
        keep = slots >= 0
        slots, kv = slots[keep], kv[:, keep]
    q = _quantize_(torch.div(kv, _scale_tensor(float(k_scale), float(v_scale))))
    index = (torch.div(slots, block_size, rounding_mode="floor"), slots.remainder(block_size))
    key_view.index_put_(index, q[0])
    value_view.index_put_(index, q[1])


def cpu_fp8_cache_read(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V bytes stored for ``slot_mapping`` (all >= 0): two
    ``[num_tokens, num_kv_heads, head_size]`` uint8 tensors (tests, benchmarks)."""
    key_view, value_view = cpu_cache_views(kv_cache, layout)
    block_size = key_view.shape[1]
    slots = slot_mapping.to(torch.int64)
    index = (slots // block_size, slots % block_size)
    return key_view[index], value_view[index]
