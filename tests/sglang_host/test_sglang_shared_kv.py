"""Layers that read another layer's KV cache (Gemma-3n / Gemma-4 ``num_kv_shared_layers``)
on SGLang 0.5.23's real modules: SGLang builds each sharing layer's ``RadixAttention`` with
its target's ``layer_id`` (it reads the target's FP8 bytes) but its own ``k_scale``, which
stock leaves at 1.0; kvscale serves the target's scales (hosts/sglang/shared.py), after
start-up and after every weight update, and never refuses or counts the sharers' own
checkpoint scales. The same checkpoints as tests/e2e/test_vllm_shared_kv.py (Gemma-4 with
one head_dim for all layers: SGLang reads ``config.head_dim``)."""

from __future__ import annotations

import math

import pytest
from kvscale_testing.shared_kv import build_shared_kv_checkpoint
from sglang_helpers import build_model, layer_scales, update_weights_from_disk

pytestmark = pytest.mark.usefixtures("sglang_runtime")

#: sharing layer -> the layer whose cache it reads (SGLang's names).
SHARING = {
    "model.layers.2.self_attn.attn": "model.layers.0.self_attn.attn",
    "model.layers.3.self_attn.attn": "model.layers.1.self_attn.attn",
}
FAMILIES = ["gemma3n", "gemma4"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("sgl-shared-kv")

    def make(name: str, family: str, **kw):
        path = root / f"{family}-{name}"
        if (path / "config.json").exists():
            return path
        return build_shared_kv_checkpoint(path, family=family, one_head_dim=True, **kw)

    return make


def _held(model) -> dict[str, tuple]:
    return {n: (s.k, s.v, s.k_float, s.v_float, s.source) for n, s in layer_scales(model).items()}


@pytest.mark.parametrize("family", FAMILIES)
def test_sharing_layers_serve_their_targets_scales_stock_serves_one(
    ckpts, family, kvscale_warnings
):
    ckpt = ckpts("default", family)
    stock, _ = build_model(ckpt, quantization=None)
    model, _ = build_model(ckpt)
    ours, theirs = _held(model), _held(stock)
    assert ours["model.layers.0.self_attn.attn"][:4] == (0.5, 0.25, 0.5, 0.25)
    assert ours["model.layers.1.self_attn.attn"][:4] == (1.5, 1.25, 1.5, 1.25)
    for layer, target in SHARING.items():
        assert ours[layer][:4] == ours[target][:4] and ours[layer][4] == "shared", layer
        assert theirs[layer][:2] == (1.0, 1.0), theirs[layer]  # stock: the sharer's own
    assert kvscale_warnings("no k_scale/v_scale tensors") == []  # sharers are not missing


@pytest.mark.parametrize("family", FAMILIES)
def test_own_scales_under_a_sharing_layer_are_named_not_served_or_refused(
    ckpts, family, kvscale_warnings
):
    ckpt = ckpts("own", family, own_scales={2: (7.0, 6.0), 3: (math.nan, 1.25)})
    model, _ = build_model(ckpt)  # a NaN under a sharer's name: unused, not refused
    held = _held(model)
    for layer, target in SHARING.items():
        assert held[layer][:4] == held[target][:4], layer
    differing = kvscale_warnings("not the ones the checkpoint ships under their own names")
    assert len(differing) == 1 and "model.layers.2.self_attn.attn ships (7, 6)" in differing[0]
    corrupt = kvscale_warnings("corrupt k/v scales under layers that read another")
    assert len(corrupt) == 1 and "model.layers.3.self_attn.k_scale: NaN" in corrupt[0], corrupt


def test_a_weight_update_moves_the_sharers_with_their_targets(ckpts):
    model, config = build_model(ckpts("default", "gemma4"))
    before = layer_scales(model)
    ok, message = update_weights_from_disk(
        model, config, ckpts("new", "gemma4", scales={0: (2.5, 2.25), 1: (3.5, 3.25)})
    )
    assert ok, message
    held = _held(model)
    assert held["model.layers.2.self_attn.attn"][:4] == (2.5, 2.25, 2.5, 2.25)
    assert held["model.layers.3.self_attn.attn"][:4] == (3.5, 3.25, 3.5, 3.25)
    after = layer_scales(model)
    assert {n: s.k_ptr for n, s in after.items()} == {n: s.k_ptr for n, s in before.items()}


def test_per_head_scales_are_shared_per_head(ckpts):
    model, _ = build_model(ckpts("per-head", "gemma4", per_head=True))
    scales = layer_scales(model)
    assert scales["model.layers.0.self_attn.attn"].k_heads == (0.5, 1.0)
    for layer, target in SHARING.items():
        mine, theirs = scales[layer], scales[target]
        assert (mine.k_heads, mine.v_heads, mine.k) == (theirs.k_heads, theirs.v_heads, theirs.k)


def test_on_a_bf16_cache_every_layer_is_unscaled(ckpts):
    from sglang.srt.runtime_context import get_model

    with get_model().override(kv_cache_dtype="bfloat16"):
        model, _ = build_model(ckpts("default", "gemma3n"))
    assert {s[:4] for s in _held(model).values()} == {(1.0, 1.0, 1.0, 1.0)}
