"""Shared helpers for the kernel tests (a uniquely named module rather than
``conftest`` imports, which clash when several test folders have a conftest)."""

from __future__ import annotations

import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def conversion_paths() -> list[str]:
    """Conversion paths this machine can check: the interpreter computes only software."""
    if HAS_CUDA and torch.cuda.get_device_capability() >= (8, 9):
        return ["software", "hardware"]
    return ["software"]


def assert_same_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bytes equal, except that any NaN (0x7F / 0xFF) matches any NaN: the sign of
    a NaN differs between platforms and is not part of the contract."""
    a = actual.view(torch.uint8).cpu()
    e = expected.view(torch.uint8).cpu()
    both_nan = ((a & 0x7F) == 0x7F) & ((e & 0x7F) == 0x7F)
    bad = (a != e) & ~both_nan
    if bad.any():
        idx = bad.nonzero()[:8].tolist()
        pairs = [(i, hex(a[tuple(i)].item()), hex(e[tuple(i)].item())) for i in idx]
        raise AssertionError(
            f"{int(bad.sum())} of {a.numel()} cache bytes differ from the reference; "
            f"first (index, kernel, reference): {pairs}"
        )


def vllm_kv_cache(
    num_blocks: int,
    block_size: int,
    num_heads: int,
    head_size: int,
    *,
    physical: str = "NHD",
    dtype: torch.dtype = torch.uint8,
    device: torch.device = DEVICE,
) -> torch.Tensor:
    """One layer's cache as vLLM hands it to ``do_kv_cache_update``: logical
    ``[num_blocks, num_heads, block_size, 2*head_size]``, physically NHD
    (vLLM's default layout) or HND, filled with random bytes so that writes to
    the wrong place and writes to padding slots both show."""
    if physical == "NHD":
        raw = torch.randint(0, 256, (num_blocks, block_size, num_heads, 2 * head_size))
        raw = raw.to(torch.uint8).to(device).permute(0, 2, 1, 3)
    else:
        raw = torch.randint(0, 256, (num_blocks, num_heads, block_size, 2 * head_size))
        raw = raw.to(torch.uint8).to(device)
    return raw.view(dtype)


def split_kv_cache(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's Triton/flash views: (blocks, heads, slots, 2*hs) -> K and V halves
    of shape (blocks, slots, heads, hs)."""
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    return key_cache, value_cache
