"""The fused FP8 cache write against the plain-torch reference, byte for byte.

On a machine without a GPU these run in Triton's interpreter (software
conversion only); on a GPU they run the compiled kernel on both conversion
paths the device has. Interpreter cost is per program instance (one per token
here), so launches stay at a few dozen tokens.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fp8_helpers import DEVICE, assert_same_fp8, conversion_paths, split_kv_cache, vllm_kv_cache

from kvscale_plugin.kernels import fp8_cache_write, fp8_cache_write_reference

ROOT = Path(__file__).resolve().parents[2]
kernel_module = importlib.import_module("kvscale_plugin.kernels.triton_fp8_write")

CacheViews = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def wide_range(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Values from ~2**-16 to ~2**11: subnormal e4m3 results, ordinary ones and
    saturation, both signs."""
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-16, 12, shape, generator=g).float())
    x = torch.randn(shape, generator=g) * mag
    return x.to(dtype).to(DEVICE)


def write_and_compare(
    key: torch.Tensor,
    value: torch.Tensor,
    base: torch.Tensor,
    views: CacheViews,
    slots: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    conversion: str = "software",
) -> None:
    """Write with the kernel into ``views(base)`` and with the reference into
    ``views(copy of base)``; every byte of the underlying tensors must agree
    (so padding slots and bytes outside the written slots are checked too)."""
    expected_base = base.clone()
    key_cache, value_cache = views(base)
    fp8_cache_write(
        key, value, key_cache, value_cache, slots, k_scale, v_scale, conversion=conversion
    )
    ref_key_cache, ref_value_cache = views(expected_base)
    fp8_cache_write_reference(key, value, ref_key_cache, ref_value_cache, slots, k_scale, v_scale)
    assert_same_fp8(base, expected_base)


def separate_caches(
    num_blocks: int, block_size: int, num_heads: int, head_size: int
) -> tuple[torch.Tensor, CacheViews]:
    base = torch.randint(0, 256, (2, num_blocks, block_size, num_heads, head_size))
    return base.to(torch.uint8).to(DEVICE), lambda b: (b[0], b[1])


def slot_mapping(
    num_tokens: int,
    num_slots: int,
    *,
    padding: bool,
    dtype: torch.dtype = torch.int64,
    seed: int = 0,
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots, generator=g)[:num_tokens]
    if padding:
        slots[1::3] = -1  # vLLM pads with -1 (CUDA-graph padding, skipped tokens)
    return slots.to(dtype).to(DEVICE)


def scale(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize("conversion", conversion_paths())
@pytest.mark.parametrize("padding", [False, True], ids=["no-padding", "padding"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_matches_reference_grid(
    dtype: torch.dtype, head_size: int, block_size: int, padding: bool, conversion: str
) -> None:
    num_tokens, num_heads, num_blocks = 6, 2, 3
    key = wide_range((num_tokens, num_heads, head_size), dtype, seed=1)
    value = wide_range((num_tokens, num_heads, head_size), dtype, seed=2)
    base, views = separate_caches(num_blocks, block_size, num_heads, head_size)
    slots = slot_mapping(num_tokens, num_blocks * block_size, padding=padding)
    # Non-power-of-two scales: the division really rounds.
    write_and_compare(key, value, base, views, slots, scale(0.37), scale(3.3), conversion)


@pytest.mark.parametrize("conversion", conversion_paths())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_special_values(dtype: torch.dtype, conversion: str) -> None:
    """NaN stays NaN, +-inf and values far beyond 448 saturate to +-448, tiny
    values become e4m3 subnormals or (signed) zero."""
    big = torch.finfo(dtype).max
    specials = [
        float("nan"),
        -float("nan"),
        float("inf"),
        -float("inf"),
        big,
        -big,
        1e4,
        -1e4,
        448.0,
        -448.0,
        449.0,
        463.9,
        464.0,
        465.0,
        479.0,
        480.0,
        -500.0,
        0.0,
        -0.0,
        2.0**-6,
        2.0**-7,
        2.0**-9,
        2.0**-10,
        3 * 2.0**-11,
        2.0**-11,
        -(2.0**-9),
        1e-6,
        -1e-6,
        1.0625,
        1.1875,
        17.0,
        19.0,
    ]
    x = torch.tensor(specials, dtype=torch.float32).to(dtype)
    # Fill [tokens=4, heads=2, head_size=64] with the specials and random fill.
    key = wide_range((4, 2, 64), dtype, seed=3).cpu()
    key.view(-1)[: x.numel()] = x
    value = -key.flip(0)
    base, views = separate_caches(2, 16, 2, 64)
    slots = slot_mapping(4, 32, padding=False)
    # Scale 1: the specials hit the conversion unchanged; 0.37: after division.
    key, value = key.to(DEVICE), value.to(DEVICE)
    write_and_compare(key, value, base, views, slots, scale(1.0), scale(1.0), conversion)
    write_and_compare(key, value, base, views, slots, scale(0.37), scale(2.9), conversion)


@pytest.mark.parametrize("conversion", conversion_paths())
def test_rounding_ties_and_neighbours(conversion: str) -> None:
    """Every midpoint between adjacent e4m3 values (round to even), one fp32
    ulp either side of it, and the values themselves, both signs."""
    codes = torch.arange(0, 0x7F, dtype=torch.uint8)  # all finite non-negative codes
    finite = codes.view(torch.float8_e4m3fn).float()
    mids = (finite[:-1] + finite[1:]) / 2  # exact in fp32
    around = torch.cat(
        [
            finite,
            mids,
            torch.nextafter(mids, torch.tensor(float("inf"))),
            torch.nextafter(mids, torch.tensor(0.0)),
            torch.tensor([448.0, 456.0, 464.0, 472.0, 480.0]),
        ]
    )
    values = torch.cat([around, -around])
    num = values.numel()
    head_size = 64
    num_tokens = -(-num // (2 * head_size))
    flat = torch.zeros(num_tokens * 2 * head_size)
    flat[:num] = values
    key = flat.view(num_tokens, 2, head_size).to(DEVICE)
    value = key.flip(-1).contiguous()
    base, views = separate_caches(1, 16, 2, head_size)
    slots = slot_mapping(num_tokens, 16, padding=False)
    write_and_compare(key, value, base, views, slots, scale(1.0), scale(1.0), conversion)


@pytest.mark.slow  # every 16-bit pattern through the interpreter: `make test` only
@pytest.mark.parametrize("conversion", conversion_paths())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exhaustive_16_bit_inputs(dtype: torch.dtype, conversion: str) -> None:
    """All 65,536 bf16 / fp16 bit patterns through the kernel with scale 1 (the
    conversion alone) and with a non-power-of-two scale, against torch."""
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16)
    x = patterns.view(dtype).reshape(16, 32, 128).to(DEVICE)
    base, views = separate_caches(1, 16, 32, 128)
    slots = torch.arange(16, device=DEVICE)
    write_and_compare(x, x, base, views, slots, scale(1.0), scale(0.37), conversion)


@pytest.mark.parametrize("conversion", conversion_paths())
@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_vllm_combined_cache_and_fused_qkv(
    physical: str, slot_dtype: torch.dtype, conversion: str
) -> None:
    """vLLM's own inputs: key/value are column slices of one fused qkv tensor,
    the cache is one per-layer ``[blocks, heads, slots, 2*hs]`` tensor (NHD or
    HND in memory) transposed and split into its K and V halves, slots int32
    or int64 with padding, and key/value padded past len(slot_mapping)."""
    num_tokens, num_q_heads, num_heads, head_size, block_size = 12, 4, 2, 64, 16
    qkv = wide_range((num_tokens + 4, (num_q_heads + 2 * num_heads) * head_size), torch.bfloat16, 4)
    _, k, v = qkv.split([num_q_heads * head_size, num_heads * head_size, num_heads * head_size], -1)
    key = k.view(-1, num_heads, head_size)
    value = v.view(-1, num_heads, head_size)
    assert not key.is_contiguous() and key.shape[0] > num_tokens
    kv = vllm_kv_cache(3, block_size, num_heads, head_size, physical=physical)
    slots = slot_mapping(num_tokens, 3 * block_size, padding=True, dtype=slot_dtype)

    def views(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return split_kv_cache(base, head_size)

    write_and_compare(key, value, kv, views, slots, scale(0.37), scale(1.9), conversion)


@pytest.mark.parametrize("conversion", conversion_paths())
def test_fp8_typed_cache_and_odd_strides(conversion: str) -> None:
    """A ``float8_e4m3fn`` cache (not a uint8 view), a key whose head dimension
    is strided (every other element), a value laid out head-major."""
    num_tokens, num_heads, head_size = 5, 2, 64
    wide = wide_range((num_tokens, num_heads, 2 * head_size), torch.float16, 5)
    key = wide[..., ::2]
    value = wide_range((num_heads, num_tokens, head_size), torch.float16, 6).transpose(0, 1)
    assert key.stride(-1) == 2 and value.stride(0) == head_size
    kv = vllm_kv_cache(2, 16, num_heads, head_size, dtype=torch.float8_e4m3fn)

    def views(base: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return split_kv_cache(base, head_size)

    slots = slot_mapping(num_tokens, 32, padding=False, dtype=torch.int32)
    write_and_compare(key, value, kv, views, slots, scale(0.37), scale(0.37), conversion)


@pytest.mark.parametrize("conversion", conversion_paths())
def test_per_head_scales(conversion: str) -> None:
    num_tokens, num_heads, head_size = 6, 4, 64
    key = wide_range((num_tokens, num_heads, head_size), torch.bfloat16, 7)
    value = wide_range((num_tokens, num_heads, head_size), torch.bfloat16, 8)
    base, views = separate_caches(2, 16, num_heads, head_size)
    slots = slot_mapping(num_tokens, 32, padding=True)
    k_scale = scale(0.37, 1.0, 5.3, 0.011)
    v_scale = scale(2.0, 0.7, 13.0, 0.3)
    write_and_compare(key, value, base, views, slots, k_scale, v_scale, conversion)
    # Mixed: per-tensor K scale (0-dim, like vLLM's layer._k_scale), per-head V.
    k_scalar = torch.tensor(0.37, device=DEVICE)
    write_and_compare(key, value, base, views, slots, k_scalar, v_scale, conversion)


def test_scales_are_read_at_launch() -> None:
    """Scales are device tensors read by the kernel: updating them in place (a
    weight reload) changes the next write without any new argument."""
    key = wide_range((2, 2, 64), torch.bfloat16, 9)
    base, views = separate_caches(1, 16, 2, 64)
    k_scale, v_scale = scale(1.0), scale(1.0)
    key_cache, value_cache = views(base)
    fp8_cache_write(
        key, key, key_cache, value_cache, torch.tensor([0, 1], device=DEVICE), k_scale, v_scale
    )
    k_scale.fill_(0.25)
    fp8_cache_write(
        key, key, key_cache, value_cache, torch.tensor([2, 3], device=DEVICE), k_scale, v_scale
    )
    expected = torch.cat([key.float() / 1.0, key.float() / 0.25]).clamp(-448, 448)
    expected = expected.to(torch.float8_e4m3fn).view(torch.uint8)
    assert_same_fp8(key_cache[0, :4], expected)
    assert_same_fp8(value_cache[0, 2:4], key.float().clamp(-448, 448).to(torch.float8_e4m3fn))


def test_only_len_slot_mapping_tokens_and_empty_launch() -> None:
    key = wide_range((8, 2, 64), torch.bfloat16, 10)
    base, views = separate_caches(1, 16, 2, 64)
    untouched = base.clone()
    key_cache, value_cache = views(base)
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    fp8_cache_write(key, key, key_cache, value_cache, empty, scale(1.0), scale(1.0))
    assert torch.equal(base, untouched)
    slots = torch.tensor([5, -1, 7], device=DEVICE)
    write_and_compare(key, key, base, views, slots, scale(1.0), scale(1.0))
    changed = (base != untouched).any(-1).any(-1)  # [2, blocks*slots]
    assert set(changed[0, 0].nonzero().flatten().tolist()) <= {5, 7}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda a: a.update(key=a["key"].to(torch.float64)), "key must be"),
        (lambda a: a.update(key_cache=a["key_cache"].view(torch.int8)), "key_cache must be"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].to(torch.int16)), "slot_mapping"),
        (lambda a: a.update(k_scale=scale(1.0, 2.0, 3.0)), "k_scale must be"),
        (lambda a: a.update(v_scale=a["v_scale"].double()), "v_scale must be"),
        (lambda a: a.update(slot_mapping=torch.arange(9, device=DEVICE)), "9 tokens"),
        (lambda a: a.update(value=a["value"][:, :1]), "value heads"),
    ],
)
def test_rejects_bad_arguments(change: Callable[[dict], None], message: str) -> None:
    base, views = separate_caches(1, 16, 2, 64)
    key_cache, value_cache = views(base)
    key = wide_range((4, 2, 64), torch.bfloat16, 11)
    args = {
        "key": key,
        "value": key,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": torch.arange(4, device=DEVICE),
        "k_scale": scale(1.0),
        "v_scale": scale(1.0),
    }
    change(args)
    with pytest.raises(ValueError, match=message):
        fp8_cache_write(**args)


def test_unknown_conversion_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="'auto', 'software' or 'hardware'"):
        kernel_module.use_hardware_conversion(DEVICE, "fast")  # type: ignore[arg-type]
    monkeypatch.setenv(kernel_module.CONVERSION_ENV, "software")
    assert kernel_module.use_hardware_conversion(DEVICE) is False


@pytest.mark.skipif(DEVICE.type == "cuda", reason="CPU fallback only exists without a GPU")
@pytest.mark.slow  # a fresh Python process: `make test`, not `make test-fast`
def test_cpu_without_interpreter_uses_the_reference() -> None:
    """Outside the interpreter a CPU tensor cannot reach Triton (no CPU
    backend): the public function must still write the right bytes."""
    script = (
        "import torch\n"
        "from kvscale_plugin.kernels import fp8_cache_write, fp8_cache_write_reference\n"
        "import importlib\n"
        "mod = importlib.import_module('kvscale_plugin.kernels.triton_fp8_write')\n"
        "assert not mod.INTERPRETER\n"
        "x = torch.randn(4, 2, 64, dtype=torch.bfloat16) * 300\n"
        "a = torch.zeros(2, 2, 16, 2, 64, dtype=torch.uint8); b = a.clone()\n"
        "s = torch.tensor([5, -1, 9, 30]); k = torch.tensor([0.37]); v = torch.tensor([3.0])\n"
        "fp8_cache_write(x, x, a[0], a[1], s, k, v)\n"
        "fp8_cache_write_reference(x, x, b[0], b[1], s, k, v)\n"
        "assert torch.equal(a, b) and a.any()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
