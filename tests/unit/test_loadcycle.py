"""The load cycle's one policy: which caches serve the checkpoint's k/v scales."""

from __future__ import annotations

import pytest

from kvscale_plugin.loadcycle import computes_own_scales, serves_checkpoint_scales
from kvscale_plugin.scheme import FP8_KV_SCHEME, judge_kv_cache_scheme

SUPPORTED = judge_kv_cache_scheme(dict(FP8_KV_SCHEME))
UNSUPPORTED = judge_kv_cache_scheme({**FP8_KV_SCHEME, "num_bits": 4, "type": "int"})
NONE = judge_kv_cache_scheme(None)


@pytest.mark.parametrize(
    ("verdict", "dtype", "quantized", "serves"),
    [
        (SUPPORTED, "fp8", True, True),
        (SUPPORTED, "fp8_e4m3", True, True),
        # Scales computed per token and head as the cache is written: never the file's.
        (SUPPORTED, "fp8_per_token_head", True, False),
        (SUPPORTED, "int8_per_token_head", True, False),
        (SUPPORTED, "int4_per_token_head", True, False),
        # A layer kept in the model dtype (--kv-cache-dtype-skip-layers) or a bf16 cache.
        (SUPPORTED, "auto", False, False),
        (SUPPORTED, "bfloat16", False, False),
        (UNSUPPORTED, "fp8", True, False),
        # No scheme, FP8 cache chosen: stock vLLM loads per-tensor scales, and so do we.
        (NONE, "fp8", True, True),
        (NONE, "fp8_per_token_head", True, False),
    ],
)
def test_which_caches_serve_checkpoint_scales(verdict, dtype, quantized, serves):
    assert serves_checkpoint_scales(verdict, dtype, quantized=quantized) is serves


def test_only_per_token_head_modes_compute_their_own():
    assert [d for d in ("fp8", "fp8_e5m2", "fp8_per_token_head") if computes_own_scales(d)] == [
        "fp8_per_token_head"
    ]
