"""Plain-torch FP8 cache write: the oracle for the Triton kernel, and the path
taken when there is no GPU.

Same signature and layouts as ``fp8_cache_write`` (see that module).
"""

from __future__ import annotations

import torch

from kvscale_plugin.fp8 import FP8_E4M3_MAX


def quantize_e4m3_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``(x.float() / scale).clamp(-448, 448)`` as float8_e4m3fn.

    ``x`` is ``[num_tokens, num_kv_heads, head_size]``; ``scale`` has one
    element or one per KV head. The explicit clamp matters: some torch
    versions turn overflow into NaN instead of saturating. ``clamp`` keeps NaN.
    """
    s = scale.to(device=x.device, dtype=torch.float32).reshape(1, -1, 1)
    return (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_cache_write_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> None:
    """Quantize K and V by their scales and scatter them into the paged cache.

    Slots < 0 are padding and leave the cache untouched; only the first
    ``len(slot_mapping)`` rows of ``key``/``value`` are written. Writes go
    through ``uint8`` views so that strided cache views (halves of vLLM's
    combined K|V tensor) are updated in place and no fp8 indexing kernel is
    needed.
    """
    num_tokens = slot_mapping.shape[0]
    slots = slot_mapping.to(torch.int64)
    valid = slots >= 0  # boolean indexing below syncs with the device: oracle only
    slots = slots[valid]
    for x, cache, scale in ((key, key_cache, k_scale), (value, value_cache, v_scale)):
        block_size = cache.shape[1]
        q = quantize_e4m3_reference(x[:num_tokens][valid], scale)
        cache.view(torch.uint8)[slots // block_size, slots % block_size] = q.view(torch.uint8)
