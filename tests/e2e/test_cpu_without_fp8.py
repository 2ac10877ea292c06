"""A CPU without AVX-512 or AMX (most laptops, many cloud VMs), as users meet it.

vLLM's CPU attention refuses an FP8 KV cache there, after the model and its KV scales
loaded. Tests that need an FP8 cache carry ``needs_fp8_cpu_cache`` and are skipped up front
on such a CPU (tests/conftest.py); the rest run, on a bf16 cache where FP8 is not what they
check. ``make test-without-fp8-cpu`` runs a set of engine tests on this machine with both of
torch's capability checks answering "no" (``KVSCALE_TEST_CPU_WITHOUT_FP8=1``,
tests/support/amx_site), to prove that they skip or pass there, never fail.
"""

from __future__ import annotations

import pytest
from kvscale_testing.checkpoints import read_stored_scales
from kvscale_testing.skips import CPU_FP8, KV_DTYPE

from kvscale_plugin.demo.probe import FP8_CPU_REFUSAL, layer_index, vllm_engine

pytestmark = pytest.mark.engine


@pytest.mark.skipif(CPU_FP8, reason="this CPU runs vLLM's FP8 KV cache: nothing is refused")
def test_vllm_refuses_the_fp8_cache_after_kvscale_loaded_the_scales(tiny):
    """vLLM's own check refuses the FP8 cache (so the simulated CPU is the one vLLM sees),
    and only after kvscale loaded and validated the checkpoint's scales into every layer."""
    ckpt = tiny("without-fp8", num_layers=2)
    with pytest.raises(Exception) as raised, vllm_engine(ckpt, quantization="kvscale"):
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


def test_the_tests_cache_serves_here(tiny):
    """``KV_DTYPE`` (what tests that do not need FP8 run on) starts on this CPU: the FP8
    cache where vLLM runs one, else bf16, and kvscale says which."""
    ckpt = tiny("without-fp8", num_layers=2)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        out = llm.generate(["The quick brown fox"], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert KV_DTYPE == ("auto" if CPU_FP8 else "bfloat16")
