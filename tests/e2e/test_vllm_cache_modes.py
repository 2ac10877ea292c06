"""KV-cache modes that do not serve the checkpoint's scales: layers kept out of the
quantized cache (``--kv-cache-dtype-skip-layers``) and caches that compute their scales per
token and head (``fp8_per_token_head``, ``int8_per_token_head``, ``int4_per_token_head``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kvscale_testing.probe import layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.scheme import FP8_KV_SCHEME, judge_kv_cache_scheme

pytestmark = pytest.mark.engine

SCALES = {0: (2.5, 3.5), 1: (4.5, 5.5), 2: (6.5, 7.5)}


@needs_fp8_cpu_cache
def test_a_skipped_layer_keeps_the_model_dtype_and_no_scales(tiny, kvscale_warnings):
    """Layer 1 kept in bf16: kvscale serves it unscaled (its checkpoint scales are not
    applied) and says nothing is missing; stock loads them into the bf16 layer (unused)."""
    ckpt = tiny("skip-layers", num_layers=3, scales=SCALES)
    args = dict(kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["1"])
    with vllm_engine(ckpt, **args) as llm:
        stock = {n: (s.k, s.v, s.pool_is_fp8) for n, s in layer_scales(llm).items()}
    with vllm_engine(ckpt, quantization="kvscale", **args) as llm:
        ours = {n: (s.k, s.v, s.pool_is_fp8, s.source) for n, s in layer_scales(llm).items()}
    assert ours["model.layers.1.self_attn.attn"] == (1.0, 1.0, False, "unscaled")
    assert ours["model.layers.0.self_attn.attn"] == (2.5, 3.5, True, "checkpoint")
    assert ours["model.layers.2.self_attn.attn"] == (6.5, 7.5, True, "checkpoint")
    assert stock["model.layers.1.self_attn.attn"] == (4.5, 5.5, False)  # stock, as found
    assert kvscale_warnings("has no k_scale/v_scale tensors") == []


@pytest.mark.parametrize("dtype", ["fp8_per_token_head", "int8_per_token_head"])
def test_per_token_head_caches_use_no_checkpoint_scales(dtype):
    """vLLM's own ``is_quantized_kv_cache`` calls these caches quantized, yet they compute
    their scales as they write: kvscale's policy for a layer with that cache dtype serves
    no checkpoint scale (nothing applied, nothing validated). vLLM's CPU attention refuses
    these modes, so no CPU engine can show it; this asks vLLM's real functions."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    from kvscale_plugin.hosts.vllm.layers import layer_serves_checkpoint_scales

    verdict = judge_kv_cache_scheme(dict(FP8_KV_SCHEME))
    assert is_quantized_kv_cache(dtype)
    assert dtype not in CPUAttentionBackend.supported_kv_cache_dtypes
    assert not layer_serves_checkpoint_scales(verdict, SimpleNamespace(kv_cache_dtype=dtype))
    assert layer_serves_checkpoint_scales(verdict, SimpleNamespace(kv_cache_dtype="fp8"))
