"""Per-head KV scales (``kv_cache_scheme.strategy: attn_head``) on SGLang's own modules.

SGLang 0.5.23 has one k/v scale per attention layer (``BaseKVCacheMethod`` makes a scalar
``k_scale`` and refuses anything else; cache writes and backends take one number), and its
compressed-tensors config ignores ``attn_head``. kvscale validates every head, keeps this
rank's heads, and serves each layer in FP8 with the max over its heads.
"""

from __future__ import annotations

import math
import re

import pytest

# "sglang.srt", not "sglang": this test folder itself is named sglang (see conftest).
import torch  # noqa: E402
from sglang_helpers import (  # noqa: E402
    NUM_KV_HEADS,
    PER_HEAD,
    PER_HEAD_B,
    PER_HEAD_C,
    build_model,
    layer_index,
    layer_scales,
    per_head_checkpoint,
    per_head_tensor,
    per_head_tensors,
    reload,
    resolve_kv_cache_dtype,
    update_weights_from_disk,
)

from kvscale_plugin.scales import CorruptScaleError  # noqa: E402

pytestmark = pytest.mark.usefixtures("sglang_runtime")

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
ATTN = "model.layers.{i}.self_attn.attn"
#: How errors name a layer's scale tensors: as the checkpoint writes them.
ON_DISK = "model.layers.{i}.self_attn"


def assert_per_head(scales, expected, factor: float = 1.0, source: str = "checkpoint") -> None:
    """Each layer: this rank's heads recorded exactly; the served tensor and float (what
    SGLang's cache writes and backends read) are the max over the heads."""
    assert sorted(layer_index(n) for n in scales) == sorted(expected), scales
    for name, s in scales.items():
        k_heads, v_heads = (tuple(x * factor for x in h) for h in expected[layer_index(name)])
        assert (s.k_heads, s.v_heads) == (k_heads, v_heads), (name, s)
        assert (s.k, s.k_float) == (max(k_heads), max(k_heads)), (name, s)
        assert (s.v, s.v_float) == (max(v_heads), max(v_heads)), (name, s)
        assert (s.method, s.source) == ("KVScaleKVCacheMethod", source), (name, s)


@pytest.mark.parametrize("family", FAMILIES)
def test_per_head_scales_served_as_per_layer_max(tiny, family, kvscale_warnings):
    ckpt = per_head_checkpoint(tiny, f"sgl-ph-{family}", family=family, q_scales=True)
    model, _ = build_model(ckpt)
    scales = layer_scales(model)
    assert_per_head(scales, PER_HEAD)
    # The max really differs per layer and comes from different heads, so a head or
    # layer mix-up cannot pass.
    assert [s.k for s in scales.values()] == [3.25, 4.75]
    assert [s.v for s in scales.values()] == [2.5, 5.25]
    # Served tensors stay one scalar per layer, the shape SGLang's backends take.
    for layer in model.modules():
        if hasattr(layer, "kvscale_k_heads"):
            assert layer.k_scale.shape == layer.v_scale.shape == torch.Size([])
            assert layer.k_scale.dtype == torch.float32
    assert resolve_kv_cache_dtype(model, "auto") == ("fp8_e4m3", torch.float8_e4m3fn)
    said = kvscale_warnings("per-head KV scales")
    assert len(said) == 1, said
    assert "max of its heads" in said[0] and "no head clips" in said[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_sglang_ignores_attn_head_checkpoint(tiny, family):
    # Stock SGLang 0.5.23 (compressed-tensors auto-detected): CompressedTensorsKVCacheMethod
    # only accepts strategy "tensor", so the scheme is ignored (one warning): no KV method,
    # the scale tensors are skipped by the loader, and auto picks a bf16 pool -- half the
    # KV capacity of the FP8 cache the checkpoint was calibrated for.
    ckpt = per_head_checkpoint(tiny, f"sgl-ph-{family}", family=family, q_scales=True)
    model, model_config = build_model(ckpt, quantization=None)
    assert model_config.quantization == "compressed-tensors"
    scales = layer_scales(model)
    assert len(scales) == len(PER_HEAD)
    assert all(s.method is None and s.k is None and s.k_float is None for s in scales.values())
    assert resolve_kv_cache_dtype(model, "auto") == (None, torch.bfloat16)
    # An explicit FP8 cache gets no scales at all (the backends then use 1.0).
    assert resolve_kv_cache_dtype(model, "fp8_e4m3")[1] == torch.float8_e4m3fn


def test_one_dimensional_per_head_layout(tiny):
    ckpt = per_head_checkpoint(tiny, "sgl-ph-1d", family="qwen3", shape=(NUM_KV_HEADS,))
    model, _ = build_model(ckpt)
    assert_per_head(layer_scales(model), PER_HEAD)


def test_corrupt_per_head_element_fails_naming_layer_and_head(tiny):
    bad = {
        0: ((3.25, 1.5), (0.0, 2.5)),
        1: ((0.625, math.nan), (5.25, -2.0)),
        2: ((math.inf, 1.0), (1.0, 1.0)),
    }
    ckpt = per_head_checkpoint(tiny, "sgl-ph-corrupt", family="qwen3", scales=bad)
    with pytest.raises(CorruptScaleError) as err:
        build_model(ckpt)
    text = str(err.value)
    for key, why in [
        (f"{ON_DISK.format(i=0)}.v_scale[head 0]", "0 (a zero scale"),
        (f"{ON_DISK.format(i=1)}.k_scale[head 1]", "NaN"),
        (f"{ON_DISK.format(i=1)}.v_scale[head 1]", "-2.0 (negative)"),
        (f"{ON_DISK.format(i=2)}.k_scale[head 0]", "inf (infinite)"),
    ]:
        assert f"  - {key}: {why}" in text, text
    assert text.count("  - ") == 4, text  # the good heads are not reported
    assert "4 KV-cache scale value(s)" in text


@pytest.mark.parametrize(
    ("shape", "values"),
    [((3, 1, 1), (1.0, 2.0, 3.0)), ((1,), (2.0,)), ((1, 2, 1), (1.0, 2.0))],
    ids=["three-heads", "per-tensor-scalar", "not-per-head"],
)
def test_wrong_per_head_shape_fails_naming_expected_shape(tiny, shape, values):
    k_name = "model.layers.1.self_attn.k_scale"
    ckpt = per_head_checkpoint(
        tiny,
        f"sgl-ph-shape-{'x'.join(map(str, shape))}",
        family="llama",
        extra_tensors={k_name: per_head_tensor(values, shape)},
    )
    with pytest.raises(CorruptScaleError) as err:
        build_model(ckpt)
    text = str(err.value)
    expected = f"{ON_DISK.format(i=1)}.k_scale: shape {shape} does not match the model's 2 KV heads"
    assert expected in text, text
    assert "expects [2, 1, 1] or [2]" in text
    assert text.count("  - ") == 1, text


@pytest.mark.parametrize("naming", ["kv_scale", "k_only", "v_only"])
def test_single_per_head_scale_is_used_for_k_and_v(tiny, naming):
    ckpt = per_head_checkpoint(tiny, f"sgl-ph-{naming}", family="qwen2", naming=naming)
    model, _ = build_model(ckpt)
    which = 1 if naming == "v_only" else 0
    expected = {i: (heads[which], heads[which]) for i, heads in PER_HEAD.items()}
    assert_per_head(layer_scales(model), expected, source="duplicated")


@pytest.mark.parametrize("fnuz", [False, True], ids=["fp8", "fp8-fnuz"])
def test_reload_per_head_new_values_same_tensors(tiny, monkeypatch, fnuz):
    from kvscale_plugin.hosts.sglang import method

    monkeypatch.setattr(method, "is_fp8_fnuz", lambda: fnuz)
    factor = 2.0 if fnuz else 1.0  # FP8-fnuz: every head doubled, once
    a = per_head_checkpoint(tiny, "sgl-ph-reload-a", family="qwen3", scales=PER_HEAD)
    b = per_head_checkpoint(tiny, "sgl-ph-reload-b", family="qwen3", scales=PER_HEAD_B)
    c = per_head_checkpoint(tiny, "sgl-ph-reload-c", family="qwen3", scales=PER_HEAD_C)

    model, model_config = build_model(a)
    first = layer_scales(model)
    assert_per_head(first, PER_HEAD, factor)
    for path, scales in ((b, PER_HEAD_B), (c, PER_HEAD_C), (b, PER_HEAD_B)):
        reload(model, model_config, path)
        now = layer_scales(model)
        assert_per_head(now, scales, factor)
        assert {n: s.k_ptr for n, s in now.items()} == {n: s.k_ptr for n, s in first.items()}
    # A reload that carries no scales keeps the latest ones, without compounding.
    for _ in range(2):
        reload(model, model_config, c, name_filter=lambda n: not n.endswith("_scale"))
        assert_per_head(layer_scales(model), PER_HEAD_B, factor)


def test_reload_after_corrupt_per_head_load_forgets_old_problems(tiny):
    good = per_head_checkpoint(tiny, "sgl-ph-good", family="llama")
    bad = per_head_checkpoint(
        tiny,
        "sgl-ph-one-bad",
        family="llama",
        extra_tensors={"model.layers.0.self_attn.v_scale": per_head_tensor((1.0, math.nan))},
    )
    model, model_config = build_model(good)
    # Refused naming the head; every layer keeps its scales (loadcycle.decide).
    ok, message = update_weights_from_disk(model, model_config, bad)
    assert not ok and re.search(r"self_attn\.v_scale\[head 1\]: NaN", message), message
    assert_per_head(layer_scales(model), PER_HEAD)
    reload(model, model_config, good)
    assert_per_head(layer_scales(model), PER_HEAD)


def test_explicit_bf16_cache_wins_over_per_head_scheme(tiny):
    from sglang.srt.runtime_context import get_model

    ckpt = per_head_checkpoint(tiny, "sgl-ph-llama-bf16", family="llama")
    with get_model().override(kv_cache_dtype="bf16"):
        model, _ = build_model(ckpt)
    scales = layer_scales(model)
    assert all(
        s.k == s.v == s.k_float == 1.0 and s.source == "unscaled" for s in scales.values()
    ), scales
    assert resolve_kv_cache_dtype(model, "bf16")[1] == torch.bfloat16


# --- which heads a TP rank holds ---------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "size", "expected"),
    [
        (2, 1, [(0, 1)]),
        (2, 2, [(0,), (1,)]),  # partitioned
        (8, 4, [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (1, 2, [(0,), (0,)]),  # replicated
        (2, 4, [(0,), (0,), (1,), (1,)]),  # each head on tp_size // total consecutive ranks
        (2, 8, [(0,), (0,), (0,), (0,), (1,), (1,), (1,), (1,)]),
    ],
)
def test_rank_kv_heads_partitions_or_replicates(total, size, expected):
    from kvscale_plugin.scales import rank_kv_heads

    assert [rank_kv_heads(total, rank, size) for rank in range(size)] == expected


def test_place_kv_heads_uses_the_layout_that_matches_the_layer():
    from kvscale_plugin.heads import HeadLayout

    place_kv_heads = HeadLayout.place

    # Attention TP (DP attention: rank 1 of 2) vs full TP (rank 3 of 4), 4 KV heads: a layer
    # with 2 heads per rank was split over the attention TP group, one with 1 over full TP.
    layouts = [(1, 2), (3, 4)]
    assert place_kv_heads(4, 2, layouts).heads == (2, 3)
    assert place_kv_heads(4, 1, layouts).heads == (3,)
    missing = place_kv_heads(4, 3, layouts)
    assert missing.heads is None
    assert "cannot place 4 per-head scales onto this layer's 3 KV head(s)" in str(missing.problem)


def _one_head_per_rank(monkeypatch, layouts: list[tuple[int, int]]) -> None:
    """A rank of the ``layouts`` (attention TP first, then TP) whose layers hold one KV
    head each -- simulated on this single-process group."""
    from kvscale_plugin.hosts.sglang import live, method

    monkeypatch.setattr(live, "tp_layouts", lambda: layouts)
    original = method._head_placement

    def one_head(cfg, layer):
        monkeypatch.setattr(layer, "tp_k_head_num", 1)
        return original(cfg, layer)

    monkeypatch.setattr(method, "_head_placement", one_head)


def test_rank_heads_are_taken_from_the_full_tensor(tiny, monkeypatch):
    # A rank that holds head 1 only (rank 1 of 2, 2 KV heads) -- simulated by giving the
    # layer one KV head on this single-process group: the full tensor is validated, the
    # rank keeps head 1, and serves it exactly (no max over heads it does not hold).
    _one_head_per_rank(monkeypatch, [(1, 2)])
    ckpt = per_head_checkpoint(tiny, "sgl-ph-llama-rank1", family="llama")
    model, _ = build_model(ckpt)
    expected = {i: ((k[1],), (v[1],)) for i, (k, v) in PER_HEAD.items()}
    assert_per_head(layer_scales(model), expected)

    # Every head of the full tensor is validated, including heads other ranks serve.
    bad = per_head_checkpoint(
        tiny,
        "sgl-ph-llama-rank1-bad",
        family="llama",
        extra_tensors={"model.layers.1.self_attn.k_scale": per_head_tensor((0.0, 4.75))},
    )
    with pytest.raises(CorruptScaleError, match=r"layers\.1\.self_attn\.k_scale\[head 0\]"):
        build_model(bad)


def test_fingerprint_names_the_layout_the_heads_were_placed_by(tiny, monkeypatch):
    """DP attention: a rank's per-head scales are placed over the attention TP group
    (here rank 0 of 2: head 0), not the full TP group (rank 3 of 4: head 1). The
    fingerprint's answer names the attention-TP place, so the trainer's
    ``scale_fingerprint`` of the same tensors at that place agrees (at the full TP rank it
    would cover head 1 and disagree)."""
    from kvscale_plugin.fingerprint import scale_fingerprint
    from kvscale_plugin.hosts.sglang import live

    _one_head_per_rank(monkeypatch, [(0, 2), (3, 4)])
    monkeypatch.setattr(live, "_tp", lambda: (3, 4))  # the full-TP rank SGLang reports
    ckpt = per_head_checkpoint(tiny, "sgl-ph-llama-attn-tp", family="llama")
    model, _ = build_model(ckpt)
    assert_per_head(layer_scales(model), {i: ((k[0],), (v[0],)) for i, (k, v) in PER_HEAD.items()})
    info = live.server_info(model.quant_config)
    assert (info["tp_rank"], info["tp_size"]) == (0, 2), info
    sent = per_head_tensors(PER_HEAD)
    assert info["fingerprint"] == scale_fingerprint(sent, tp_rank=0, tp_size=2)
    assert info["fingerprint"] != scale_fingerprint(sent, tp_rank=3, tp_size=4)
