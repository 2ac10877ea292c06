"""RL weight syncs on real SGLang modules (docs/reliability.md): every sync path serves the
scales that come with it, the served copies are checked after every load, the scale
fingerprint equals ``kvscale_plugin.fingerprint.scale_fingerprint`` of the tensors sent,
and on an FP8 pool a sync that changed the scales flushes the radix cache.

The model is built and loaded by SGLang's ``DefaultModelLoader``; syncs go through
SGLang's own model-runner ``WeightUpdater`` and its scheduler-level
``SchedulerWeightUpdaterManager`` (the scheduler's request handlers). Built outside a
server, the cache is judged FP8 (``auto``), so the layers serve the checkpoint's scales
here (the Engine on this CPU serves a bf16 cache: tests/sglang_engine/test_rl_sync.py).
"""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from sglang_helpers import (
    PER_HEAD,
    PER_HEAD_B,
    SCALES,
    SCALES_B,
    assert_scales,
    attention_layers,
    build_model,
    layer_scales,
    per_head_checkpoint,
    per_head_tensors,
    update_weights_from_disk,
    weight_updater,
)

from kvscale_plugin.fingerprint import scale_fingerprint
from kvscale_plugin.hosts.sglang import live
from kvscale_plugin.scales import CorruptScaleError

pytestmark = pytest.mark.usefixtures("sglang_runtime")

NAN_TENSOR = "model.layers.1.self_attn.k_scale"


def scale_tensors(scales) -> dict[str, torch.Tensor]:
    """The k/v scale tensors a trainer sends, as a checkpoint names them."""
    out = {}
    for i, (k, v) in scales.items():
        out[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(k, dtype=torch.float32)
        out[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(v, dtype=torch.float32)
    return out


def model_weights_only(path) -> list[tuple[str, torch.Tensor]]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return [(n, t) for n, t in tensors.items() if not n.endswith("_scale")]


@pytest.fixture
def ckpt(tiny):
    return tiny("sgl-rl-a", family="llama", scales=SCALES)


def info(model) -> dict:
    return live.server_info(model.quant_config)


# -- every sync path takes its scales ------------------------------------------------------


def _runner_tensor(updater, weights):
    return updater.update_weights_from_tensor(weights)


def _runner_distributed(updater, weights):
    return updater.load_weights_from_distributed(weights)


OUTSIDE_A_SESSION = pytest.mark.parametrize(
    "send", [_runner_tensor, _runner_distributed], ids=["tensor", "distributed"]
)


@OUTSIDE_A_SESSION
def test_scales_only_outside_a_session_are_served(ckpt, send):
    """SGLang 0.5.23 loads these through model.load_weights and never post-processes:
    without kvscale's own cycle the loaders record the values and nothing serves them."""
    model, config = build_model(ckpt)
    before = layer_scales(model)
    ok, message = send(weight_updater(model, config), list(scale_tensors(SCALES_B).items()))
    assert ok, message
    after = layer_scales(model)
    assert_scales(after, SCALES_B)
    assert {n: s.k_ptr for n, s in after.items()} == {n: s.k_ptr for n, s in before.items()}
    assert info(model)["fingerprint"] == scale_fingerprint(scale_tensors(SCALES_B))
    assert info(model)["updates"] == 2  # the start-up load, this one


def test_k_and_v_in_different_calls_outside_a_session(ckpt):
    """A trainer's buckets may carry a layer's k_scale and v_scale in different calls:
    each call changes what it names, the other scale stays in force."""
    model, config = build_model(ckpt)
    updater = weight_updater(model, config)
    updater.update_weights_from_tensor([("model.layers.0.self_attn.k_scale", torch.tensor(6.5))])
    assert_scales(layer_scales(model), {0: (6.5, SCALES[0][1]), 1: SCALES[1]})
    updater.update_weights_from_tensor([("model.layers.0.self_attn.v_scale", torch.tensor(0.5))])
    assert_scales(layer_scales(model), {0: (6.5, 0.5), 1: SCALES[1]})
    assert info(model)["updates"] == 3


def test_a_corrupt_scale_outside_a_session_refuses_the_call_s_scales(ckpt):
    model, config = build_model(ckpt)
    updater = weight_updater(model, config)
    sent = scale_tensors(SCALES_B)
    sent[NAN_TENSOR] = torch.tensor(math.nan)
    with pytest.raises(CorruptScaleError, match=f"{NAN_TENSOR}: NaN"):
        updater.update_weights_from_tensor(list(sent.items()))
    assert_scales(layer_scales(model), SCALES)  # layer 0's valid ones kept back too
    ok, message = updater.load_weights_from_distributed(list(sent.items()))
    assert not ok and f"{NAN_TENSOR}: NaN" in message, message
    assert_scales(layer_scales(model), SCALES)
    assert info(model)["updates"] == 1
    # The next good call is taken.
    ok, message = updater.update_weights_from_tensor(list(scale_tensors(SCALES_B).items()))
    assert ok, message
    assert_scales(layer_scales(model), SCALES_B)


def test_a_call_outside_a_session_that_fails_takes_no_scale_and_ends_its_cycle(ckpt):
    model, config = build_model(ckpt)
    updater = weight_updater(model, config)
    bad = [
        ("model.layers.0.self_attn.k_scale", torch.tensor(6.5)),
        ("model.embed_tokens.weight", torch.zeros(3)),  # a wrong shape: SGLang's loader raises
    ]
    with pytest.raises(Exception) as raised:
        updater.update_weights_from_tensor(bad)
    assert not isinstance(raised.value, CorruptScaleError), raised.value
    assert_scales(layer_scales(model), SCALES)
    assert not model.quant_config.cycle.pending  # the next call is a cycle of its own again
    updater.update_weights_from_tensor([("model.layers.1.self_attn.k_scale", torch.tensor(0.5))])
    assert_scales(layer_scales(model), {0: SCALES[0], 1: (0.5, SCALES[1][1])})


def test_weights_only_outside_a_session_keep_the_scales(ckpt, tiny):
    model, config = build_model(ckpt)
    weights = model_weights_only(tiny("sgl-rl-b", family="llama", scales=SCALES_B, seed=1))
    ok, message = weight_updater(model, config).update_weights_from_tensor(weights)
    assert ok, message
    assert_scales(layer_scales(model), SCALES)
    assert info(model)["updates"] == 1


def test_scales_only_in_a_session_are_served_at_its_end(ckpt):
    model, config = build_model(ckpt)
    updater = weight_updater(model, config)
    updater.begin_weight_update()
    ok, message = updater.update_weights_from_tensor(list(scale_tensors(SCALES_B).items()))
    assert ok, message
    assert_scales(layer_scales(model), SCALES)  # not yet: SGLang post-processes at the end
    updater.end_weight_update(run_post_load=False)
    assert_scales(layer_scales(model), SCALES_B)
    assert info(model)["fingerprint"] == scale_fingerprint(scale_tensors(SCALES_B))
    assert info(model)["updates"] == 2


# -- the served state is checked --------------------------------------------------------------


def _zero_served(model) -> None:
    """What a memory release / resume leaves in the served tensors (Python copies stay)."""
    with torch.no_grad():
        for layer in attention_layers(model).values():
            layer.k_scale.zero_()
            layer.v_scale.zero_()


def test_cleared_tensors_are_rewritten_by_the_next_weights_only_session(
    ckpt, tiny, kvscale_warnings
):
    model, config = build_model(ckpt)
    expected = scale_fingerprint(scale_tensors(SCALES))
    _zero_served(model)
    assert not info(model)["consistent"] and info(model)["fingerprint"] != expected
    updater = weight_updater(model, config)
    updater.begin_weight_update()
    weights = model_weights_only(tiny("sgl-rl-b", family="llama", scales=SCALES_B, seed=1))
    ok, message = updater.update_weights_from_tensor(weights)
    assert ok, message
    updater.end_weight_update(run_post_load=False)
    assert_scales(layer_scales(model), SCALES)
    warned = kvscale_warnings("rewritten from kvscale's record")
    assert len(warned) == 1, warned
    for name in ("model.layers.0.self_attn.attn.k_scale held 0", "layers.1.self_attn.attn.v_scale"):
        assert name in warned[0], warned
    assert "k_scale_float" not in warned[0]  # it held the right value: not rewritten
    assert info(model)["fingerprint"] == expected and info(model)["consistent"]
    assert info(model)["updates"] == 1  # no scales were taken


def test_one_copy_set_behind_kvscale_s_back_shows_and_is_rewritten(ckpt, tiny, kvscale_warnings):
    model, config = build_model(ckpt)
    expected = scale_fingerprint(scale_tensors(SCALES))
    layer = attention_layers(model)["model.layers.1.self_attn.attn"]
    layer.k_scale_float = 9.0
    lines = live.fingerprint_lines(attention_layers(model).values())
    assert "! 1 k k_scale_float 9" in lines, lines
    assert info(model)["fingerprint"] != expected and not info(model)["consistent"]
    # The next update carries weights only (nothing of kvscale writes the scales then).
    weights = model_weights_only(tiny("sgl-rl-b", family="llama", scales=SCALES_B, seed=1))
    ok, message = weight_updater(model, config).update_weights_from_tensor(weights)
    assert ok, message
    assert layer.k_scale_float == SCALES[1][0]
    warned = kvscale_warnings("rewritten from kvscale's record")
    assert len(warned) == 1 and "1 served KV-scale copy did not" in warned[0], warned
    assert "model.layers.1.self_attn.attn.k_scale_float held 9, in force 4.75" in warned[0]
    assert info(model)["fingerprint"] == expected and info(model)["consistent"]
    # An update that carries the scales writes every copy itself: nothing to rewrite.
    layer.v_scale_float = 0.0
    ok, message = update_weights_from_disk(model, config, ckpt)
    assert ok, message
    assert layer.v_scale_float == SCALES[1][1]
    assert len(kvscale_warnings("rewritten from kvscale's record")) == 1


def test_a_per_head_copy_is_checked(tiny, kvscale_warnings):
    path = per_head_checkpoint(tiny, "sgl-rl-heads")
    model, config = build_model(path)
    assert info(model)["fingerprint"] == scale_fingerprint(per_head_tensors(PER_HEAD))
    layer = attention_layers(model)["model.layers.0.self_attn.attn"]
    layer.kvscale_v_heads = (0.5, 0.5)
    assert info(model)["fingerprint"] != scale_fingerprint(per_head_tensors(PER_HEAD))
    assert live.check_served(model.quant_config) == [
        "model.layers.0.self_attn.attn.kvscale_v_heads"
    ]
    assert layer.kvscale_v_heads == PER_HEAD[0][1]
    # ...and new per-head scales through a session: this rank's heads, as sent.
    updater = weight_updater(model, config)
    updater.begin_weight_update()
    updater.update_weights_from_tensor(list(per_head_tensors(PER_HEAD_B).items()))
    updater.end_weight_update(run_post_load=False)
    assert info(model)["fingerprint"] == scale_fingerprint(per_head_tensors(PER_HEAD_B))


def test_every_cycle_logs_the_fingerprint_and_the_counter(ckpt, tiny, caplog):
    caplog.set_level(logging.INFO, logger="kvscale_plugin")
    model, config = build_model(ckpt)
    updater = weight_updater(model, config)
    updater.update_weights_from_tensor(list(scale_tensors(SCALES_B).items()))
    weights = model_weights_only(tiny("sgl-rl-b", family="llama", scales=SCALES_B, seed=1))
    updater.begin_weight_update()
    updater.update_weights_from_tensor(weights)
    updater.end_weight_update(run_post_load=False)
    lines = [r.getMessage() for r in caplog.records if "have fingerprint" in r.getMessage()]
    a, b = scale_fingerprint(scale_tensors(SCALES)), scale_fingerprint(scale_tensors(SCALES_B))
    assert lines == [
        f"kvscale: start-up load: KV scales in force have fingerprint {a} (update 1, 2 layers).",
        "kvscale: model.load_weights outside a weight-update session: KV scales in force "
        f"have fingerprint {b} (update 2, 2 layers).",
        f"kvscale: weight-update session: KV scales in force have fingerprint {b} "
        "(update 2, 2 layers).",
    ], lines


# -- the radix cache after a scale change (scheduler level) --------------------------------


def scheduler_manager(model, config, kv_cache_dtype, flush_ok=True):
    """SGLang's own scheduler weight-update manager over SGLang's model-runner
    ``WeightUpdater``; the TP worker and the scheduler are reduced to what it calls
    (the runner, this rank's payload, a weight-version recorder), and ``flush_cache``
    records its calls (the Scheduler's flush needs its whole cache)."""
    from sglang.srt.managers.scheduler_components.weight_updater import (
        SchedulerWeightUpdaterManager,
    )

    runner = SimpleNamespace(
        model=model, weight_updater=weight_updater(model, config), kv_cache_dtype=kv_cache_dtype
    )
    worker = SimpleNamespace(
        model_runner=runner,
        weight_update_runners=lambda: [("target", runner)],
        # this rank's payload (SGLang's deserializer is for CUDA IPC handles)
        deserialize_own_rank=lambda payloads: payloads[0],
    )
    flushes: list[bool] = []

    def flush_cache(empty_cache: bool = True) -> bool:
        flushes.append(empty_cache)
        return flush_ok

    manager = SchedulerWeightUpdaterManager(
        tp_worker=worker,
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=flush_cache,
        is_fully_idle=lambda **_: True,
        scheduler=SimpleNamespace(record_weight_version_change=lambda new_version: None),
    )
    return manager, flushes


def session(manager, weights, flush_cache: bool):
    from sglang.srt.managers.io_struct import (
        BeginWeightUpdateReqInput,
        EndWeightUpdateReqInput,
        UpdateWeightsFromTensorReqInput,
    )

    assert manager.begin_weight_update(BeginWeightUpdateReqInput()).success
    out = manager.update_weights_from_tensor(
        UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[weights],
            flush_cache=flush_cache,
        )
    )
    assert out.success, out.message
    return manager.end_weight_update(EndWeightUpdateReqInput())


@pytest.mark.parametrize("flush_cache", [True, False])
def test_fp8_a_session_that_changed_the_scales_flushes_at_its_end(ckpt, flush_cache):
    model, config = build_model(ckpt)
    manager, flushes = scheduler_manager(model, config, torch.float8_e4m3fn)
    end = session(manager, list(scale_tensors(SCALES_B).items()), flush_cache)
    assert end.success, end.message
    assert_scales(layer_scales(model), SCALES_B)
    # SGLang flushed after the tensors (flush_cache=True), before the scales were served;
    # kvscale flushes at the end, where they changed.
    assert len(flushes) == (2 if flush_cache else 1), flushes
    # A session without scales changes nothing served: no flush of kvscale's.
    end = session(manager, list(scale_tensors(SCALES_B).items()), flush_cache=False)
    assert end.success and len(flushes) == (2 if flush_cache else 1), flushes


def test_fp8_a_disk_update_with_flush_cache_false_that_changed_the_scales_flushes(ckpt, tiny):
    from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput

    model, config = build_model(ckpt)
    manager, flushes = scheduler_manager(model, config, torch.float8_e4m3fn)
    b = tiny("sgl-rl-b", family="llama", scales=SCALES_B, seed=1)
    out = manager.update_weights_from_disk(
        UpdateWeightFromDiskReqInput(model_path=str(b), load_format="auto", flush_cache=False)
    )
    assert out.success, out.message
    assert_scales(layer_scales(model), SCALES_B)
    assert len(flushes) == 1
    # With flush_cache=True SGLang flushes itself: kvscale adds none.
    out = manager.update_weights_from_disk(
        UpdateWeightFromDiskReqInput(model_path=str(ckpt), load_format="auto", flush_cache=True)
    )
    assert out.success and len(flushes) == 2, (out, flushes)


def test_fp8_a_flush_refused_fails_the_end_of_the_session(ckpt):
    model, config = build_model(ckpt)
    manager, flushes = scheduler_manager(model, config, torch.float8_e4m3fn, flush_ok=False)
    end = session(manager, list(scale_tensors(SCALES_B).items()), flush_cache=False)
    assert not end.success and "could not be flushed" in end.message, end
    assert flushes == [True]


def test_bf16_pool_a_scale_change_flushes_nothing_of_kvscale_s(ckpt):
    model, config = build_model(ckpt)
    manager, flushes = scheduler_manager(model, config, torch.bfloat16)
    end = session(manager, list(scale_tensors(SCALES_B).items()), flush_cache=False)
    assert end.success and flushes == [], flushes
