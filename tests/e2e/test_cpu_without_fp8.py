"""A CPU without AVX-512 or AMX (most laptops, many cloud VMs), as users meet it.

vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX. There, ``-q kvscale``
with ``--kv-cache-dtype auto`` on a checkpoint that declares a supported scheme serves the
model dtype's cache (bf16 here) with one warning, instead of picking an FP8 cache that vLLM
then refuses (stock vLLM picks FP8 and fails); an explicit ``--kv-cache-dtype fp8`` still
gets vLLM's own refusal, after kvscale loaded the checkpoint's scales.

Tests that need an FP8 cache carry ``needs_fp8_cpu_cache`` and are skipped up front on such
a CPU (tests/conftest.py); tests whose cache follows the CPU carry ``follows_cpu_fp8``.
``make test-without-fp8-cpu`` runs those, and every test that starts no engine, with torch's
capability checks answering "no" (``KVSCALE_TEST_CPU_WITHOUT_FP8=1``, tests/support/
amx_site); the first test here makes the same decision on every machine, in-process.
"""

from __future__ import annotations

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales
from kvscale_testing.probe import FP8_CPU_REFUSAL, layer_index, layer_scales, vllm_engine
from kvscale_testing.skips import CPU_FP8, KV_DTYPE, follows_cpu_fp8

from kvscale_plugin.hosts.vllm import method
from kvscale_plugin.hosts.vllm.platform_cache import DEGRADED, cpu_cannot_run_fp8_cache

pytestmark = pytest.mark.engine


def _serve_auto(ckpt: object, kvscale_warnings: object) -> tuple[set, dict, list]:
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        held = layer_scales(llm)
        engine_dtype = llm.llm_engine.vllm_config.cache_config.cache_dtype
        out = llm.generate(["The quick brown fox"], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert engine_dtype == "auto"
    pools = {s.pool_dtype for s in held.values()}
    assert {s.kv_cache_dtype for s in held.values()} == {"auto"}
    assert not any(s.pool_is_fp8 for s in held.values()), pools
    return pools, held, kvscale_warnings(DEGRADED)


def test_auto_serves_the_model_dtype_where_the_cpu_cannot_run_fp8(
    tiny, monkeypatch, kvscale_warnings
):
    """Where kvscale finds that the CPU cannot run vLLM's FP8 cache (told so here; torch's
    checks themselves are not patched in-process: vLLM picks its kernel library from them
    once per process), ``auto`` starts on the model dtype's cache, says so once, and the
    layers keep 1.0 (scales are applied only to an FP8 cache): FP8 is never reached."""
    monkeypatch.setattr(method, "cpu_cannot_run_fp8_cache", lambda: True)
    pools, held, warned = _serve_auto(tiny("without-fp8", num_layers=2), kvscale_warnings)
    assert pools == {torch.bfloat16}
    assert {(s.k, s.v) for s in held.values()} == {(1.0, 1.0)}
    assert len(warned) == 1, warned


@follows_cpu_fp8
@pytest.mark.skipif(CPU_FP8, reason="this CPU runs vLLM's FP8 KV cache: auto stays FP8")
def test_auto_degrades_on_this_cpu(tiny, kvscale_warnings):
    """The same on a CPU that really lacks AVX-512 / AMX (or simulates it in every
    process: ``make test-without-fp8-cpu``)."""
    pools, _, warned = _serve_auto(tiny("without-fp8", num_layers=2), kvscale_warnings)
    assert pools == {torch.bfloat16}
    assert len(warned) == 1, warned


@follows_cpu_fp8
@pytest.mark.skipif(CPU_FP8, reason="this CPU runs vLLM's FP8 KV cache: nothing is refused")
def test_explicit_fp8_is_refused_by_vllm_after_kvscale_loaded_the_scales(tiny):
    """``--kv-cache-dtype fp8`` asks vLLM for FP8 anyway: vLLM's own check refuses it (so
    the simulated CPU is the one vLLM sees), only after kvscale loaded and validated the
    checkpoint's scales into every layer."""
    ckpt = tiny("without-fp8", num_layers=2)
    with (
        pytest.raises(Exception) as raised,
        vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8"),
    ):
        pass
    chain, exc = [], raised.value
    while exc is not None and len(chain) < 16:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any(FP8_CPU_REFUSAL in text for text in chain), chain
    loaded = raised.value.kvscale_loaded_scales
    stored = read_stored_scales(ckpt)
    assert len(loaded) == len(stored) == 2
    for held in loaded.values():
        want = stored[layer_index(held.name)]
        assert (held.k, held.v) == pytest.approx((want["k"], want["v"]), rel=1e-6), held


@follows_cpu_fp8
def test_the_tests_cache_serves_here(tiny):
    """``KV_DTYPE`` (what tests whose cache follows the CPU run on) starts on this CPU: the
    FP8 cache where vLLM runs one, else bf16."""
    ckpt = tiny("without-fp8", num_layers=2)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        held = layer_scales(llm)
        out = llm.generate(["The quick brown fox"], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert KV_DTYPE == ("auto" if CPU_FP8 else "bfloat16")
    assert all(s.pool_is_fp8 == CPU_FP8 for s in held.values()), held


@pytest.mark.parametrize(("amx", "avx512", "cannot"), [(0, 0, True), (1, 0, False), (0, 1, False)])
def test_the_rule_is_vllms(monkeypatch, amx, avx512, cannot):
    """vLLM's CPU attention runs FP8 with AMX or AVX-512 (``_get_attn_isa``), asked of
    torch the same way."""
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: bool(amx))
    monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: bool(avx512))
    assert cpu_cannot_run_fp8_cache() is cannot
