"""RL weight syncs on vLLM 0.32 (issue: scales through every sync path, served copies
checked, no KV read under other scales, a fingerprint): ``hosts/vllm/live.py``.

* ``test_scales_through_model_load_weights_on_an_fp8_model``: a real vLLM model of a
  ``-q kvscale`` engine with an FP8 cache (built without an engine, so it runs on every
  CPU: ``_fp8_model_sync.py``) and the calls a trainer makes through
  ``collective_rpc`` -> ``model.load_weights``.
* The engine tests run a real in-process engine on ``KV_DTYPE`` (FP8 where this CPU runs
  one; else bf16, whose layers serve 1.0 and are fingerprinted as such).
"""

from __future__ import annotations

import pytest
import torch
from _run_script import HERE, run_script
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.engines import attention_layers, greedy_with_logprobs, reload_weights
from kvscale_testing.probe import layer_scales, vllm_engine
from kvscale_testing.skips import CPU_FP8, KV_DTYPE, follows_cpu_fp8

from kvscale_plugin.fingerprint import scale_fingerprint
from kvscale_plugin.hosts.vllm.live import worker_check, worker_fingerprint
from kvscale_plugin.scales import CorruptScaleError

pytestmark = pytest.mark.engine

START = {0: (3.5, 2.25), 1: (4.75, 2.5)}


def _pairs(h: dict) -> dict[int, tuple[float, float]]:
    """layer -> (k, v), after checking every copy agrees with the device tensors."""
    out = {}
    for i, s in h.items():
        assert (s["k"], s["v"]) == (s["k_float"], s["v_float"]) == (s["k_cpu"], s["v_cpu"]), s
        out[int(i)] = (s["k"], s["v"])
    return out


@pytest.mark.parametrize("placeholders", ["dropped", "kept"])
def test_scales_through_model_load_weights_on_an_fp8_model(tiny, tmp_path, placeholders):
    """``kept``: the KV method keeps its placeholders after loading (vLLM >= 0.34): a bare
    call is still an update, since whether vLLM's own load runs is the load cycle's state."""
    ckpt = tiny("rl-start", scales=START)
    output: list[str] = []
    extra = ["keep"] if placeholders == "kept" else []
    r = run_script(HERE / "_fp8_model_sync.py", str(ckpt), *extra, tmp_path=tmp_path, output=output)
    log = "\n".join(output)
    if placeholders == "kept":
        assert "model.layers.0.self_attn.attn.k_scale" in r["placeholders"]
    new = {0: (6.0, 7.0), 1: (8.0, 9.0)}

    # Start-up: the fingerprint of the served copies is the trainer's of the same tensors.
    assert _pairs(r["start"]["held"]) == START
    assert r["start"]["fingerprint"] == r["start"]["trainer"]
    assert r["start"]["updates"] == 1

    # A scales-only update of every layer: taken in place, returned as loaded, counted.
    assert _pairs(r["all"]["held"]) == new
    assert r["all"]["names"] == [
        f"model.layers.{i}.self_attn.attn.{k}" for i in (0, 1) for k in ("k_scale", "v_scale")
    ]
    assert r["all"]["fingerprint"] == r["all"]["trainer"] != r["start"]["fingerprint"]
    assert r["all"]["updates"] == 2
    print(f"scales-only update through model.load_weights: {r['all']['ms']:.2f} ms")

    # Buckets: k's first (v's stay), then v's.
    assert _pairs(r["k_bucket"]["held"]) == {0: (5.0, 7.0), 1: (6.5, 9.0)}
    assert _pairs(r["v_bucket"]["held"]) == {0: (5.0, 5.5), 1: (6.5, 7.5)}
    assert r["v_bucket"]["fingerprint"] == r["v_bucket"]["trainer"]
    assert r["v_bucket"]["updates"] == 4

    # One layer, one scale (k_proj naming): the rest keep theirs, and the line says so.
    assert _pairs(r["partial"]["held"]) == {0: (5.0, 5.5), 1: (3.25, 7.5)}
    assert "1 of 2 attention layers taken (1 serve them); the other 1 keep theirs" in log
    # The legacy single kv_scale sets k and v.
    assert _pairs(r["legacy"]["held"]) == {0: (2.75, 2.75), 1: (3.25, 7.5)}

    # Weights and scales in one call: the weight loaded by the model, the scales by kvscale.
    assert r["mixed"]["embed_loaded"]
    assert "model.embed_tokens.weight" in r["mixed"]["names"]
    assert _pairs(r["mixed"]["held"]) == new
    assert r["mixed"]["updates"] == 7

    # Corrupt scales: every one named, none taken (not even the good one), not counted.
    refused = r["corrupt"]["refused"]
    assert refused is not None
    assert "model.layers.0.self_attn.k_scale: NaN" in refused
    assert "model.layers.1.self_attn.v_proj.v_scale: 0" in refused
    assert "No scale of the call was taken" in refused
    assert _pairs(r["corrupt"]["held"]) == new
    assert r["corrupt"]["updates"] == 7

    # A scale for a layer the model lacks: dropped, named once; the others taken.
    assert "model.layers.7.self_attn.k_scale" in log and "were dropped from the update" in log
    assert r["nowhere"]["updates"] == 8

    # Served memory cleared (as vLLM's sleep level 2 leaves it): the fingerprint shows it;
    # the next weights-only update rewrites every copy and says so.
    assert r["cleared"]["fingerprint"] != r["nowhere"]["fingerprint"]
    assert _pairs(r["after_clear"]["held"]) == new
    assert r["after_clear"]["fingerprint"] == r["after_clear"]["trainer"]
    assert r["after_clear"]["updates"] == 8  # a weights-only update takes no scale
    assert "6 served KV-scale copies did not hold the scales in force" in log

    # One copy set behind kvscale's back: the fingerprint changes (and says inconsistent);
    # the next update puts it right.
    assert not r["one_copy"]["consistent"]
    assert r["one_copy"]["fingerprint"] != r["after_clear"]["fingerprint"]
    assert r["after_one_copy"]["fingerprint"] == r["after_clear"]["fingerprint"]
    assert "model.layers.0.self_attn.attn._v_scale held 11, in force 7" in log

    # What the engine core compares to decide a prefix-cache reset: it changes with the
    # scales an FP8 cache is written with, and not with a weights-only update.
    epochs = r["epochs"]
    assert [entry[0] for entry in epochs["start"]] == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]
    assert epochs["all"] != epochs["start"]
    assert epochs["weights_only"] == epochs["before_weights_only"]


def _sent(scales: dict[int, tuple[float, float]]) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"model.layers.{i}.self_attn.{name}", torch.tensor(value))
        for i, pair in scales.items()
        for name, value in zip(("k_scale", "v_scale"), pair, strict=True)
    ]


def _load(scales: dict[int, tuple[float, float]]):
    tensors = _sent(scales)

    def load(worker):
        return sorted(worker.model_runner.get_model().load_weights(tensors))

    return load


def _served(scales: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
    """What a ``KV_DTYPE`` engine serves for ``scales``: them (FP8), or 1.0 (bf16)."""
    return scales if CPU_FP8 else {i: (1.0, 1.0) for i in scales}


@follows_cpu_fp8
def test_engine_sync_paths_fingerprint_and_served_copies(tiny, kvscale_warnings):
    start = tiny("rl-start", scales=START)
    weights_only = tiny("rl-weights-only", write_scales=False)
    new = {0: (6.0, 7.0), 1: (8.0, 9.0)}
    with vllm_engine(start, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        [first] = llm.collective_rpc(worker_fingerprint)
        assert first["updates"] == 1 and first["consistent"]
        assert first["fingerprint"] == scale_fingerprint(_sent(_served(START)))
        assert (first["tp_rank"], first["tp_size"], first["pp_rank"]) == (0, 1, 0)

        # collective_rpc -> model.load_weights (verl, NeMo-RL): the scales are taken.
        [names] = llm.collective_rpc(_load(new))
        assert "model.layers.1.self_attn.attn.v_scale" in names
        [after] = llm.collective_rpc(worker_fingerprint)
        assert after["updates"] == 2
        assert after["fingerprint"] == scale_fingerprint(_sent(_served(new)))
        # The trainer's side of the same, from what it sent and the engine's "applied"
        # (False on a bf16 cache, which serves every scale as 1.0).
        assert after["applied"] is CPU_FP8
        assert after["fingerprint"] == scale_fingerprint(_sent(new), applied=after["applied"])
        held = {int(n.split(".")[2]): (s.k, s.v) for n, s in layer_scales(llm).items()}
        assert held == _served(new)

        # A corrupt one is refused through collective_rpc, naming the tensor (FP8); a bf16
        # cache uses no scales: the load cycle's rule warns, naming it, and serves nothing
        # new (counted as an update, as a bf16 reload is).
        if CPU_FP8:
            with pytest.raises(CorruptScaleError, match=r"model\.layers\.0\.self_attn\.k_scale"):
                llm.collective_rpc(_load({0: (float("inf"), 2.0)}))
            assert llm.collective_rpc(worker_fingerprint)[0] == after
        else:
            llm.collective_rpc(_load({0: (float("inf"), 2.0)}))
            assert kvscale_warnings("model.layers.0.self_attn.k_scale: inf")
            warned = llm.collective_rpc(worker_fingerprint)[0]
            assert warned["fingerprint"] == after["fingerprint"]
            after = {**after, "updates": 3}
            assert warned == after

        # Served memory cleared as by sleep level 2, then a weights-only reload_weights:
        # the worker's check rewrites every copy and warns once.
        for layer in llm.llm_engine.vllm_config.compilation_config.static_forward_context.values():
            if hasattr(layer, "_k_scale"):
                layer._k_scale.zero_()
                layer._v_scale.zero_()
        assert llm.collective_rpc(worker_fingerprint)[0]["fingerprint"] != after["fingerprint"]
        reload_weights(llm, weights_only)
        assert kvscale_warnings("did not hold the scales in force"), "no rewrite said"
        restored = llm.collective_rpc(worker_fingerprint)[0]
        assert restored["fingerprint"] == after["fingerprint"]
        assert restored["updates"] == after["updates"]

        # Cleared again, then checked on demand (what a caller runs after wake_up).
        layer0 = attention_layers(llm)["model.layers.0.self_attn.attn"]
        layer0._k_scale.zero_()
        assert llm.collective_rpc(worker_check) == [["model.layers.0.self_attn.attn._k_scale"]]
        assert llm.collective_rpc(worker_fingerprint)[0] == restored
        assert llm.collective_rpc(worker_check) == [[]]

        # reload_weights with scales counts as an update.
        reload_weights(llm, start)
        final = llm.collective_rpc(worker_fingerprint)[0]
        assert final["updates"] == after["updates"] + 1
        assert final["fingerprint"] == first["fingerprint"]
    assert not kvscale_warnings("could not tell whether the KV scales in force changed")
    assert not kvscale_warnings("the check of the served KV scales failed")


_generate = greedy_with_logprobs


@follows_cpu_fp8
def test_no_cached_kv_is_read_under_other_scales(tiny, kvscale_warnings):
    """A prefix cached at s1, a scales-only update to s2 through collective_rpc, the same
    prompt again: with an FP8 cache, the prefix cache was reset (no cached token) and the
    generated tokens' log-probs equal a fresh engine's at s2. With a bf16 cache the scales
    write nothing: the prefix cache is kept (no needless recompute)."""
    s1 = {0: (0.05, 0.04), 1: (0.06, 0.05)}
    s2 = {0: (0.5, 0.4), 1: (0.6, 0.5)}
    a = tiny("rl-prefix-s1", scales=s1)
    b = tiny("rl-prefix-s2", scales=s2)
    prompt = (list(reference_token_ids(a)) * 4)[:100]
    with vllm_engine(b, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as fresh:
        want_tokens, want_logprobs, _ = _generate(fresh, prompt)
    with vllm_engine(a, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        _, before, _ = _generate(llm, prompt)
        _, _, cached = _generate(llm, prompt)
        assert cached >= 64, "the prompt's prefix is not cached: the test proves nothing"
        llm.collective_rpc(_load(s2))
        tokens, logprobs, cached_after = _generate(llm, prompt)
        if not CPU_FP8:
            # The reset half on its own, on this engine's real scheduler: the engine core
            # is told the workers' scales were different before this call (what an FP8
            # engine's update makes true), and the next request finds nothing cached.
            core = llm.llm_engine.engine_core.engine_core
            assert hasattr(core, "_kvscale_scale_epoch")  # the wrapper ran on each call
            # (one entry per worker: what its FP8 layers were written with)
            core._kvscale_scale_epoch = ((("model.layers.0.self_attn.attn", (0.5,), (0.5,)),),)
            llm.collective_rpc(worker_fingerprint)
            forced_tokens, _, forced_cached = _generate(llm, prompt)
            assert forced_cached == 0 and forced_tokens == tokens
    assert not kvscale_warnings("could not tell whether the KV scales in force changed")
    if CPU_FP8:
        # s1 and s2 give different log-probs (else the test could not fail).
        assert before != pytest.approx(want_logprobs, abs=1e-5)
        assert cached_after == 0
        assert tokens == want_tokens
        assert logprobs == pytest.approx(want_logprobs, abs=1e-5)
    else:
        assert cached_after == cached
        assert tokens == want_tokens


@follows_cpu_fp8
def test_tensor_parallel_sync_through_worker_processes(tiny, tmp_path):
    """TP=2 in vLLM's multiprocessing mode: the update function and its tensors reach every
    worker process, each rank takes the scales and reports its own fingerprint, which equals
    the trainer's for that rank; a corrupt update is refused (vLLM's multiprocess executor
    hands the caller a plain ``Exception`` carrying kvscale's message)."""
    ckpt = tiny("rl-start", scales=START)
    bad = tiny("rl-reload-nan", scales={0: (float("nan"), 2.0), 1: (4.75, 2.5)})
    r = run_script(
        HERE / "_multiproc_sync.py",
        str(ckpt),
        "2",
        KV_DTYPE,
        str(bad),
        tmp_path=tmp_path,
        timeout=400,
    )
    new = {0: (6.0, 7.0), 1: (8.0, 9.0)}
    assert [fp["tp_rank"] for fp in r["start"]] == [0, 1]
    for rank, (start, after, refused) in enumerate(
        zip(r["start"], r["after"], r["after_refused"], strict=True)
    ):
        assert start["updates"] == 1 and start["tp_size"] == 2
        want = scale_fingerprint(_sent(_served(START)), tp_rank=rank, tp_size=2)
        assert start["fingerprint"] == want
        assert after["updates"] == 2
        assert after["fingerprint"] == scale_fingerprint(
            _sent(_served(new)), tp_rank=rank, tp_size=2
        )
        if CPU_FP8:
            assert refused == after  # nothing taken, and every rank's answer read in order
        else:  # bf16: warned on every rank, nothing served changed, counted
            assert refused == {**after, "updates": 3}
    assert all("model.layers.1.self_attn.attn.v_scale" in names for names in r["names"])
    if CPU_FP8:  # every rank raised; the caller reads one refusal, the next call its own
        assert r["refused"] is not None
        assert "model.layers.1.self_attn.v_scale: NaN" in r["refused"]
        # A refused reload_weights (TP=2): the same, every rank keeps what it served.
        assert "model.layers.0.self_attn.k_scale: NaN" in r["reload_refused"]
        assert r["after_reload_refused"] == r["after_refused"]
    else:
        assert r["refused"] is None
        assert r["reload_refused"] is None  # bf16: warned, the reload's weights taken
    print(f"TP=2 scales-only update through collective_rpc: {r['ms']:.1f} ms")
