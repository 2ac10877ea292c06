"""kvscale's CPU FP8 cache write: exact contract, vLLM's CPU cache layout, and what
vLLM's own CPU op does instead. Both implementations: plain torch
(``kernels/cpu_cache_write.py``) and compiled (``kernels/cpu_native.py``, built from its
C source in this test run), through the ``write`` fixture.

The contract is the torch expression ``(x.float() / s).clamp(-448, 448).to(float8_e4m3fn)``
(s as fp32), scattered to the bytes vLLM's CPU attention reads. The layout ("vec") is
checked against vLLM's ``cpu_attn_reshape_and_cache`` on values every rounding mode
stores alike; the expected caches here are built with an independent per-token loop.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from fp8_helpers import assert_same_fp8
from kvscale_testing.cpu_cache import contract
from kvscale_testing.cpu_cache import expected_vec_cache as expected_cache
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.kernels import cpu_native
from kvscale_plugin.kernels.cpu_cache_write import (
    cache_target,
    cpu_fp8_cache_read,
    cpu_fp8_cache_write,
    plan_write,
    quantize_e4m3,
    write_planned,
)

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SCALES = [1.0, 0.37, 3.8627140522003174, 0.125, 1e-3]
# Block and head sizes vLLM's CPU backend accepts with an FP8 cache (multiples of 32).
GEOMETRIES = [(32, 32), (32, 64), (64, 128), (128, 64), (32, 256)]


def truncation(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Round-toward-zero e4m3 bytes, saturating, NaN -> 0x7E, zero -> +0 (vLLM's CPU op)."""
    y = x.float() / torch.tensor(scale, dtype=torch.float32)
    r = y.clamp(-448, 448).to(torch.float8_e4m3fn)
    code = r.view(torch.uint8).to(torch.int16)
    mag, sign = code & 0x7F, code & 0x80
    away = r.float().abs() > y.abs().clamp(max=448)
    mag = torch.where(away & (mag > 0), mag - 1, mag)
    mag = torch.where(torch.isnan(y), torch.full_like(mag, 0x7E), mag)
    sign = torch.where(mag == 0, torch.zeros_like(sign), sign)
    return (mag | sign).to(torch.uint8)


def special_values(scale: float) -> torch.Tensor:
    """NaN, +-inf, beyond +-448, subnormals, exact ties (RNE vs away), +-0, all scaled by s."""
    e4m3_ties = [
        1.0625,
        1.1875,
        1.3125,
        17.0,
        19.0,
        2.0**-9 * 1.5,
        2.0**-9 * 0.5,
        2.0**-7 * 1.0625,
        440.0,
        416.0 + 8.0,
        464.0,
    ]
    subnormals = [2.0**-9, 2.0**-8 * 3, 2.0**-7 * 0.875, 2.0**-10, 2.0**-12]
    big = [448.0, 449.0, 480.0, 1000.0, 1e6, 3e38]
    vals = [0.0, float("nan"), float("inf")] + e4m3_ties + subnormals + big
    out = torch.tensor(vals + [-v for v in vals], dtype=torch.float64) * scale
    return out.float()


def make_inputs(num_tokens, num_heads, head_size, dtype, scale, *, seed=0, specials=True):
    """key/value as column slices of one fused qkv tensor (what vLLM passes)."""
    g = torch.Generator().manual_seed(seed)
    width = num_heads * head_size
    qkv = torch.randn(num_tokens, 3 * width, generator=g) * 150 * scale
    if specials:
        sv = special_values(scale)
        flat_k = qkv[:, width : 2 * width].reshape(-1)
        flat_v = qkv[:, 2 * width :].reshape(-1)
        pos = torch.randperm(flat_k.numel(), generator=g)[: sv.numel()]
        flat_k[pos] = sv
        flat_v[pos.flip(0)] = sv
        qkv[:, width : 2 * width] = flat_k.view(num_tokens, width)
        qkv[:, 2 * width :] = flat_v.view(num_tokens, width)
    qkv = qkv.to(dtype)
    _, k, v = qkv.split(width, dim=-1)
    return k.view(num_tokens, num_heads, head_size), v.view(num_tokens, num_heads, head_size)


def random_cache(num_blocks, num_heads, block_size, head_size, seed=1):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks, num_heads, block_size, 2 * head_size)
    return torch.randint(0, 256, shape, generator=g).to(torch.uint8)


# The contract, elementwise ------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_equals_contract_on_every_bit_pattern(dtype, scale):
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    got = quantize_e4m3(x, scale).view(torch.uint8)
    assert_same_fp8(got, contract(x, scale))


@pytest.mark.parametrize("scale", SCALES)
def test_quantize_equals_contract_fp32(scale):
    g = torch.Generator().manual_seed(0)
    x = torch.cat(
        [
            torch.randn(200_000, generator=g) * 300 * scale,
            (torch.rand(50_000, generator=g) - 0.5) * 2.0**-6 * scale,  # subnormal range
            special_values(scale),
        ]
    )
    assert_same_fp8(quantize_e4m3(x, scale).view(torch.uint8), contract(x, scale))


def test_specials_behave_as_promised():
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1000.0, -1000.0, -0.0, 1.0625])
    got = quantize_e4m3(x, 1.0).view(torch.uint8).tolist()
    assert got[0] & 0x7F == 0x7F  # NaN stays NaN
    assert got[1:5] == [0x7E, 0xFE, 0x7E, 0xFE]  # saturate to +-448
    assert got[5] == 0x80  # -0 kept
    assert got[6] == 0x38  # tie 1.0625 -> 1.0 (even), not 1.125


# The cache write -----------------------------------------------------------------


def native_write(key, value, cache, slots, k_scale, v_scale):
    module = cpu_native.load()
    assert module is not None, cpu_native.failure()  # gcc is on every machine of this kind
    cpu_native.write_native(
        module, key, value, cpu_native.native_target(cache), slots, k_scale, v_scale
    )


WRITERS = {"torch": cpu_fp8_cache_write, "c": native_write}


@pytest.fixture(
    # "c" builds cpu_fp8_write.c on first use: `make test`, not `make test-fast`.
    params=[pytest.param(n, marks=pytest.mark.compile) if n == "c" else n for n in sorted(WRITERS)]
)
def write(request):
    """kvscale's CPU cache write ``(key, value, cache, slots, k_scale, v_scale)``, once
    per implementation."""
    return WRITERS[request.param]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_size"), GEOMETRIES)
def test_write_equals_contract_at_vllm_cpu_layout(write, dtype, block_size, head_size):
    num_blocks, num_heads, num_tokens = 5, 3, 2 * block_size + 7
    k_scale, v_scale = 0.37, 3.8627140522003174
    key, value = make_inputs(num_tokens, num_heads, head_size, dtype, k_scale)
    g = torch.Generator().manual_seed(2)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::6] = -1  # padding
    cache = random_cache(num_blocks, num_heads, block_size, head_size)
    expected = expected_cache(cache, key, value, slots, k_scale, v_scale)
    write(key, value, cache, slots, k_scale, v_scale)
    assert_same_fp8(cache, expected)


def test_write_only_first_rows_and_int32_slots_and_fp8_cache(write):
    key, value = make_inputs(10, 2, 64, torch.bfloat16, 1.0)
    slots = torch.tensor([5, 40, -1, 63], dtype=torch.int32)
    cache = random_cache(2, 2, 32, 64)
    expected = expected_cache(cache, key[:4], value[:4], slots, 1.0, 2.0)
    write(key, value, cache.view(torch.float8_e4m3fn), slots, 1.0, 2.0)
    assert_same_fp8(cache, expected)
    k_bytes, v_bytes = cpu_fp8_cache_read(cache, slots[slots >= 0])
    assert_same_fp8(k_bytes, contract(key[:4][slots >= 0], 1.0))
    assert_same_fp8(v_bytes, contract(value[:4][slots >= 0], 2.0))


def test_all_padding_and_empty_leave_the_cache_alone(write):
    key, value = make_inputs(3, 2, 64, torch.bfloat16, 1.0)
    cache = random_cache(2, 2, 32, 64)
    before = cache.clone()
    write(key, value, cache, torch.tensor([-1, -1, -1]), 1.0, 1.0)
    write(key[:0], value[:0], cache, torch.tensor([], dtype=torch.int64), 1.0, 1.0)
    assert torch.equal(cache, before)


def test_one_plan_serves_every_layer_of_a_step():
    """What the vLLM host does: one plan per step, reused by layers with their own
    caches, inputs and scales (the plan's scratch tensors carry nothing over)."""
    num_blocks, num_heads, block_size, head_size, n = 4, 2, 32, 64, 40
    g = torch.Generator().manual_seed(5)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n].to(torch.int32)
    slots[3::7] = -1
    caches = [random_cache(num_blocks, num_heads, block_size, head_size, seed=s) for s in (1, 2)]
    targets = [cache_target(c) for c in caches]
    assert targets[0].geometry == targets[1].geometry
    plan = plan_write(slots, targets[0].geometry)
    for layer, (cache, target) in enumerate(zip(caches, targets, strict=True)):
        k_scale, v_scale = (0.37, 3.8627140522003174) if layer == 0 else (0.125, 1e-3)
        key, value = make_inputs(n + 3, num_heads, head_size, DTYPES[layer], k_scale, seed=layer)
        expected = expected_cache(cache, key[:n], value[:n], slots, k_scale, v_scale)
        write_planned(key, value, target.flat, plan, k_scale, v_scale)
        assert_same_fp8(cache, expected)


def test_cache_that_is_a_view_into_a_larger_buffer(write):
    """A layer's cache need not be contiguous storage of its own (here every block of
    two layers interleaved): only its bytes are written."""
    num_blocks, num_heads, block_size, head_size, n = 3, 2, 32, 32, 50
    g = torch.Generator().manual_seed(6)
    both = torch.randint(0, 256, (num_blocks, 2, num_heads, block_size, 2 * head_size), generator=g)
    both = both.to(torch.uint8)
    cache = both[:, 1]
    assert not cache.is_contiguous()
    other_before = both[:, 0].clone()
    key, value = make_inputs(n, num_heads, head_size, torch.bfloat16, 0.5)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    expected = expected_cache(cache, key, value, slots, 0.5, 2.0)
    write(key, value, cache, slots, 0.5, 2.0)
    assert_same_fp8(cache, expected)
    assert torch.equal(both[:, 0], other_before)


@pytest.mark.parametrize("padding", [False, True])
def test_write_planned_op_count(padding):
    """The per-layer cost at decode sizes is torch's per-op overhead: guard the count
    (six aten ops per layer; two more, row selections, only in a step with padding)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    key, value = make_inputs(4, 3, 64, torch.bfloat16, 1.0)
    cache = random_cache(2, 3, 32, 64)
    target = cache_target(cache)
    slots = torch.tensor([3, -1, 40, 7]) if padding else torch.tensor([3, 9, 40, 7])
    plan = plan_write(slots, target.geometry)
    write_planned(key, value, target.flat, plan, 0.5, 2.0)  # warm the scale cache
    with Count() as count:
        write_planned(key, value, target.flat, plan, 0.5, 2.0)
    assert len(count.ops) == (8 if padding else 6), count.ops


def test_rejects_what_it_does_not_know():
    key, value = make_inputs(2, 2, 64, torch.bfloat16, 1.0)
    with pytest.raises(ValueError, match="layout"):
        cpu_fp8_cache_write(
            key, value, random_cache(2, 2, 32, 64), torch.tensor([0, 1]), 1.0, 1.0, layout="amx"
        )
    with pytest.raises(ValueError, match="1-byte"):
        cpu_fp8_cache_write(key, value, torch.zeros(2, 2, 32, 128), torch.tensor([0, 1]), 1.0, 1.0)


@pytest.mark.slow  # a fresh Python process: `make test`, not `make test-fast`
def test_importable_without_triton():
    # vLLM's CPU build does not install triton: the CPU write must not need it.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kvscale_plugin.kernels.cpu_cache_write as m; print(m.LAYOUTS)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]


# Against vLLM's own CPU op ----------------------------------------------------------


def vllm_write(key, value, cache, slots, k_scale, v_scale, isa="vec"):
    # vLLM's CPU build: must import here, never skip
    from kvscale_plugin.hosts.vllm.cpu_write import vllm_cpu_write

    vllm_cpu_write(key, value, cache, slots, isa, k_scale, v_scale)


# vLLM's CPU op writes an FP8 cache only in its AVX-512 / AMX builds (its AVX2 build raises
# "Unsupported CPU attention configuration"): kvscale's write against the contract, above,
# runs everywhere; these two compare it with vLLM's op where that op runs.
@needs_fp8_cpu_cache
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("block_size", "head_size"), GEOMETRIES)
def test_layout_is_vllms_vec_layout(write, dtype, block_size, head_size):
    """On values that every rounding stores alike, our cache equals vLLM's byte for byte."""
    num_blocks, num_heads, num_tokens = 4, 2, 3 * block_size
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(1, 0x7F, (2, num_tokens, num_heads, head_size), generator=g)
    codes |= torch.randint(0, 2, codes.shape, generator=g) << 7
    exact = codes.to(torch.uint8).view(torch.float8_e4m3fn).float() * 0.5  # scale 0.5: exact
    key, value = exact[0].to(dtype), exact[1].to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::7] = -1
    theirs = random_cache(num_blocks, num_heads, block_size, head_size)
    ours = theirs.clone()
    vllm_write(key, value, theirs, slots, 0.5, 0.5)
    write(key, value, ours, slots, 0.5, 0.5)
    assert torch.equal(ours, theirs)


@needs_fp8_cpu_cache
@pytest.mark.parametrize("dtype", DTYPES)
def test_vllm_cpu_op_truncates(dtype):
    """What stock vLLM 0.32's CPU write does (the reason this module exists): round
    toward zero everywhere, NaN -> 448, -0 -> +0; RNE agrees on about half the values."""
    block_size, head_size, num_heads, num_tokens = 32, 64, 2, 64
    key, value = make_inputs(num_tokens, num_heads, head_size, dtype, 1.0, specials=False)
    key[0, 0, :4] = torch.tensor([float("nan"), -0.0, 1.6016, -1.6016], dtype=dtype)
    slots = torch.arange(num_tokens)
    cache = torch.zeros(2, num_heads, block_size, 2 * head_size, dtype=torch.uint8)
    vllm_write(key, value, cache, slots, 1.0, 1.0)
    k_bytes, v_bytes = cpu_fp8_cache_read(cache, slots)
    stored = torch.cat([k_bytes.reshape(-1), v_bytes.reshape(-1)])
    x = torch.cat([key.reshape(-1), value.reshape(-1)])
    assert torch.equal(stored, truncation(x, 1.0))
    rne = contract(x, 1.0)
    agree = (stored == rne).float().mean().item()
    assert 0.4 < agree < 0.7, agree
    assert k_bytes[0, 0, :4].tolist() == [0x7E, 0x00, 0x3C, 0xBC]  # 1.6016 -> 1.5 (RNE 1.625)
