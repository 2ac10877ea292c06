"""`kvscale calibrate` output served by real vLLM CPU engines (boosted tiny model).

The boosted tiny model's K/V reach ~1,000-1,500, beyond FP8's 448: an FP8 cache stays
close to the bf16 reference only with good scales. Calibrated on the built-in corpus,
scored on its held-out split (the tiny model's own hand-picked scales are the bar).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvscale_testing.engines import attention_layers
from kvscale_testing.probe import layer_index, layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin import calibration as cal
from kvscale_plugin.demo.quality import compare, heldout_token_ids, teacher_forced

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def models(tiny, tmp_path_factory) -> dict[str, Path]:
    # Same seed, same weights: only the scale tensors differ.
    plain = tiny("cal-e2e-plain", num_layers=3, write_scales=False)
    hand = tiny("cal-e2e-hand", num_layers=3)
    work = tmp_path_factory.mktemp("cal-e2e")
    tensor = cal.calibrate(
        plain, work / "tensor", num_samples=8, max_len=128, progress=False
    ).out_dir
    head = cal.calibrate(
        plain, work / "head", scheme="attn_head", num_samples=8, max_len=128, progress=False
    ).out_dir
    return {"plain": plain, "hand": hand, "tensor": tensor, "head": head}


@pytest.fixture(scope="module")
def prompts(models) -> list[list[int]]:
    return heldout_token_ids(models["plain"], max_tokens=600, max_len=150)


@pytest.fixture(scope="module")
def reference(models, prompts):
    with vllm_engine(models["hand"], kv_cache_dtype="bfloat16") as llm:
        return teacher_forced(llm, prompts)


@needs_fp8_cpu_cache
def test_calibrated_scales_serve_close_to_hand_picked_and_far_below_scale_one(
    models, prompts, reference
):
    written = cal.read_scales(models["tensor"])
    runs = {}
    for name in ("tensor", "hand", "plain"):  # plain: scheme declared, no scales -> 1.0
        with vllm_engine(models[name], quantization="kvscale") as llm:
            held = layer_scales(llm)
            runs[name] = compare(teacher_forced(llm, prompts), reference)
        if name == "tensor":
            assert all(s.pool_is_fp8 and s.source == "checkpoint" for s in held.values())
            for s in held.values():
                k, v = written[f"model.layers.{layer_index(s.name)}.self_attn"]
                assert (s.k, s.v) == pytest.approx((float(k), float(v)), rel=1e-6)
                assert s.k > 2.5  # amax ~1,400 / 448
    ours, hand, unit = runs["tensor"], runs["hand"], runs["plain"]
    print(
        f"mean |dlogprob| over {ours.tokens} tokens: calibrated {ours.mean_abs_dlogprob:.4f}, "
        f"hand-picked {hand.mean_abs_dlogprob:.4f}, scale 1.0 {unit.mean_abs_dlogprob:.4f}"
    )
    assert ours.mean_abs_dlogprob <= 1.5 * hand.mean_abs_dlogprob + 0.005
    assert ours.mean_abs_dlogprob * 3 < unit.mean_abs_dlogprob
    assert ours.top1_agreement >= unit.top1_agreement


@needs_fp8_cpu_cache
@pytest.mark.parametrize("quantization", [None, "kvscale"], ids=["stock", "kvscale"])
def test_attn_head_output_loads_per_head(models, prompts, reference, quantization):
    # Stock vLLM 0.32 and kvscale serve strategy attn_head: the written
    # [num_kv_heads, 1, 1] tensors must land per head in every layer.
    written = cal.read_scales(models["head"])
    assert all(k.shape == (2, 1, 1) for k, _ in written.values())
    with vllm_engine(models["head"], quantization=quantization) as llm:
        layers = attention_layers(llm)
        quality = compare(teacher_forced(llm, prompts), reference)
        held = {
            n: (
                m._k_scale.detach().float().cpu().reshape(-1),
                m._v_scale.detach().float().cpu().reshape(-1),
            )
            for n, m in layers.items()
        }
    assert len(held) == 3
    for name, (k, v) in held.items():
        wk, wv = written[f"model.layers.{layer_index(name)}.self_attn"]
        assert torch.allclose(k, wk.reshape(-1), rtol=1e-6)
        assert torch.allclose(v, wv.reshape(-1), rtol=1e-6)
    assert quality.mean_abs_dlogprob < 0.05
