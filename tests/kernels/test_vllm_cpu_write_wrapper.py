"""kvscale's wrapper of vLLM's CPU ``do_kv_cache_update``, driven directly (no engine).

The engine tests (tests/e2e/test_vllm_cpu_write.py) prove the write inside real vLLM
engines, but need a CPU on which vLLM runs an FP8 cache (AVX-512 or AMX) and vLLM's own
op as the layout oracle. These tests hold everywhere: the routing, the per-layer write
target (followed when the cache's storage is swapped), the per-step write plans, and
the bytes against the torch contract at the positions of vLLM's "vec" layout. Only the
layout proof against vLLM's op is stood in for (it is what needs that CPU).
"""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch
from kvscale_testing.cpu_cache import expected_vec_cache as _expected
from kvscale_testing.cpu_routes import model_write_routes

from kvscale_plugin.hosts.vllm import cpu_write
from kvscale_plugin.hosts.vllm.process import HOST

pytest.importorskip("vllm")

pytestmark = pytest.mark.compile  # the default mode builds the C write


class _Method:
    is_kvscale = True


class _Layer(torch.nn.Module):
    def __init__(self, k_scale: float, v_scale: float) -> None:
        super().__init__()
        self.quant_method = _Method()
        self.isa = "vec"
        self._k_scale_float = k_scale
        self._v_scale_float = v_scale


class _Impl:
    """The two attributes of vLLM's ``CPUAttentionBackendImpl`` the wrapper reads."""

    kv_cache_dtype = "fp8"
    attn_type = "decoder"


def _vllms_write(*args: Any) -> None:
    raise AssertionError("routed to vLLM's write")


@pytest.fixture(params=["rne", "rne-torch"])
def mode(request, monkeypatch) -> str:
    monkeypatch.setenv(cpu_write.ENV_VAR, request.param)
    # vLLM's op is the layout oracle; it refuses FP8 on a CPU without AVX-512/AMX.
    monkeypatch.setattr(cpu_write, "layout_matches_vllm", lambda *a, **k: True)
    return request.param


def _inputs(seed: int, tokens: int = 9, heads: int = 2, head_size: int = 32):
    g = torch.Generator().manual_seed(seed)
    key = torch.randn(tokens, heads, head_size, generator=g).to(torch.bfloat16) * 3
    value = torch.randn(tokens, heads, head_size, generator=g).to(torch.bfloat16) * 3
    return key, value


def test_kvscale_layer_is_written_by_the_contract_and_followed_across_a_swap(mode: str) -> None:
    from kvscale_plugin.kernels import cpu_native

    if mode == "rne" and cpu_native.load() is None:
        pytest.skip("no C compiler: the compiled write is not built here")
    update = cpu_write._wrap(_vllms_write)
    impl, layer = _Impl(), _Layer(0.0123, 0.0071)
    cache = torch.randint(0, 256, (4, 2, 16, 64), dtype=torch.uint8)
    slots = torch.randperm(4 * 16)[:9]
    slots[3] = -1
    key, value = _inputs(0)
    expected = _expected(cache, key, value, slots, 0.0123, 0.0071)
    update(impl, layer, key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert model_write_routes(_Model(impl)) == {
        "attn": {"torch.bfloat16": "c:vec" if mode == "rne" else "torch:vec"}
    }
    held = impl.__dict__[cpu_write._TARGET_ATTR]
    assert held.serves(cache, held.route)

    # The same tensor object with other storage: the next write lands in the new one.
    old_view = cache[:]
    old_bytes = old_view.clone()
    replacement = torch.zeros_like(cache)
    cache.set_(replacement.untyped_storage(), 0, cache.shape, cache.stride())
    assert not held.serves(cache, held.route)
    key, value = _inputs(1)
    expected = _expected(cache, key, value, slots, 0.0123, 0.0071)
    update(impl, layer, key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(old_view, old_bytes)  # the old storage was not written


class _Model(torch.nn.Module):
    def __init__(self, impl: _Impl) -> None:
        super().__init__()
        self.attn = torch.nn.Module()
        self.attn.impl = impl


def test_non_kvscale_layers_and_bf16_caches_keep_vllms_write(mode: str) -> None:
    calls = []
    update = cpu_write._wrap(lambda *args: calls.append(args))
    cache = torch.zeros(2, 2, 16, 64, dtype=torch.uint8)
    slots = torch.arange(4)
    key, value = _inputs(2, tokens=4)
    stock = _Layer(1.0, 1.0)
    stock.quant_method = object()
    update(_Impl(), stock, key, value, cache, slots)
    bf16 = _Impl()
    bf16.kv_cache_dtype = "auto"
    update(bf16, _Layer(1.0, 1.0), key, value, cache, slots)
    assert len(calls) == 2 and not cache.any()


def test_one_plan_per_forward_step_shared_by_layers() -> None:
    """The plain-torch write computes a step's byte offsets once per forward context,
    shares them between layers, makes them again in the next step even when the slot
    tensor was refilled in place, and drops them with their context."""
    from vllm.forward_context import override_forward_context

    class Step:  # stands in for vLLM's ForwardContext (only its identity is used)
        pass

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_write.ENV_VAR, "rne-torch")
        patch.setattr(cpu_write, "layout_matches_vllm", lambda *a, **k: True)
        update = cpu_write._wrap(_vllms_write)
        layers = [(_Impl(), _Layer(0.02 * (i + 1), 0.01 * (i + 1))) for i in range(3)]
        caches = [torch.zeros(4, 2, 16, 64, dtype=torch.uint8) for _ in layers]
        g = torch.Generator().manual_seed(7)
        slots = torch.randperm(64, generator=g)[:6]

        def write_step(seed: int) -> None:
            for index, ((impl, layer), cache) in enumerate(zip(layers, caches, strict=True)):
                key, value = _inputs(seed + index, tokens=6)
                ks, vs = layer._k_scale_float, layer._v_scale_float
                expected = _expected(cache, key, value, slots, ks, vs)
                update(impl, layer, key, value, cache, slots)
                assert torch.equal(cache, expected)

        step = Step()
        with override_forward_context(step):
            write_step(0)
            assert len(HOST.step_plans.plans) == 1  # all layers, one plan
            first = next(iter(HOST.step_plans.plans.values())).plan
        slots.numpy()[:] = torch.randperm(64, generator=g)[:6].numpy()  # no version bump
        step = Step()
        with override_forward_context(step):
            write_step(100)
            (held, plan), *rest = HOST.step_plans.plans.values()
            assert not rest and held is slots and plan is not first
        del step
        gc.collect()
        assert not HOST.step_plans.plans
