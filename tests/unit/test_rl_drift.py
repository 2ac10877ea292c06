"""The drift monitor of ``record_kv_scales(model, in_force=...)`` and the simulated FP8
cache of ``benchmarks/rl_drift.py`` (issue #54).

The monitor is held against hand-built keys/values whose clipped counts are known, and
against a real tiny transformers model whose scales are shrunk or whose padding is loud;
the simulation against the project's reference cache write.
"""

from __future__ import annotations

import pytest
import torch
from kvscale_testing.trainer_forward import (
    load_trainer_model,
    loud_pad,
    pad_id_for,
    padded_batch,
)

from kvscale_plugin import calibration as cal
from kvscale_plugin.calibration.drift import DriftThresholds, KindDrift, LayerDrift, verdict_of
from kvscale_plugin.kernels.reference import quantize_e4m3_reference

MAX_LEN = 64
TEXTS = [
    text[:chars].strip()
    for text, chars in zip(cal.builtin_corpus("calibration"), (400, 90, 250, 30), strict=False)
]
LAYERS = [f"model.layers.{i}.self_attn" for i in range(3)]


@pytest.fixture(scope="module")
def trainer(tiny):
    """The trainer's model (float32, loud pad token), tokenizer and pad id."""
    model, tok = load_trainer_model(tiny("trainer-scales", num_layers=3, write_scales=False))
    model.float()
    pad_id = pad_id_for(tok, TEXTS, MAX_LEN)
    loud_pad(model, pad_id)
    return model, tok, pad_id


def _fresh(model, batch, scheme="tensor") -> dict[str, torch.Tensor]:
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    return rec.scales(scheme)


def test_known_clipped_fraction_on_hand_built_keys_and_values(trainer):
    model, _, _ = trainer
    attn = model.model.layers[1].self_attn
    heads, dim = 2, 8
    # scale in force 0.5 per tensor for K (clips above 224), per head (1, 2) for V.
    in_force = {
        "model.layers.1.self_attn.k_scale": torch.tensor([0.5]),
        "model.layers.1.self_attn.v_scale": torch.tensor([1.0, 2.0]).reshape(2, 1, 1),
    }
    key = torch.zeros(1, heads, 5, dim)
    value = torch.zeros(1, heads, 5, dim)
    key[0, 0, 1, :3] = 230.0  # 3 elements over 224 (head 0)
    key[0, 1, 2, 0] = -300.0  # 1 over (head 1), negative
    key[0, 1, 3, 0] = 224.0  # at the limit: not over
    key[0, 0, 4, :] = 1e4  # at a padding position: never counted
    value[0, 1, 0, :2] = 500.0  # under head 1's 896
    value[0, 0, 0, :2] = 500.0  # over head 0's 448: 2 elements
    valid = torch.tensor([[True, True, True, True, False]])
    rec = cal.record_kv_scales(model, in_force=in_force)
    rec.record(attn, key, value, valid)
    report = rec.drift()
    (layer,) = report.layers
    assert layer.name == "model.layers.1.self_attn"
    assert layer.k.clipped_counts == [3, 1] and layer.k.elements_per_head == 4 * dim
    assert layer.k.clipped == pytest.approx(4 / (2 * 4 * dim))
    assert layer.k.ratios == pytest.approx([230 / 224, 300 / 224])  # padding's 1e4 left out
    assert layer.v.clipped_counts == [2, 0]
    assert layer.v.ratios == pytest.approx([500 / 448, 500 / 896])
    assert report.refresh and report.verdict.startswith("refresh: layer 1 k clips 6.25%")
    # Above the threshold only when the threshold is below the fraction.
    # A layer whose V is all zeros stores nothing: no "scale too large" for it.
    dead = KindDrift([0.0, 0.0], [0, 0], 8)
    assert verdict_of(
        [LayerDrift("model.layers.2.self_attn", layer.k, dead)], DriftThresholds(1.0)
    )[1].startswith("keep: max amax ratio 1.34, at most 6.25% clips")
    lenient = DriftThresholds(max_clipped=0.1)
    assert verdict_of(report.layers, lenient)[0] is False
    assert "at most 6.25% clips" in verdict_of(report.layers, lenient)[1]


def test_verdict_flips_when_the_scales_in_force_shrink(trainer):
    model, tok, pad_id = trainer
    batch = padded_batch(tok, TEXTS, "left", pad_id, MAX_LEN)
    for scheme in cal.SCHEMES:
        fresh = _fresh(model, batch, scheme)
        roomy = {n: t * 2 for n, t in fresh.items()}
        with cal.record_kv_scales(model, in_force=roomy) as rec, torch.no_grad():
            model(**batch, use_cache=False)
        keep = rec.drift()
        assert not keep.refresh, keep.verdict
        assert keep.verdict.startswith("keep: max amax ratio 0.50, nothing clips")
        assert keep.clipped == 0 and keep.max_ratio == pytest.approx(0.5, rel=1e-5)
        assert [layer.name for layer in keep.layers] == LAYERS
        # The same forward against scales shrunk to 40%: clips, refresh.
        tight = {n: t * 0.4 for n, t in fresh.items()}
        with cal.record_kv_scales(model, in_force=tight) as rec, torch.no_grad():
            model(**batch, use_cache=False)
        refresh = rec.drift()
        assert refresh.refresh and refresh.verdict.startswith("refresh: layer "), refresh.verdict
        assert refresh.max_ratio == pytest.approx(2.5, rel=1e-5)
        assert refresh.max_clipped > 1e-4
        # ... and the recording itself is unchanged by the monitor.
        assert all(torch.equal(rec.scales(scheme)[n], t) for n, t in fresh.items())
    # A scale far too large for what the layer stores: refresh too (min_ratio).
    huge = {n: t * 100 for n, t in _fresh(model, batch).items()}
    with cal.record_kv_scales(model, in_force=huge) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    assert rec.drift().refresh and "scale too large" in rec.drift().verdict


def test_padding_is_not_counted(trainer):
    """The pad token is loud (layer 0's keys there far above the real tokens'): against
    the scales of the real tokens, the padded batch clips nothing; the same batch with the
    padding taken as real tokens clips."""
    model, tok, pad_id = trainer
    batch = padded_batch(tok, TEXTS, "right", pad_id, MAX_LEN)
    assert (batch["attention_mask"] == 0).any()
    single: dict[str, torch.Tensor] = {}
    for text in TEXTS:  # the real tokens alone, one text at a time (no padding)
        for n, t in _fresh(model, padded_batch(tok, [text], "left", pad_id, MAX_LEN)).items():
            single[n] = torch.maximum(single.get(n, t), t)
    in_force = {n: t * 1.001 for n, t in single.items()}
    with cal.record_kv_scales(model, in_force=in_force) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    padded = rec.drift()
    assert padded.clipped == 0 and not padded.refresh, padded.verdict
    real = int(batch["attention_mask"].sum())
    assert padded.layers[0].k.elements_per_head == real * model.config.head_dim
    with cal.record_kv_scales(model, in_force=in_force) as rec, torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    counted = rec.drift()
    assert counted.layers[0].k.clipped > 0 and counted.refresh, counted.verdict


def test_drift_needs_scales_in_force_that_name_the_model(trainer):
    model, tok, pad_id = trainer
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        model(**padded_batch(tok, TEXTS[:2], "left", pad_id, MAX_LEN), use_cache=False)
    with pytest.raises(cal.CalibrationError, match="needs the scales in force"):
        rec.drift()
    with pytest.raises(cal.CalibrationError, match="names no attention module"):
        cal.record_kv_scales(model, in_force={"model.layers.9.self_attn.k_scale": 1.0})
    with pytest.raises(cal.CalibrationError, match="but not .v_scale"):
        cal.record_kv_scales(model, in_force={f"{LAYERS[0]}.k_scale": 1.0})
    rec = cal.record_kv_scales(
        model, in_force={f"{LAYERS[0]}.k_scale": torch.ones(5), f"{LAYERS[0]}.v_scale": 1.0}
    )
    with pytest.raises(cal.CalibrationError, match="5 values, the layer 2 KV heads"), rec:
        with torch.no_grad():
            model(**padded_batch(tok, TEXTS[:2], "left", pad_id, MAX_LEN), use_cache=False)


def test_drift_counts_sum_over_the_group(trainer):
    """With ``group`` the counts go through a SUM all-reduce (a one-rank gloo group here:
    the reduction runs, the counts stay; two calls reduce once)."""
    import torch.distributed as dist

    model, tok, pad_id = trainer
    batch = padded_batch(tok, TEXTS, "left", pad_id, MAX_LEN)
    tight = {n: t * 0.4 for n, t in _fresh(model, batch).items()}
    with cal.record_kv_scales(model, in_force=tight) as alone, torch.no_grad():
        model(**batch, use_cache=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        with cal.record_kv_scales(model, in_force=tight, group=group) as rec, torch.no_grad():
            model(**batch, use_cache=False)
        first, again = rec.drift(), rec.drift()
    finally:
        dist.destroy_process_group()
    want = alone.drift()
    for got in (first, again):
        assert got.verdict == want.verdict
        assert [(x.k.clipped_counts, x.v.clipped_counts) for x in got.layers] == [
            (x.k.clipped_counts, x.v.clipped_counts) for x in want.layers
        ]
        assert [x.k.elements_per_head for x in got.layers] == [
            x.k.elements_per_head for x in want.layers
        ]


@pytest.mark.parametrize("per_head", [False, True])
def test_simulated_cache_matches_the_reference_write(per_head):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 17, 16, generator=g) * 40  # [batch, kv_heads, seq, head_dim]
    x[0, 1, 2, 3] = 1e5  # clamps
    x[1, 2, 0, :4] = torch.tensor([1e-9, -1e-9, 0.0, -0.0])  # subnormal / zero
    scale = torch.tensor([0.05, 0.2, 0.5, 1.0]) if per_head else torch.tensor([0.1])
    got = cal.fp8_roundtrip(x, scale)
    tokens = x.permute(0, 2, 1, 3).reshape(-1, 4, 16)  # the cache write's [tokens, heads, dim]
    want = quantize_e4m3_reference(tokens, scale).float() * scale.reshape(1, -1, 1)
    want = want.reshape(3, 17, 4, 16).permute(0, 2, 1, 3)
    assert torch.equal(got, want)
    assert got.abs().max() <= 448 * scale.max() and not torch.equal(got, x)
    assert cal.fp8_roundtrip(x.bfloat16(), scale).dtype == torch.bfloat16


def test_simulated_cache_runs_in_the_models_attention(trainer):
    from transformers.modeling_utils import AttentionInterface

    model, tok, pad_id = trainer
    batch = padded_batch(tok, TEXTS[:3], "left", pad_id, MAX_LEN)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        plain = model(**batch, use_cache=False).logits
        fresh = _fresh(model, batch)
        with cal.simulate_fp8_cache(model, fresh):
            fp8 = model(**batch, use_cache=False).logits
        with cal.simulate_fp8_cache(model, {n: t * 1e-3 for n, t in fresh.items()}):
            clipped = model(**batch, use_cache=False).logits
        after = model(**batch, use_cache=False).logits
    assert AttentionInterface.get_interface.__module__.startswith("transformers")
    assert torch.equal(after, plain)
    small = (fp8 - plain)[real].abs().max()
    large = (clipped - plain)[real].abs().max()
    assert 0 < small < large, (small, large)
