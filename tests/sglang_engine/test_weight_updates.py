"""SGLang's weight-update entry points on its real ``sglang.Engine`` (CPU), one Engine start:
the one reload rule (``kvscale_plugin.loadcycle.decide``) as users meet it.

On this CPU the Engine serves a bf16 cache (torch_native: the one SGLang backend that
computes right here; it ignores KV scales, so kvscale keeps ``auto`` in bf16). After the
first request, three weight updates, each followed by the same request, each read back
from the scheduler's layers (the probe plugin, after SGLang's ``WeightUpdater`` method):

1. ``update_weights_from_disk`` to a checkpoint with new scales: taken (kvscale's record of
   the checkpoint values is the new one; the bf16 cache serves 1.0);
2. ``update_weights_from_disk`` to the same weights with a NaN k_scale: taken, one warning
   names the tensor (stock SGLang 0.5.23 answers "Succeeded to update model weights." and
   names nothing), nothing served changes, and the Engine serves the same tokens;
3. a trainer's session (``begin_weight_update``, ``update_weights_from_tensor`` with the
   model's weights only, ``end_weight_update``): the scales in force are kept, and the
   Engine serves the first checkpoint's tokens again (its weights were sent).

The FP8 side of the rule (a NaN update refused naming the tensor, old scales kept) needs an
FP8 pool, which SGLang serves on a CPU only with AMX: tests/sglang_host/test_sglang_reload.py
proves it through SGLang's own ``WeightUpdater`` on every machine.
"""

from __future__ import annotations

import math

import pytest
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids

SCALES_A = {0: (3.25, 2.5), 1: (4.75, 2.125)}
SCALES_B = {0: (1.5, 0.75), 1: (6.5, 5.25)}
NAN_TENSOR = "model.layers.1.self_attn.k_scale"


@pytest.fixture(scope="module")
def checkpoints(tiny):
    # b and nan: the same seed, so the same weights (only the scales differ); a: others.
    a = tiny("sgl-upd-engine-a", family="llama", scales=SCALES_A, seed=0)
    b = tiny("sgl-upd-engine-b", family="llama", scales=SCALES_B, seed=1)
    nan = tiny(
        "sgl-upd-engine-nan", family="llama", scales={**SCALES_B, 1: (math.nan, 5.25)}, seed=1
    )
    return a, b, nan


@pytest.fixture(scope="module")
def run(run_engine, checkpoints):
    a, b, nan = checkpoints
    steps = [
        {"update_weights_from_disk": str(b)},
        {"update_weights_from_disk": str(nan)},
        {"update_weights_from_tensor": str(a)},
    ]
    result = run_engine("weight-updates", a, list(reference_token_ids(a)), steps=steps)
    assert result.error is None, f"{result.error}\n{result.log[-4000:]}"
    assert len(result.result["steps"]) == 3, result.result
    assert len(result.probe.get("updates", [])) == 3, result.probe
    return result


def raw(update) -> dict[int, dict[str, float]]:
    return {layer["layer_id"]: layer["kvscale_raw"] for layer in update["layers"].values()}


def stored(path) -> dict[int, dict[str, float]]:
    return {i: {"k_scale": s["k"], "v_scale": s["v"]} for i, s in read_stored_scales(path).items()}


def tokens(entries) -> list[int]:
    return [tok for _, tok in entries]


def test_new_scales_from_disk_are_taken(run, checkpoints):
    _, b, _ = checkpoints
    answer = run.result["steps"][0]["answer"]
    assert answer[0] is True, answer
    update = run.probe["updates"][0]
    assert update["method"] == "update_weights_from_disk"
    assert raw(update) == stored(b)
    # The bf16 cache serves 1.0 (torch_native ignores KV scales).
    assert {(x["k_scale"], x["v_scale"]) for x in update["layers"].values()} == {(1.0, 1.0)}


def test_a_nan_scale_on_the_bf16_cache_is_named_and_changes_nothing_served(run):
    answer = run.result["steps"][1]["answer"]
    assert answer[0] is True, answer  # the cache uses no scale: the update is taken
    warned = [line for line in run.log.splitlines() if "these corrupt ones are not served" in line]
    assert len(warned) == 1, run.log[-4000:]
    named = [line for line in run.log.splitlines() if f"{NAN_TENSOR}: NaN" in line]
    assert named, run.log[-4000:]
    before, after = run.probe["updates"][0], run.probe["updates"][1]
    assert after["layers"] == before["layers"]  # served and recorded: as before
    steps = run.result["steps"]
    assert tokens(steps[1]["output_token_logprobs"]) == tokens(steps[0]["output_token_logprobs"])


def test_a_trainer_update_without_scales_keeps_them(run, checkpoints):
    _, b, _ = checkpoints
    answer = run.result["steps"][2]["answer"]
    assert answer[0] is True, answer
    update = run.probe["updates"][2]
    assert update["method"] == "end_weight_update"
    assert raw(update) == stored(b)  # the scales in force: the last good load's
    # The first checkpoint's weights were sent: its tokens again (b's weights, loaded by
    # the disk updates, give other tokens: measured [253, 268, 73, 62] vs [253, 300, ...]).
    first = tokens(run.result["output_token_logprobs"])
    assert tokens(run.result["steps"][0]["output_token_logprobs"]) != first
    assert tokens(run.result["steps"][2]["output_token_logprobs"]) == first
