from __future__ import annotations

import pytest

from kvscale_plugin.scheme import FP8_KV_SCHEME, judge_kv_cache_scheme


def test_llm_compressor_fp8_scheme_is_supported():
    verdict = judge_kv_cache_scheme(FP8_KV_SCHEME)
    assert verdict.declared and verdict.supported
    assert verdict.assumed == {}


def test_omitted_fields_get_library_defaults_and_are_reported():
    verdict = judge_kv_cache_scheme({"num_bits": 8, "type": "float"})
    assert verdict.supported
    assert set(verdict.assumed) == {"strategy", "symmetric", "dynamic"}
    text = verdict.describe()
    assert "strategy=tensor" in text and "symmetric=true" in text and "dynamic=false" in text


def test_no_scheme():
    verdict = judge_kv_cache_scheme(None)
    assert not verdict.declared and not verdict.supported


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"type": "int"}, "type=int"),
        ({"num_bits": 4}, "num_bits=4"),
        ({"strategy": "channel"}, "strategy=channel"),
        ({"strategy": "group", "group_size": 16}, "strategy=group"),
        ({"strategy": "token", "dynamic": True}, "strategy=token"),
        ({"dynamic": True}, "dynamic=true"),
        ({"symmetric": False}, "symmetric=false"),
    ],
)
def test_unsupported_schemes_say_why(change, reason):
    verdict = judge_kv_cache_scheme({**FP8_KV_SCHEME, **change})
    assert verdict.declared and not verdict.supported
    assert reason in verdict.reason


@pytest.mark.parametrize(
    ("scheme", "field"),
    [
        ({"num_bits": "eight", "type": "float"}, "num_bits"),
        ({"num_bits": 8, "type": "float", "colour": "red"}, "colour"),
        ({"num_bits": 8, "type": "complex"}, "type"),
    ],
)
def test_malformed_scheme_is_unsupported_not_an_exception(scheme, field):
    verdict = judge_kv_cache_scheme(scheme)
    assert not verdict.supported
    assert verdict.reason.startswith("malformed") and field in verdict.reason


def test_non_object_scheme():
    verdict = judge_kv_cache_scheme(["fp8"])
    assert verdict.declared and not verdict.supported and "JSON object" in verdict.reason


def test_attn_head_is_supported_per_head():
    verdict = judge_kv_cache_scheme({**FP8_KV_SCHEME, "strategy": "attn_head"})
    assert verdict.supported and verdict.per_head
    assert "per-head" in verdict.describe()
    assert not judge_kv_cache_scheme(FP8_KV_SCHEME).per_head


@pytest.mark.parametrize("change", [{"dynamic": True}, {"symmetric": False}, {"num_bits": 4}])
def test_attn_head_with_other_problems_is_unsupported(change):
    verdict = judge_kv_cache_scheme({**FP8_KV_SCHEME, "strategy": "attn_head", **change})
    assert not verdict.supported and not verdict.per_head
