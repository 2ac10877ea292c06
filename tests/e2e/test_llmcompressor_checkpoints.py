"""Real llm-compressor 0.14 checkpoints (what users make FP8-KV checkpoints with), read by
``kvscale inspect`` and served by real vLLM CPU engines, stock and with kvscale.

The seven checkpoints (``kvscale_testing.llmcompressor``; made once per change of
tests/fixtures/llmcompressor/make_checkpoints.py by ``oneshot`` in .venv-llmcompressor) are
a tiny 2-layer Llama whose K/V reach ~3,000 (beyond FP8's 448: the calibrated scales
matter) and whose KV head 1 carries 3x the K/V of head 0. For each: the
``kv_cache_scheme`` and scale tensors exactly as llm-compressor wrote them, the
``kvscale inspect`` verdict, and engine starts under stock vLLM and kvscale with a bf16
cache and with the FP8 cache the scheme selects (pool dtype, scales held, mean
|logprob difference| against the bf16 cache). On a CPU without AVX-512 / AMX vLLM refuses
the FP8 cache: those tests first check what the layers loaded, then skip (tests/conftest.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.llmcompressor import (
    attention_tensors,
    checkpoint_names,
    llmcompressor_checkpoints,
    quantization_config,
)
from kvscale_testing.probe import (
    FP8_CPU_REFUSAL,
    LayerScales,
    layer_index,
    layer_scales,
    logprob_error,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.fp8 import PLAUSIBLE_SCALE_MAX, PLAUSIBLE_SCALE_MIN
from kvscale_plugin.inspection import run_inspect
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine

NAMES = checkpoint_names()
NUM_LAYERS = 2
NUM_KV_HEADS = 2
STATIC_FP8 = "fp8-static-kv-tensor"
ATTENTION = "attention-qkv"
SERVED = tuple(n for n in NAMES if n != STATIC_FP8)

#: ``quantization_config.kv_cache_scheme`` exactly as llm-compressor 0.14.0.1
#: (compressed-tensors 0.19.0) writes it for a per-tensor FP8 KV cache: the project's
#: ``FP8_KV_SCHEME`` (the tests' checkpoints declare it), proven equal to the real output here.
LC_PER_TENSOR = FP8_KV_SCHEME
LC_ATTN_HEAD = {**LC_PER_TENSOR, "strategy": "attn_head"}
KV_SCHEME = {
    "kv-tensor": LC_PER_TENSOR,
    "kv-head": LC_ATTN_HEAD,
    "fp8-dynamic-kv-tensor": LC_PER_TENSOR,
    STATIC_FP8: LC_PER_TENSOR,
    "fp8-dynamic-kv-head": LC_ATTN_HEAD,
    "w8a8-int8-kv-tensor": LC_PER_TENSOR,
    # The attention example's kv_cache_scheme comes from its config_groups: the observer
    # it ran with is recorded.
    ATTENTION: {**LC_PER_TENSOR, "observer": "minmax"},
}
#: dtype of a quantized projection's stored weight.
WEIGHT_DTYPE = {
    "kv-tensor": torch.bfloat16,
    "kv-head": torch.bfloat16,
    "fp8-dynamic-kv-tensor": torch.float8_e4m3fn,
    STATIC_FP8: torch.float8_e4m3fn,
    "fp8-dynamic-kv-head": torch.float8_e4m3fn,
    "w8a8-int8-kv-tensor": torch.int8,
    ATTENTION: torch.bfloat16,
}
#: Where vLLM's CPU build stops on the static FP8 W8A8 weights (its CPU ``_C`` op has
#: another signature), before any KV cache matters: stock and kvscale alike.
STATIC_FP8_CPU_FAILURE = "_C::static_scaled_fp8_quant() expected at most 0 argument(s)"
#: Mean |logprob difference| against the bf16 cache allowed for an FP8 cache with the
#: checkpoint's scales (measured on this model: 0.008 kvscale, 0.012-0.015 stock; with every
#: scale set to 1.0, K/V clip at 448: 0.23).
FP8_MEAN_ERROR_MAX = 0.03


def per_head(name: str) -> bool:
    return KV_SCHEME[name]["strategy"] == "attn_head"


def kv_shape(name: str) -> tuple[int, ...]:
    return (NUM_KV_HEADS, 1, 1) if per_head(name) else (1,)


def implausible(value: float) -> bool:
    """A scale no calibration gives (kvscale's rule): not finite, <= 0, or out of range."""
    return not (math.isfinite(value) and PLAUSIBLE_SCALE_MIN <= value <= PLAUSIBLE_SCALE_MAX)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, Path]:
    return llmcompressor_checkpoints()


def written_kv(ckpt: Path) -> dict[int, tuple[tuple[float, ...], tuple[float, ...]]]:
    """layer -> (k values, v values) as stored (one per KV head for attn_head)."""
    t = attention_tensors(ckpt)
    return {
        i: tuple(  # type: ignore[misc]
            tuple(float(x) for x in t[f"model.layers.{i}.self_attn.{kind}_scale"].flatten())
            for kind in ("k", "v")
        )
        for i in range(NUM_LAYERS)
    }


def bad_q_scales(ckpt: Path) -> list[str]:
    """The checkpoint's q_scale tensors that kvscale takes for uninitialised memory."""
    return sorted(
        name
        for name, t in attention_tensors(ckpt).items()
        if name.endswith(".q_scale") and any(implausible(float(x)) for x in t.flatten())
    )


# -- what llm-compressor wrote -------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_scheme_as_written_and_parsed_by_compressed_tensors(checkpoints, name):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    qc = quantization_config(checkpoints[name])
    assert qc["quant_method"] == "compressed-tensors"
    assert qc["version"] == "0.19.0"
    assert qc["kv_cache_scheme"] == KV_SCHEME[name]
    # vLLM's compressed-tensors (0.17 next to vLLM 0.32) parses what 0.19 wrote.
    args = QuantizationArgs.model_validate(qc["kv_cache_scheme"])
    assert (args.num_bits, args.type, args.strategy) == (8, "float", KV_SCHEME[name]["strategy"])
    assert (args.dynamic, args.symmetric) == (False, True)
    QuantizationConfig.model_validate(qc)


@pytest.mark.parametrize("name", NAMES)
def test_scale_tensors_as_written(checkpoints, name):
    tensors = attention_tensors(checkpoints[name])
    kinds = ("k_scale", "v_scale")
    if name == ATTENTION:
        kinds += ("q_scale", "q_zero_point", "k_zero_point", "v_zero_point")
    assert set(tensors) == {
        f"model.layers.{i}.self_attn.{kind}" for i in range(NUM_LAYERS) for kind in kinds
    }
    for tensor_name, t in tensors.items():
        if tensor_name.endswith(("k_scale", "v_scale")):
            assert (t.dtype, tuple(t.shape)) == (torch.bfloat16, kv_shape(name)), tensor_name
            assert not any(implausible(float(x)) for x in t.flatten()), (tensor_name, t)
        elif tensor_name.endswith("q_scale"):  # never calibrated on CPU: any bf16 value
            assert (t.dtype, tuple(t.shape)) == (torch.bfloat16, (1,)), tensor_name
        else:  # *_zero_point: FP8, all zero (symmetric)
            assert (t.dtype, tuple(t.shape)) == (torch.float8_e4m3fn, (1,)), tensor_name
            assert float(t.float().abs().max()) == 0.0, tensor_name
    # The model doubles K/V in layer 1 and triples them in KV head 1: calibration saw it.
    stored = written_kv(checkpoints[name])
    assert max(stored[1][0]) > 1.5 * max(stored[0][0]), stored
    if per_head(name):
        for i, (k, v) in stored.items():
            assert 1.5 < k[1] / k[0] < 6.0 and 1.5 < v[1] / v[0] < 6.0, (i, k, v)
    # Quantized weights as the preset says.
    from safetensors import safe_open

    with safe_open(str(checkpoints[name] / "model.safetensors"), "pt") as f:
        weight = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
    assert weight.dtype == WEIGHT_DTYPE[name]


@pytest.mark.parametrize(
    ("tensor_wise", "head_wise"),
    [("kv-tensor", "kv-head"), ("fp8-dynamic-kv-tensor", "fp8-dynamic-kv-head")],
)
def test_per_tensor_scale_is_the_max_of_the_per_head_scales(checkpoints, tensor_wise, head_wise):
    # Two calibration runs over the same samples: equal here; up to ~3% apart on SmolLM2
    # (bf16 rounding of the observers' running values).
    tensor = written_kv(checkpoints[tensor_wise])
    heads = written_kv(checkpoints[head_wise])
    for i in range(NUM_LAYERS):
        for one, per_head_values in zip(tensor[i], heads[i], strict=True):
            assert one[0] == pytest.approx(max(per_head_values), rel=0.03), i


# -- kvscale inspect -----------------------------------------------------------------------


#: What ``kvscale inspect --json`` says today, per checkpoint: exit status, the stock and
#: kvscale start-up outcomes, the weights verdict, the problem codes. Where the engine
#: tests below measure otherwise, the comment says so.
INSPECT = {
    "kv-tensor": (0, "starts", "starts", "none", []),
    "kv-head": (0, "starts", "starts", "none", []),
    "fp8-dynamic-kv-tensor": (0, "unverified", "unverified", "not_checked", []),
    STATIC_FP8: (1, "fails", "fails", "unsupported", ["unsupported_weight_scheme"]),
    "fp8-dynamic-kv-head": (0, "unverified", "unverified", "not_checked", []),
    "w8a8-int8-kv-tensor": (0, "unverified", "unverified", "not_checked", []),
    # The never-calibrated q_scale is reported (corrupt_value: exit 1), and on vLLM's CPU
    # build, whose attention never reads a q scale, kvscale's KV-cache verdict is "starts"
    # (one warning), as the engines do (test_bf16_cache, test_fp8_cache).
    ATTENTION: (1, "unverified", "unverified", "not_checked", ["corrupt_value"]),
}


@pytest.mark.parametrize("name", NAMES)
def test_inspect_verdict(checkpoints, capsys, name):
    ckpt = checkpoints[name]
    status = run_inspect(str(ckpt), as_json=True)
    data = json.loads(capsys.readouterr().out)
    assert data["exit_status"] == status
    assert data["scheme"]["supported"] is True
    assert data["scheme"]["per_head"] is per_head(name)
    assert data["scheme"]["kv_cache_scheme"] == KV_SCHEME[name]
    exit_status, stock, kvscale, weights, codes = INSPECT[name]
    bad = bad_q_scales(ckpt)
    if name == ATTENTION and not bad:  # the uninitialised q_scale happened to look plausible
        exit_status, kvscale, codes = 0, "unverified", []
    assert (status, data["stock"]["outcome"], data["kvscale"]["outcome"]) == (
        exit_status,
        stock,
        kvscale,
    )
    assert data["weights"]["outcome"] == weights
    assert [p["code"] for p in data["problems"]] == codes
    assert all(p["severity"] == "error" for p in data["problems"])
    stored = written_kv(ckpt)
    if name == ATTENTION and bad:
        corrupt = next(p for p in data["problems"] if p["code"] == "corrupt_value")
        assert sorted(corrupt["tensors"]) == bad  # the q_scale tensors only, never k/v
        assert data["kvscale"]["kv_cache_outcome"] == "starts"
        assert f"{len(bad)} corrupt q_scale tensor(s) ignored" in data["kvscale"]["summary"]
        # Where attention may read q scales (a release named without its platform:
        # possibly a GPU build), kvscale refuses them, as its loader does there.
        assert run_inspect(str(ckpt), as_json=True, host="vllm==0.32.0") == 1
        named = json.loads(capsys.readouterr().out)
        assert named["kvscale"]["kv_cache_outcome"] == "refuses"
        return
    # The KV cache itself: every layer serves the checkpoint's scales, stock and kvscale.
    assert data["stock"]["kv_cache_outcome"] == data["kvscale"]["kv_cache_outcome"] == "starts"
    for row in data["layers"]:
        k, v = stored[row["index"]]
        assert row["kvscale"]["source"] == "checkpoint"
        if per_head(name):
            assert (row["kvscale"]["k_heads"], row["kvscale"]["v_heads"]) == (list(k), list(v))
        assert (row["kvscale"]["k"], row["kvscale"]["v"]) == (max(k), max(v))
        assert (row["stock"]["k"], row["stock"]["v"]) == (max(k), max(v))


# -- engines -------------------------------------------------------------------------------

_references: dict[str, tuple[list[int], list[float], dict[str, LayerScales]]] = {}


def bf16_reference(ckpt: Path) -> tuple[list[int], list[float], dict[str, LayerScales]]:
    """Stock vLLM with a bf16 cache (one engine per checkpoint and session): the
    reference text's token ids, their teacher-forced logprobs, the layers' scales."""
    if ckpt.name not in _references:
        ids = list(reference_token_ids(ckpt))
        with vllm_engine(ckpt, kv_cache_dtype="bfloat16") as llm:
            _references[ckpt.name] = (ids, teacher_forced_logprobs(llm, ids), layer_scales(llm))
    return _references[ckpt.name]


def assert_holds(scales: dict[str, LayerScales], stored: dict, *, fp8: bool, kvscale: bool):
    assert len(scales) == NUM_LAYERS
    for layer, s in scales.items():
        k, v = stored[layer_index(layer)]
        assert (s.k_heads, s.v_heads) == (k, v), layer
        assert (s.k_float, s.v_float, s.k_cpu, s.v_cpu) == (max(k), max(v), max(k), max(v))
        assert s.kv_cache_dtype == ("fp8" if fp8 else "bfloat16"), layer
        assert s.source == ("checkpoint" if kvscale else None), layer


@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("quantization", [None, "kvscale"], ids=["stock", "kvscale"])
def test_bf16_cache(checkpoints, name, quantization):
    ckpt = checkpoints[name]
    ids, reference, scales = bf16_reference(ckpt)
    logprobs = reference
    if quantization is not None:  # stock's run is the reference itself
        with vllm_engine(ckpt, quantization=quantization, kv_cache_dtype="bfloat16") as llm:
            scales = layer_scales(llm)
            logprobs = teacher_forced_logprobs(llm, ids)
    assert all(s.pool_dtype == torch.bfloat16 for s in scales.values())
    assert all(s.kv_cache_dtype == "bfloat16" for s in scales.values())
    if quantization is None:
        # Stock loads the checkpoint's scales into the layers; a bf16 cache never reads them.
        stored = written_kv(ckpt)
        for layer, s in scales.items():
            assert (s.k_heads, s.v_heads) == stored[layer_index(layer)], layer
    else:
        # kvscale with an explicit bf16 cache leaves the layers unscaled (1.0).
        assert all(s.source == "unscaled" for s in scales.values())
        assert all(set(s.k_heads + s.v_heads) == {1.0} for s in scales.values())
    # Either way, bit for bit what stock serves with a bf16 cache.
    assert logprobs == reference


@needs_fp8_cpu_cache
@pytest.mark.parametrize("name", SERVED)
@pytest.mark.parametrize("quantization", [None, "kvscale"], ids=["stock", "kvscale"])
def test_fp8_cache(checkpoints, kvscale_warnings, name, quantization):
    """``kv_cache_dtype="auto"``: the scheme selects an FP8 cache, served with exactly the
    scales llm-compressor wrote, close to the bf16 cache."""
    ckpt = checkpoints[name]
    stored = written_kv(ckpt)
    kvscale = quantization == "kvscale"
    ids, reference, _ = bf16_reference(ckpt)
    try:
        with vllm_engine(ckpt, quantization=quantization) as llm:
            scales = layer_scales(llm)
            logprobs = teacher_forced_logprobs(llm, ids)
    except Exception as exc:
        if FP8_CPU_REFUSAL in str(exc):  # no AVX-512 / AMX: check what loaded, then skip
            loaded = getattr(exc, "kvscale_loaded_scales", None)
            assert loaded, f"vLLM refused the FP8 cache before the model loaded: {exc}"
            assert_holds(loaded, stored, fp8=True, kvscale=kvscale)
        raise
    assert all(s.pool_is_fp8 for s in scales.values())
    assert_holds(scales, stored, fp8=True, kvscale=kvscale)
    mean, worst = logprob_error(reference, logprobs)
    print(f"{name} {quantization or 'stock'}: mean |dlogprob| vs bf16 {mean:.5f} (max {worst:.4f})")
    assert mean < FP8_MEAN_ERROR_MAX, (name, quantization, mean, worst)
    if name == ATTENTION and kvscale:
        # The never-calibrated q_scale no backend here reads: one warning naming each
        # unusable tensor, and the engine serves.
        bad = bad_q_scales(ckpt)
        warnings = kvscale_warnings("q_scale")
        assert len(warnings) == (1 if bad else 0), warnings
        for tensor in bad:
            assert tensor in warnings[0], (tensor, warnings)


@pytest.mark.parametrize(
    ("quantization", "kv_cache_dtype"),
    [(None, "bfloat16"), ("kvscale", "auto")],
    ids=["stock", "kvscale"],
)
def test_static_fp8_w8a8_does_not_start_on_vllm_cpu(checkpoints, quantization, kv_cache_dtype):
    """vLLM 0.32's CPU build cannot run static FP8 activation quantization (its CPU op
    takes no arguments): the start fails in the weights, stock and kvscale alike. When this
    fails, vLLM fixed it: serve this checkpoint in test_bf16_cache / test_fp8_cache."""
    with pytest.raises(RuntimeError, match=re.escape(STATIC_FP8_CPU_FAILURE)):
        with vllm_engine(
            checkpoints[STATIC_FP8], quantization=quantization, kv_cache_dtype=kv_cache_dtype
        ):
            pass
