"""MTP (multi-token-prediction / NextN) draft layers on SGLang 0.5.23: the k/v scales a
checkpoint declares for its MTP layers, stock and with kvscale.

SGLang's speculative worker builds the draft as its own model from the same checkpoint:
``ModelConfig(is_draft_model=True)`` rewrites ``architectures[0]`` (MiMoForCausalLM ->
MiMoMTP, Glm4MoeForCausalLM -> Glm4MoeForCausalLMNextN, Qwen3NextForCausalLM ->
Qwen3NextForCausalLMMTP, Qwen3.5 -> Qwen3_5ForCausalLMMTP), and the draft's quantization
is the target's unless --speculative-draft-model-quantization says otherwise. These
tests build exactly that with SGLang's own ``ModelConfig`` and ``DefaultModelLoader``.
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_mtp_scales, read_stored_scales
from sglang_helpers import (
    SCALES,
    attention_layers,
    build_model,
    layer_scales,
    reload,
    update_weights_from_disk,
)

from kvscale_plugin.scales import CorruptScaleError

pytestmark = pytest.mark.usefixtures("sglang_runtime")

#: MTP scales distinct from every main-stack scale, so a layer mix-up cannot pass.
MTP = {0: (3.5, 1.25)}
MTP_B = {0: (0.875, 5.75)}

#: Per family: SGLang's draft class, and the checkpoint tensor of MTP layer 0's k_scale.
DRAFTS = {
    "mimo": ("MiMoMTP", "model.mtp_layers.0.self_attn.k_scale"),
    "glm4_moe": ("Glm4MoeForCausalLMNextN", "model.layers.2.self_attn.k_scale"),
    "qwen3_next": ("Qwen3NextForCausalLMMTP", "mtp.layers.0.self_attn.k_scale"),
    "qwen3_5": ("Qwen3_5ForCausalLMMTP", "mtp.layers.0.self_attn.k_scale"),
}
FAMILIES = tuple(DRAFTS)


def mtp_checkpoint(tiny, family: str, mtp_scales=MTP, tag: str = "", **fields):
    return tiny(
        f"sgl-mtp-{family}{tag}",
        family=family,
        num_layers=2,
        num_mtp_layers=1,
        scales=SCALES,
        mtp_scales=mtp_scales,
        **fields,
    )


def build_draft(path, quantization: str | None = "kvscale"):
    """The draft model as SGLang's speculative worker builds it from ``path``."""
    return build_model(path, quantization=quantization, is_draft_model=True)


def draft_pool_dtype(model: torch.nn.Module) -> torch.dtype:
    """SGLang's --kv-cache-dtype auto resolution for a draft worker's KV pool."""
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    return configure_kv_cache_dtype(
        server_args_kv_cache_dtype="auto",
        model=model,
        model_dtype=torch.bfloat16,
        is_draft_worker=True,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )[1]


def only_layer(model: torch.nn.Module):
    scales = layer_scales(model)
    assert len(scales) == 1, scales  # SGLang's drafts build one MTP layer
    return next(iter(scales.values()))


def test_the_draft_is_built_as_sglangs_speculative_worker_builds_it(tiny):
    for family, (arch, _) in DRAFTS.items():
        model, model_config = build_draft(mtp_checkpoint(tiny, family))
        assert type(model).__name__ == arch, family
        assert model_config.hf_config.architectures[0] == arch
        assert model_config.quantization == "kvscale"
        assert draft_pool_dtype(model) == torch.float8_e4m3fn


# What stock SGLang 0.5.23 (compressed-tensors auto-detected) does with a checkpoint whose
# MTP layer 0 has calibrated k/v scales (3.5, 1.25): the exception it raises, "none" (the
# draft's RadixAttention is built without quant_config: no scale at all, an FP8 pool
# written at scale 1.0), or "loaded".
STOCK = {
    "mimo": (KeyError, "model.mtp_block.self_attn.k_scale"),
    "glm4_moe": "none",
    "qwen3_next": (AssertionError, "Expected 1.0, got 3.5 in skipped model.layers.0.k_scale"),
    "qwen3_5": "loaded",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_stock_sglang_on_mtp_draft_scales(tiny, family):
    ckpt = mtp_checkpoint(tiny, family)
    expected = STOCK[family]
    if isinstance(expected, tuple):
        error, text = expected
        with pytest.raises(error) as info:
            build_draft(ckpt, quantization=None)
        assert text in str(info.value)
        return
    model, model_config = build_draft(ckpt, quantization=None)
    assert model_config.quantization == "compressed-tensors"
    layer = only_layer(model)
    assert draft_pool_dtype(model) == torch.float8_e4m3fn
    if expected == "none":
        assert (layer.method, layer.k, layer.k_float) == (None, None, None), layer
    else:
        assert (layer.k, layer.v, layer.k_float, layer.v_float) == (3.5, 1.25, 3.5, 1.25)


def test_stock_qwen3_5_draft_loads_mtp_scales_unchecked(tiny):
    # The one family stock loads, it loads unchecked: an infinite k_scale is served, a
    # NaN one trips a bare ``assert layer.k_scale > 0.0`` in SGLang's BaseKVCacheMethod
    # (no tensor named).
    inf = mtp_checkpoint(tiny, "qwen3_5", mtp_scales={0: (math.inf, 1.25)}, tag="-inf")
    model, _ = build_draft(inf, quantization=None)
    assert only_layer(model).k == math.inf
    nan = mtp_checkpoint(tiny, "qwen3_5", mtp_scales={0: (math.nan, 1.25)}, tag="-nan")
    with pytest.raises(AssertionError) as info:
        build_draft(nan, quantization=None)
    assert str(info.value) == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_kvscale_loads_mtp_scales_into_the_draft(tiny, family):
    ckpt = mtp_checkpoint(tiny, family)
    assert read_stored_mtp_scales(ckpt) == {0: {"k": 3.5, "v": 1.25}}
    model, _ = build_draft(ckpt)
    layer = only_layer(model)
    assert (layer.k, layer.v, layer.k_float, layer.v_float) == (3.5, 1.25, 3.5, 1.25), layer
    assert (layer.method, layer.source) == ("KVScaleKVCacheMethod", "checkpoint")
    # Not one of the main stack's scales (a main layer's scale in the draft would show).
    assert (3.5, 1.25) not in {(s["k"], s["v"]) for s in read_stored_scales(ckpt).values()}


@pytest.mark.parametrize("family", FAMILIES)
def test_an_mtp_q_scale_is_skipped_like_the_main_stacks(tiny, family):
    """SGLang keeps no q scale: the main stack's loaders skip one; the draft must too
    (stock MiMoMTP raises KeyError on ``model.mtp_block.self_attn.q_scale``)."""
    prefix = DRAFTS[family][1].rsplit(".", 1)[0]
    ckpt = mtp_checkpoint(
        tiny, family, tag="-q", extra_tensors={f"{prefix}.q_scale": torch.tensor(0.5)}
    )
    model, _ = build_draft(ckpt)
    layer = only_layer(model)
    assert (layer.k, layer.v, layer.k_float, layer.v_float) == (3.5, 1.25, 3.5, 1.25), layer


@pytest.mark.parametrize("naming", ["k_proj", "kv_scale"])
@pytest.mark.parametrize("family", ["mimo", "qwen3_next"])
def test_kvscale_loads_mtp_scales_in_other_namings(tiny, family, naming):
    ckpt = mtp_checkpoint(tiny, family, tag=f"-{naming}", naming=naming)
    stored = read_stored_mtp_scales(ckpt)[0]
    model, _ = build_draft(ckpt)
    layer = only_layer(model)
    assert (layer.k, layer.v, layer.k_float, layer.v_float) == (
        stored["k"],
        stored["v"],
        stored["k"],
        stored["v"],
    )
    assert layer.source == ("duplicated" if naming == "kv_scale" else "checkpoint")


@pytest.mark.parametrize("family", FAMILIES)
def test_a_corrupt_mtp_scale_fails_naming_the_checkpoint_tensor(tiny, family):
    ckpt = mtp_checkpoint(tiny, family, mtp_scales={0: (math.nan, -1.0)}, tag="-corrupt")
    k_name = DRAFTS[family][1]
    v_name = k_name.replace("k_scale", "v_scale")
    with pytest.raises(CorruptScaleError) as info:
        build_draft(ckpt)
    text = str(info.value)
    assert f"{k_name}: " in text and "NaN" in text, text
    assert f"{v_name}: " in text and "negative" in text, text


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_mtp_scales_serve_1_with_a_warning(tiny, family, kvscale_warnings):
    ckpt = mtp_checkpoint(tiny, family, mtp_scales=None, tag="-no-mtp", write_mtp_scales=False)
    assert read_stored_mtp_scales(ckpt) == {}
    model, _ = build_draft(ckpt)
    layer = only_layer(model)
    assert (layer.k, layer.v, layer.k_float, layer.source) == (1.0, 1.0, 1.0, "default")
    (warning,) = kvscale_warnings("has no k_scale/v_scale tensors")
    # Named as SGLang prefixed the draft's RadixAttention (e.g. MiMoMTP: "self_attn.attn").
    (attn,) = attention_layers(model).values()
    assert f"tensors for {attn.kvscale_record.name};" in warning
    # The main stack's scales, which the draft's checkpoint also holds, are not reported.
    assert kvscale_warnings("were not loaded") == []


@pytest.mark.parametrize("family", FAMILIES)
def test_draft_reload_takes_the_new_mtp_scales(tiny, family):
    model, model_config = build_draft(mtp_checkpoint(tiny, family))
    other = mtp_checkpoint(tiny, family, mtp_scales=MTP_B, tag="-b")
    reload(model, model_config, other)  # what update_weights_from_disk does
    layer = only_layer(model)
    assert (layer.k, layer.v, layer.k_float, layer.v_float) == (0.875, 5.75, 0.875, 5.75)
    # A reload without scale tensors keeps the last ones.
    reload(model, model_config, other, name_filter=lambda n: not n.endswith("_scale"))
    assert (only_layer(model).k, only_layer(model).v) == (0.875, 5.75)


def test_a_corrupt_mtp_scale_in_a_reload_fails_and_a_good_one_recovers(tiny):
    model, model_config = build_draft(mtp_checkpoint(tiny, "qwen3_next"))
    held = (only_layer(model).k, only_layer(model).v)
    bad = mtp_checkpoint(tiny, "qwen3_next", mtp_scales={0: (math.inf, 1.0)}, tag="-inf")
    # Refused naming the checkpoint's tensor; the draft keeps its scales (loadcycle.decide).
    ok, message = update_weights_from_disk(model, model_config, bad)
    assert not ok and re.search(r"mtp\.layers\.0\.self_attn\.k_scale: ", message), message
    assert (only_layer(model).k, only_layer(model).v) == held
    reload(model, model_config, mtp_checkpoint(tiny, "qwen3_next", mtp_scales=MTP_B, tag="-b"))
    assert (only_layer(model).k, only_layer(model).v) == (0.875, 5.75)


@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_the_target_model_keeps_its_scales_and_leaves_mtp_scales_to_the_draft(
    tiny, family, kvscale_warnings
):
    # (Qwen3-Next / Qwen3.5 targets are not built here: SGLang 0.5.23's Qwen3NextModel
    # reads config.full_attention_interval, which the tiny configs do not carry.)
    ckpt = mtp_checkpoint(tiny, family)
    model, _ = build_model(ckpt)
    scales = layer_scales(model)
    assert len(scales) == 2
    stored = {i: (s["k"], s["v"]) for i, s in read_stored_scales(ckpt).items()}
    for name, s in scales.items():
        i = int(name.split("layers.")[1].split(".")[0])
        assert (s.k, s.v, s.k_float, s.v_float) == (*stored[i], *stored[i]), name
    assert kvscale_warnings("were not loaded") == []  # the MTP scales are the draft's


def test_stock_glm4_moe_target_has_no_kv_scales_kvscale_loads_them(tiny):
    # Glm4MoeAttention (stack and NextN draft) builds RadixAttention without quant_config.
    ckpt = mtp_checkpoint(tiny, "glm4_moe")
    stock, _ = build_model(ckpt, quantization=None)
    assert all(s.method is None and s.k is None for s in layer_scales(stock).values())
    ours, _ = build_model(ckpt)
    assert {s.source for s in layer_scales(ours).values()} == {"checkpoint"}


def test_target_still_reports_stray_layers_beyond_the_declared_mtp_layers(tiny, kvscale_warnings):
    ckpt = mtp_checkpoint(
        tiny,
        "glm4_moe",
        tag="-stray",
        extra_tensors={"model.layers.7.self_attn.k_scale": torch.tensor([3.0])},
    )
    build_model(ckpt)
    (warning,) = kvscale_warnings("were not loaded")
    assert "model.layers.7.self_attn.k_scale" in warning
    assert "model.layers.2." not in warning  # MTP layer 0: the draft's
