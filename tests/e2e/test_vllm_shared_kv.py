"""Layers that read another layer's KV cache (Gemma-4, Gemma-3n: ``num_kv_shared_layers``)
serve the scales that cache was written with -- their target's -- on a real vLLM engine.

Stock vLLM 0.32 leaves every sharing layer at 1.0 (nothing in its Gemma code copies a
scale; measured here: the stock cell). With an FP8 cache the bytes a sharing layer reads
were quantized with the target's scale, so 1.0 dequantizes them wrongly."""

from __future__ import annotations

import json
import logging
import math

import pytest
from _run_script import run_script
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.engines import reload_weights, vec_layout_dtype
from kvscale_testing.probe import (
    layer_scales,
    logprob_error,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.shared_kv import (
    ASSISTANT_SHARING,
    SHARING,
    build_gemma4_assistant,
    build_shared_kv_checkpoint,
    stored_scales,
)
from kvscale_testing.skips import (
    KV_DTYPE,
    follows_cpu_fp8,
    needs_avx512_cpu_for_tp,
    needs_fp8_cpu_cache,
)

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-kv")

    def make(name: str, **kw):
        path = root / name
        return path if (path / "config.json").exists() else build_shared_kv_checkpoint(path, **kw)

    return make


def _held(llm) -> dict[str, tuple[float, ...]]:
    return {
        n: (s.k, s.v, s.k_float, s.v_float, s.k_cpu, s.v_cpu) for n, s in layer_scales(llm).items()
    }


@needs_fp8_cpu_cache
@pytest.mark.parametrize("family", ["gemma4", "gemma3n"])
def test_sharing_layers_serve_their_targets_scales_stock_serves_one(ckpts, family, caplog):
    caplog.set_level(logging.INFO, logger="kvscale_plugin")
    ckpt = ckpts(family, family=family)
    with vllm_engine(ckpt) as llm:
        stock = _held(llm)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        ours = _held(llm)
        sources = {n: s.source for n, s in layer_scales(llm).items()}
    assert ours["model.layers.0.self_attn.attn"] == (0.5, 0.25) * 3
    assert ours["model.layers.1.self_attn.attn"] == (1.5, 1.25) * 3
    for layer, target in SHARING.items():
        assert ours[layer] == ours[target], layer  # device tensor, float, CPU copy
        assert sources[layer] == "shared"
        assert stock[layer] == (1.0, 1.0) * 3, stock  # stock vLLM 0.32, as found
        assert stock[target] == ours[target]
    said = [r.getMessage() for r in caplog.records if r.name.startswith("kvscale")]
    assert not [m for m in said if "has no k_scale/v_scale tensors" in m], said
    assert any("2 reading another layer's cache, with its scales" in m for m in said), said


@needs_fp8_cpu_cache
def test_scales_under_a_sharing_layers_own_name_lose_to_the_targets(ckpts, kvscale_warnings):
    """The checkpoint ships scales for sharing layers (one differs, one is NaN): the
    target's are served, one warning lists the differing pair, one names the unused
    corrupt tensor; the start is not refused."""
    ckpt = ckpts("own", own_scales={2: (0.75, 0.5), 3: (math.nan, 1.25)})
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        held = _held(llm)
    for layer, target in SHARING.items():
        assert held[layer] == held[target], layer
    differ = kvscale_warnings("not the ones the checkpoint ships under their own names")
    assert len(differ) == 1 and "model.layers.2.self_attn.attn ships (0.75, 0.5)" in differ[0]
    corrupt = kvscale_warnings("corrupt k/v scales under layers that read another")
    assert len(corrupt) == 1 and "model.layers.3.self_attn.k_scale" in corrupt[0], corrupt


@needs_fp8_cpu_cache
def test_a_reload_moves_the_sharing_layers_with_their_targets(ckpts):
    first = ckpts("reload-a")
    second = ckpts("reload-b", scales={0: (2.5, 3.5), 1: (4.5, 5.5)})
    with vllm_engine(first, quantization="kvscale") as llm:
        before = {n: (s.k_ptr, s.v_ptr) for n, s in layer_scales(llm).items()}
        reload_weights(llm, second)
        held = _held(llm)
        after = {n: (s.k_ptr, s.v_ptr) for n, s in layer_scales(llm).items()}
    assert held["model.layers.0.self_attn.attn"] == (2.5, 3.5) * 3
    assert held["model.layers.1.self_attn.attn"] == (4.5, 5.5) * 3
    for layer, target in SHARING.items():
        assert held[layer] == held[target], layer
    assert after == before  # in place: the same buffers


def test_on_a_bf16_cache_corrupt_sharing_scales_are_named_not_refused(ckpts, kvscale_warnings):
    """A bf16 cache (every CPU runs it) applies no scale: every layer holds 1.0, and a NaN
    under a sharing layer's name is named in a warning, never a refusal."""
    ckpt = ckpts("own-bf16", own_scales={3: (math.nan, 1.25)})
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="bfloat16") as llm:
        held = _held(llm)
        out = llm.generate(["The quick brown fox"], use_tqdm=False)
    assert out[0].outputs[0].token_ids
    assert set(held.values()) == {(1.0, 1.0) * 3}
    corrupt = kvscale_warnings("corrupt k/v scales under layers that read another")
    assert len(corrupt) == 1 and "model.layers.3.self_attn.k_scale" in corrupt[0], corrupt


@needs_fp8_cpu_cache
def test_logprobs_are_closer_to_the_bf16_cache_than_stocks(ckpts, monkeypatch):
    """Gemma-4 with K boosted (scale 1.0 clips it) and calibrated scales for the writing
    layers: teacher-forced logprobs against a bf16-cache run, vLLM's own (truncating) CPU
    write on both sides, so that only the scales differ. Gemma normalizes each attention
    output (post-attention norm), so a wrong V scale on a sharing layer cancels out and
    only its K scale shows: k_scale ~ 110 here. Measured (2026-12-04, AVX-512 CPU): mean
    |dlogprob| stock 0.126, kvscale 0.051 (boost 1e3: 0.085 vs 0.045). On a CPU with AMX
    the model runs in fp16 (``vec_layout_dtype``): for a bf16 model vLLM picks its AMX cache
    layout, whose FP8 attention gave kvscale's calibrated scales a larger error than 1.0
    (2026-12-04, Intel Xeon with AMX: bf16 stock 0.172, kvscale 0.204; fp16 0.120 vs
    0.044)."""
    monkeypatch.setenv("KVSCALE_CPU_FP8_WRITE", "vllm")
    ckpt = ckpts("boosted", scales="calibrate", boost=1e4)
    ids = reference_token_ids(ckpt)
    dtype = vec_layout_dtype()  # vLLM's AMX cache layout: see the docstring
    with vllm_engine(ckpt, kv_cache_dtype="bfloat16", dtype=dtype) as llm:
        reference = teacher_forced_logprobs(llm, ids)
    with vllm_engine(ckpt, dtype=dtype) as llm:
        stock, _ = logprob_error(teacher_forced_logprobs(llm, ids), reference)
    with vllm_engine(ckpt, quantization="kvscale", dtype=dtype) as llm:
        held = _held(llm)
        ours, _ = logprob_error(teacher_forced_logprobs(llm, ids), reference)
    stored = stored_scales(ckpt)
    assert held["model.layers.1.self_attn.attn"][:2] == pytest.approx(stored[1], rel=1e-6)
    for layer, target in SHARING.items():
        assert held[layer] == held[target]
    print(f"mean |dlogprob| vs bf16 cache: stock {stock:.4f}, kvscale {ours:.4f}")
    assert ours * 2 <= stock, (ours, stock)


@needs_fp8_cpu_cache
def test_per_head_scales_are_shared_per_head(ckpts):
    """``strategy: attn_head`` (two KV heads): each sharing layer holds its target's
    per-head scales on the device and their max as the float; stock holds 1.0."""
    ckpt = ckpts("per-head", per_head=True)
    with vllm_engine(ckpt) as llm:
        stock = {n: (s.k_heads, s.v_heads) for n, s in layer_scales(llm).items()}
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        held = layer_scales(llm)
    assert held["model.layers.0.self_attn.attn"].k_heads == (0.5, 1.0)
    assert held["model.layers.1.self_attn.attn"].v_heads == (1.25, 2.5)
    for layer, target in SHARING.items():
        mine, theirs = held[layer], held[target]
        assert (mine.k_heads, mine.v_heads) == (theirs.k_heads, theirs.v_heads), layer
        assert (mine.k_float, mine.v_float) == (max(theirs.k_heads), max(theirs.v_heads))
        assert set(stock[layer][0]) == set(stock[layer][1]) == {1.0}, stock[layer]


@follows_cpu_fp8
@needs_avx512_cpu_for_tp
def test_tensor_parallel_ranks_share_their_own_heads(ckpts, tmp_path):
    """TP=2 on the per-head checkpoint (two KV heads: one per rank): on each rank every
    sharing layer holds exactly what its target holds there -- that rank's head of the
    target's per-head scales -- device values and floats. A bf16 cache (where vLLM's CPU
    attention runs no FP8 one) serves 1.0 everywhere: the sharing rule still holds."""
    ckpt = ckpts("per-head", per_head=True)
    ids = list(reference_token_ids(ckpt))[:16]
    args = (str(ckpt), json.dumps(ids), "2", "heads")
    env = {"KVSCALE_TEST_KV_DTYPE": KV_DTYPE}
    result = run_script("_multiproc_engine.py", *args, tmp_path=tmp_path, timeout=400, env=env)
    assert len(result["scales"]) == 2  # one answer per TP rank
    for rank, held in enumerate(result["scales"]):
        target = held["model.layers.0.self_attn.attn"]
        if KV_DTYPE == "auto":  # FP8: rank r holds head r of (0.5, 1.0) / (0.25, 0.5)
            assert (target[0], target[1]) == ([(0.5, 1.0)[rank]], [(0.25, 0.5)[rank]]), held
        for layer, source in SHARING.items():
            assert held[layer] == held[source], (rank, layer, held)
    assert len(result["tokens"]) == 8


@needs_fp8_cpu_cache
def test_the_gemma4_assistant_drafter_reads_with_its_targets_scales(ckpts, tmp_path_factory):
    """Speculative decoding with Gemma-4's bf16 assistant (its Q-only layers read the
    target's FP8 cache, wired by vLLM's proposer after loading): stock vLLM 0.32 serves
    them at 1.0 (as found); kvscale gives each its target layer's scales, also after a
    reload of the target, and the engine serves."""
    target = ckpts("assistant-target")
    assistant = build_gemma4_assistant(tmp_path_factory.mktemp("assistant"), target)
    spec = {"model": str(assistant), "num_speculative_tokens": 2}
    with vllm_engine(target, speculative_config=spec) as llm:
        stock = _held(llm)
    second = ckpts("assistant-reload", scales={0: (2.5, 3.5), 1: (4.5, 5.5)})
    with vllm_engine(target, quantization="kvscale", speculative_config=spec) as llm:
        ours = _held(llm)
        out = llm.generate(["The quick brown fox"], use_tqdm=False)
        reload_weights(llm, second)
        reloaded = _held(llm)
    assert out[0].outputs[0].token_ids
    assert {n for n in ours if n.startswith("draft_model.")} == set(ASSISTANT_SHARING)
    for draft, source in ASSISTANT_SHARING.items():
        assert stock[draft] == (1.0, 1.0) * 3, stock  # stock vLLM 0.32, as found
        assert ours[draft] == ours[source] != (1.0, 1.0) * 3, (draft, ours)
        assert reloaded[draft] == reloaded[source], (draft, reloaded)
    assert reloaded["draft_model.layers.1.self_attn.attn"] == (4.5, 5.5) * 3
