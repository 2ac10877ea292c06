"""SGLang's weight-update entry points on real SGLang modules follow the one reload rule
(``kvscale_plugin.loadcycle.decide``), as vLLM's do: new scales are taken in place; a
reload with a corrupt scale is refused naming every tensor as on disk while every layer
keeps its scales (FP8), or taken with one warning and nothing served changed (bf16); an
update that carries no scales (a trainer's) keeps the scales in force, said once.

``update_weights_from_disk`` is SGLang's own ``WeightUpdater`` method (what the scheduler
calls for ``Engine.update_weights_from_disk``), with kvscale's patch on it; a session is
SGLang's ``begin_weight_update`` / ``update_weights_from_tensor`` / ``end_weight_update``.
The same cases on SGLang's Engine: tests/sglang_engine/test_weight_updates.py.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch
from sglang_helpers import (
    SCALES,
    SCALES_B,
    assert_scales,
    build_model,
    layer_scales,
    update_weights_from_disk,
    weight_updater,
)

pytestmark = pytest.mark.usefixtures("sglang_runtime")

NAN_TENSOR = "model.layers.1.self_attn.k_scale"


@pytest.fixture
def ckpts(tiny):
    def make(tag: str, scales=SCALES, family: str = "qwen3"):
        return tiny(f"sgl-upd-{tag}", family=family, scales=scales)

    return make


def _model_weights_only(path) -> list[tuple[str, torch.Tensor]]:
    """What a trainer sends: the model's weights, no KV-scale tensor."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return [(n, t) for n, t in tensors.items() if not n.endswith("_scale")]


def test_new_scales_are_taken_in_place(ckpts):
    model, config = build_model(ckpts("a"))
    before = layer_scales(model)
    ok, message = update_weights_from_disk(model, config, ckpts("b", SCALES_B))
    assert ok, message
    after = layer_scales(model)
    assert_scales(after, SCALES_B)
    assert {n: s.k_ptr for n, s in after.items()} == {n: s.k_ptr for n, s in before.items()}


def test_a_nan_scale_is_refused_naming_it_and_every_layer_keeps_its_scales(ckpts):
    model, config = build_model(ckpts("a"))
    nan = ckpts("nan", {0: (1.5, 0.75), 1: (math.nan, 5.25)})
    ok, message = update_weights_from_disk(model, config, nan)
    assert not ok
    assert f"{NAN_TENSOR}: NaN" in message, message
    assert "every attention layer keeps the KV scales it had" in message
    # Layer 0's new scales were valid: kept back too (the whole reload's scales refused).
    assert_scales(layer_scales(model), SCALES)
    # The refusal is read once: the next good update is taken, and answers success.
    ok, message = update_weights_from_disk(model, config, ckpts("b", SCALES_B))
    assert ok, message
    assert_scales(layer_scales(model), SCALES_B)


def test_on_a_bf16_cache_a_nan_scale_is_warned_about_not_served(ckpts, kvscale_warnings):
    from sglang.srt.runtime_context import get_model

    with get_model().override(kv_cache_dtype="bfloat16"):
        model, config = build_model(ckpts("a"))
        served = layer_scales(model)
        nan = ckpts("nan", {0: (1.5, 0.75), 1: (math.nan, 5.25)})
        ok, message = update_weights_from_disk(model, config, nan)
    assert ok, message  # nothing the cache uses is corrupt: the update is taken
    assert layer_scales(model) == served  # still 1.0, the same tensors
    warned = kvscale_warnings("these corrupt ones are not served")
    assert len(warned) == 1 and f"{NAN_TENSOR}: NaN" in warned[0], warned


def test_a_trainer_update_without_scales_keeps_them_said_once(ckpts, kvscale_warnings):
    model, config = build_model(ckpts("a"))
    updater = weight_updater(model, config)
    weights = _model_weights_only(ckpts("b", SCALES_B))
    for _ in range(2):
        updater.begin_weight_update()
        ok, message = updater.update_weights_from_tensor(weights)
        assert ok, message
        updater.end_weight_update(run_post_load=False)
        assert_scales(layer_scales(model), SCALES)
    warned = kvscale_warnings("carry no k_scale/v_scale tensors")
    assert len(warned) == 1, warned
    assert "keep the scales they had" in warned[0]


def test_a_session_with_a_nan_scale_keeps_the_scales_and_logs_the_refusal(ckpts, caplog):
    model, config = build_model(ckpts("a"))
    updater = weight_updater(model, config)
    caplog.set_level(logging.ERROR, logger="kvscale_plugin")
    updater.begin_weight_update()
    updater.update_weights_from_tensor([(NAN_TENSOR, torch.tensor(math.nan))])
    updater.end_weight_update(run_post_load=False)
    assert_scales(layer_scales(model), SCALES)
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and f"{NAN_TENSOR}: NaN" in errors[0], errors
    # The next session starts clean: its valid scale is taken (a k_scale alone serves
    # k and v, as a checkpoint with one scale per layer does); layer 0 keeps its own.
    updater.begin_weight_update()
    updater.update_weights_from_tensor([(NAN_TENSOR, torch.tensor(6.5))])
    updater.end_weight_update(run_post_load=False)
    assert_scales(layer_scales(model), {0: SCALES[0], 1: (6.5, 6.5)})
