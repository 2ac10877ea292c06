"""The bytes kvscale's FP8 cache write promises, at the positions of vLLM's CPU "vec"
layout, computed one token at a time (the oracle of the CPU-write tests)."""

from __future__ import annotations

import torch


def contract(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() / s).clamp(-448, 448)`` as float8_e4m3fn bytes, s the float32 scale."""
    s = torch.tensor(scale, dtype=torch.float32)
    return (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)


def expected_vec_cache(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> torch.Tensor:
    """``cache`` (bytes) after writing ``key`` / ``value`` at ``slots`` (< 0: padding,
    skipped): per (block, head), K transposed at ``d * block_size + t``, then V at
    ``block_size * head_size + t * head_size + d``."""
    out = cache.clone().view(torch.uint8)
    num_blocks, num_heads, block_size, two_hs = out.shape
    hs = two_hs // 2
    flat = out.view(num_blocks, num_heads, 2 * block_size * hs)
    d = torch.arange(hs)
    for i, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        b, t = divmod(slot, block_size)
        flat[b, :, d * block_size + t] = contract(key[i], k_scale)
        flat[b, :, block_size * hs + t * hs + d] = contract(value[i], v_scale)
    return out
