"""Per-head (``strategy: attn_head``) KV scales on real vLLM CPU engines.

Stock vLLM 0.32 serves these checkpoints (scales per KV head in ``_k_scale`` /
``_v_scale``, floats = max over heads, FP8 pool under ``auto``); kvscale must do at
least the same, and reject what stock would silently mis-serve.
"""

from __future__ import annotations

import json
import math

import pytest
from _run_script import run_script
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.engines import attention_layers, reload_weights
from kvscale_testing.probe import (
    layer_index,
    layer_scales,
    logprob_error,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.skips import follows_cpu_fp8, needs_fp8_cpu_cache

from kvscale_plugin.scales import CorruptScaleError
from kvscale_plugin.scalestate import merge, part
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine
PER_HEAD = {**FP8_KV_SCHEME, "strategy": "attn_head"}
# KV head 1 carries 3x the K/V of head 0 (compensated in q/o): heads need distinct scales.
HEAD_BOOST = (1.0, 3.0)


def per_head_ckpt(tiny, name: str, **fields):
    fields.setdefault("num_layers", 3)
    fields.setdefault("head_boost", HEAD_BOOST)
    return tiny(name, per_head=True, kv_cache_scheme=PER_HEAD, **fields)


def assert_heads_equal_checkpoint(scales: dict, stored: dict) -> None:
    assert len(scales) == len(stored)
    for name, s in scales.items():
        want = stored[layer_index(name)]
        assert s.k_heads == pytest.approx(want["k"], rel=1e-6), name
        assert s.v_heads == pytest.approx(want["v"], rel=1e-6), name
        # One-scale paths (CPU attention, host copies) get the max over heads.
        assert (s.k_float, s.k_cpu) == pytest.approx((max(want["k"]),) * 2, rel=1e-6), name
        assert (s.v_float, s.v_cpu) == pytest.approx((max(want["v"]),) * 2, rel=1e-6), name


@pytest.fixture(scope="module")
def per_head(tiny):
    return per_head_ckpt(tiny, "per-head")


@pytest.fixture(scope="module")
def reference(per_head):
    ids = reference_token_ids(per_head)
    with vllm_engine(per_head, kv_cache_dtype="bfloat16") as llm:
        return ids, teacher_forced_logprobs(llm, ids)


@needs_fp8_cpu_cache
def test_per_head_scales_load_per_head_with_an_fp8_pool(per_head, reference, tiny, monkeypatch):
    ids, ref = reference
    # Compare scale handling alone: vLLM's own CPU cache write for kvscale layers too
    # (kvscale's default CPU write rounds to nearest-even, stock's truncates).
    monkeypatch.setenv("KVSCALE_CPU_FP8_WRITE", "vllm")
    stored = read_stored_scales(per_head)
    # Every layer and head distinct.
    values = [x for layer in stored.values() for x in (*layer["k"], *layer["v"])]
    assert len(set(values)) == len(values)

    with vllm_engine(per_head, quantization="kvscale") as llm:
        ours = layer_scales(llm)
        ours_lp = teacher_forced_logprobs(llm, ids)
    assert all(s.pool_is_fp8 and s.source == "checkpoint" for s in ours.values())
    assert all(len(s.k_heads) == 2 for s in ours.values())
    assert_heads_equal_checkpoint(ours, stored)

    with vllm_engine(per_head) as llm:  # stock vLLM is right here: same layers, same logprobs
        stock = layer_scales(llm)
        stock_lp = teacher_forced_logprobs(llm, ids)
    for name, s in stock.items():
        assert (s.k_heads, s.v_heads, s.k_float, s.v_float) == (
            ours[name].k_heads,
            ours[name].v_heads,
            ours[name].k_float,
            ours[name].v_float,
        )
    assert ours_lp == stock_lp

    # As close to the bf16 cache as the per-tensor checkpoint of the same model, and
    # far closer than scale 1.0.
    per_tensor = tiny("per-head-as-tensor", num_layers=3, head_boost=HEAD_BOOST)
    missing = per_head_ckpt(tiny, "per-head-missing", write_scales=False)
    errors = {"per-head": logprob_error(ref, ours_lp)[0]}
    for label, ckpt in (("per-tensor", per_tensor), ("scale 1.0", missing)):
        with vllm_engine(ckpt, quantization="kvscale") as llm:
            errors[label] = logprob_error(ref, teacher_forced_logprobs(llm, ids))[0]
    assert errors["per-head"] <= errors["per-tensor"] * 1.25 + 1e-3, errors
    assert errors["per-head"] * 3 < errors["scale 1.0"], errors


@needs_fp8_cpu_cache
def test_per_head_legacy_kv_scale_serves_k_and_v(tiny):
    ckpt = per_head_ckpt(tiny, "per-head-kv_scale", naming="kv_scale")
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
    assert all(s.source == "duplicated" for s in scales.values())
    assert_heads_equal_checkpoint(scales, read_stored_scales(ckpt))


@follows_cpu_fp8
def test_corrupt_head_stops_start_up_naming_layer_and_head(tiny):
    scales = {0: ([1.5, math.nan], [1.0, 2.0]), 1: ([1.0, 2.0], [0.0, 2.0]), 2: ([1, 2], [1, 2])}
    ckpt = per_head_ckpt(tiny, "per-head-corrupt", scales=scales)
    # An explicit FP8 cache: the refusal comes at load, before vLLM's CPU checks it.
    with pytest.raises(CorruptScaleError) as info:
        with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8"):
            pass
    text = str(info.value)
    assert "model.layers.0.self_attn.k_scale[head 1]: NaN" in text
    assert "model.layers.1.self_attn.v_scale[head 0]: 0" in text
    assert text.count("\n  - ") == 2


@follows_cpu_fp8
def test_wrong_head_count_is_a_clear_error(tiny):
    three = {i: ([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]) for i in range(3)}
    ckpt = per_head_ckpt(tiny, "per-head-three", scales=three)
    with pytest.raises(CorruptScaleError) as info:
        with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8"):
            pass
    text = str(info.value)
    assert "model.layers.0.self_attn.k_scale: shape (3, 1, 1) does not match" in text
    assert "expects [2, 1, 1] or [2]" in text


@needs_fp8_cpu_cache
def test_reload_dummy_then_real_then_new_per_head_scales(tiny, per_head):
    other = per_head_ckpt(
        tiny, "per-head-b", scales={i: ([1.5 + i, 2.5], [3.5, 4.5 + i]) for i in range(3)}
    )
    with vllm_engine(per_head, quantization="kvscale", load_format="dummy") as llm:
        dummy = layer_scales(llm)
        assert all(s.k_heads == (1.0, 1.0) for s in dummy.values())
        # The per-layer max on the device (kvscale's CUSTOM backend reads it).
        max_ptrs = {n: lyr._kvscale_k_max.data_ptr() for n, lyr in attention_layers(llm).items()}
        for ckpt in (per_head, other, other, per_head):
            reload_weights(llm, ckpt)
            now = layer_scales(llm)
            stored = read_stored_scales(ckpt)
            assert_heads_equal_checkpoint(now, stored)
            for name, s in now.items():  # same buffers, updated in place
                assert (s.k_ptr, s.v_ptr) == (dummy[name].k_ptr, dummy[name].v_ptr)
            for name, lyr in attention_layers(llm).items():
                want = stored[layer_index(name)]
                assert float(lyr._kvscale_k_max) == pytest.approx(max(want["k"]), rel=1e-6)
                assert float(lyr._kvscale_v_max) == pytest.approx(max(want["v"]), rel=1e-6)
                assert lyr._kvscale_k_max.data_ptr() == max_ptrs[name]


@needs_fp8_cpu_cache
@pytest.mark.parametrize("num_kv_heads", [2, 1], ids=["partitioned", "replicated"])
def test_tensor_parallel_ranks_hold_their_heads(tiny, tmp_path, num_kv_heads):
    boost = HEAD_BOOST[:num_kv_heads]
    ckpt = per_head_ckpt(
        tiny,
        f"per-head-tp-{num_kv_heads}",
        num_layers=2,
        num_kv_heads=num_kv_heads,
        head_boost=boost,
    )
    ids = list(reference_token_ids(ckpt))[:24]
    args = (str(ckpt), json.dumps(ids), "2", "heads")
    result = run_script("_multiproc_engine.py", *args, tmp_path=tmp_path, timeout=300)
    ranks = result["scales"]
    assert len(ranks) == 2
    stored = read_stored_scales(ckpt)
    # The scale state (KV connectors, P/D) gathers every head from the ranks: the state a
    # single worker holding the checkpoint's whole vectors has, whatever the TP layout.
    names = result["state"]["layers"]
    assert len(names) == len(stored)
    one_worker = merge(
        [
            part(
                [
                    (n, stored[layer_index(n)]["k"], stored[layer_index(n)]["v"], None)
                    for n in names
                ],
                True,
            )
        ]
    )
    assert result["state"]["tag"] == one_worker.tag
    for rank, scales in enumerate(ranks):
        assert len(scales) == len(stored)
        for name, (k, v, k_float, v_float) in scales.items():
            want = stored[layer_index(name)]
            head = rank if num_kv_heads == 2 else 0  # partitioned: one head each; else shared
            assert k == pytest.approx([want["k"][head]], rel=1e-6), (rank, name)
            assert v == pytest.approx([want["v"][head]], rel=1e-6), (rank, name)
            assert (k_float, v_float) == pytest.approx((k[0], v[0]), rel=1e-6)
