"""RL weight syncs on SGLang's real ``sglang.Engine`` (CPU), one Engine start
(docs/reliability.md): the scales each sync path carries, the served copies checked after
each update, and kvscale's scale fingerprint as ``Engine.get_server_info()`` returns it.

On this CPU the Engine serves a bf16 cache (torch_native ignores KV scales, so kvscale
keeps ``auto`` in bf16): its layers serve 1.0, and the fingerprint is compared with
``scale_fingerprint`` of 1.0 tensors; kvscale's record of the checkpoint values (the
probe's ``kvscale_raw``) shows what each update took. The FP8 side (scales served, the
radix cache flushed after a change): tests/sglang_host/test_sglang_rl_sync.py.

After the first request, each step is followed by the same request:

0. a session sending the k/v scale tensors only: taken (update 2);
1. ``update_weights_from_tensor`` without ``begin_weight_update``: SGLang 0.5.23 refuses it
   itself; nothing changes;
2. the served tensors zeroed (as a memory release would): the fingerprint shows it;
3. a session sending the model's weights only: the zeroed copies rewritten from kvscale's
   record, said once; the fingerprint is the trainer's again; the counter stays;
4. one copy (layer 1's ``k_scale_float``) set behind kvscale's back: the fingerprint shows it;
5. ``update_weights_from_disk`` with new scales: taken (update 3), every copy written;
6. a session whose scale tensors a trainer process broadcasts over gloo
   (``update_weights_from_distributed``): taken (update 4).
"""

from __future__ import annotations

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids

from kvscale_plugin.fingerprint import scale_fingerprint

SCALES_A = {0: (3.25, 2.5), 1: (4.75, 2.125)}
SCALES_B = {0: (1.5, 0.75), 1: (6.5, 5.25)}
SCALES_C = {0: (2.125, 1.25), 1: (0.625, 0.375)}


def scale_values(scales) -> dict[str, float]:
    out = {}
    for i, (k, v) in scales.items():
        out[f"model.layers.{i}.self_attn.k_scale"] = k
        out[f"model.layers.{i}.self_attn.v_scale"] = v
    return out


#: What a bf16 cache serves: 1.0 for every layer.
ONES = scale_fingerprint({n: torch.tensor(1.0) for n in scale_values(SCALES_A)})


@pytest.fixture(scope="module")
def checkpoints(tiny):
    a = tiny("sgl-rl-engine-a", family="llama", scales=SCALES_A, seed=0)
    b = tiny("sgl-rl-engine-b", family="llama", scales=SCALES_B, seed=1)
    return a, b


@pytest.fixture(scope="module")
def run(run_engine, checkpoints):
    a, b = checkpoints
    steps = [
        {"session_tensors": scale_values(SCALES_B)},
        {"tensors_without_session": scale_values(SCALES_A)},
        {"rpc": "kvscale_probe_zero_scales"},
        {"update_weights_from_tensor": str(a)},
        {
            "rpc": "kvscale_probe_set_copy",
            "params": {"layer_id": 1, "copy": "k_scale_float", "value": 9.0},
        },
        {"update_weights_from_disk": str(a)},
        {"distributed": scale_values(SCALES_C)},
    ]
    result = run_engine("rl-sync", a, list(reference_token_ids(a)), steps=steps, log_level="info")
    assert result.error is None, f"{result.error}\n{result.log[-4000:]}"
    assert len(result.result["steps"]) == len(steps), result.result
    return result


def raw(update) -> dict[int, dict[str, float]]:
    return {layer["layer_id"]: layer["kvscale_raw"] for layer in update["layers"].values()}


def stored(path) -> dict[int, dict[str, float]]:
    return {i: {"k_scale": s["k"], "v_scale": s["v"]} for i, s in read_stored_scales(path).items()}


def kvscale(run, step: int | None = None) -> dict:
    info = run.result["kvscale"] if step is None else run.result["steps"][step]["kvscale"]
    assert isinstance(info, dict), run.result
    return info


def test_the_fingerprint_comes_back_through_get_server_info(run):
    info = kvscale(run)
    assert info["fingerprint"] == ONES
    assert info["updates"] == 1 and info["consistent"] and info["layers"] == [0, 1], info
    assert (info["tp_rank"], info["tp_size"]) == (0, 1)


def test_a_scales_only_session_is_taken(run, checkpoints):
    _, b = checkpoints
    assert run.result["steps"][0]["answer"][0] is True, run.result["steps"][0]
    update = run.probe["updates"][0]
    assert update["method"] == "end_weight_update"
    assert raw(update) == stored(b)
    info = kvscale(run, 0)
    assert info["updates"] == 2 and info["fingerprint"] == ONES and info["consistent"], info


def test_update_weights_from_tensor_without_a_session_is_refused_by_sglang(run, checkpoints):
    _, b = checkpoints
    ok, message = run.result["steps"][1]["answer"]
    assert ok is False and "must run between" in message, message
    assert len(run.probe["updates"]) == 4  # steps 0, 3, 5, 6: nothing reached the runner
    assert kvscale(run, 1)["updates"] == 2
    assert raw(run.probe["updates"][1]) == stored(b)  # still b's at the next session


def test_zeroed_tensors_show_and_are_rewritten_by_a_weights_only_session(run, checkpoints):
    zeroed = kvscale(run, 2)
    assert not zeroed["consistent"] and zeroed["fingerprint"] != ONES, zeroed
    assert run.result["steps"][3]["answer"][0] is True
    after = kvscale(run, 3)
    assert after["consistent"] and after["fingerprint"] == ONES, after
    assert after["updates"] == 2  # no scales were sent
    # A bf16 cache is given 1.0 again by every cycle (the KV method writes it), before the
    # check: nothing is left for it to rewrite. (FP8, where the cycle keeps the scales in
    # force: the check rewrites them, said once, tests/sglang_host/test_sglang_rl_sync.py.)
    layers = run.probe["updates"][1]["layers"].values()
    assert {(x["k_scale"], x["v_scale"]) for x in layers} == {(1.0, 1.0)}


def test_one_copy_set_behind_kvscale_s_back_shows_and_the_next_update_writes_it(run, checkpoints):
    a, _ = checkpoints
    wrong = kvscale(run, 4)
    assert not wrong["consistent"] and wrong["fingerprint"] != ONES, wrong
    assert run.result["steps"][5]["answer"][0] is True
    update = run.probe["updates"][2]
    assert update["method"] == "update_weights_from_disk"
    assert raw(update) == stored(a)
    assert {x["k_scale_float"] for x in update["layers"].values()} == {1.0}
    info = kvscale(run, 5)
    assert info["consistent"] and info["fingerprint"] == ONES and info["updates"] == 3, info


def test_each_load_logs_the_fingerprint_and_the_counter(run):
    lines = [line for line in run.log.splitlines() if "KV scales in force have fingerprint" in line]
    assert len(lines) == 5, run.log[-4000:]
    session = "weight-update session"
    labels = ("start-up load", session, session, "update_weights_from_disk", session)
    for line, n, label in zip(lines, (1, 2, 2, 3, 4), labels, strict=True):
        assert f"kvscale: {label}: KV scales" in line, line
        assert f"fingerprint {ONES} (update {n}, 2 layers)" in line, line
    # That label comes from kvscale's hook on WeightUpdater.update_weights_from_disk, a
    # target the test probe plugin hooked first: SGLang's HookRegistry skips a target it
    # patched before, so it shows that kvscale's hook is applied on top (register_hooks).


def test_scales_through_update_weights_from_distributed_are_taken(run):
    ok, message = run.result["steps"][6]["answer"]
    assert ok is True, message
    update = run.probe["updates"][3]
    assert update["method"] == "end_weight_update"
    assert raw(update) == {i: {"k_scale": k, "v_scale": v} for i, (k, v) in SCALES_C.items()}
    info = kvscale(run, 6)
    assert info["updates"] == 4 and info["fingerprint"] == ONES and info["consistent"], info
