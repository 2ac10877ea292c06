"""RL scale syncs in every shape a loop runs the engine in (vLLM 0.32): one update path,
one decision told alike to every caller, no KV read under other scales.

* ``test_direct_calls_on_an_in_process_engine``: ``model.load_weights`` and
  ``worker.reload_weights`` called on the worker itself (no ``collective_rpc``): the next
  request finds nothing cached under the old scales; a reset that cannot run yet stays
  pending, no request reads the prefix cache meanwhile, and it is retried.
* ``test_spmd_external_launcher_tp2``: ``torchrun`` with two ranks, each its own engine
  (``external_launcher``), each calling its own ``model.load_weights``.
* ``test_pipeline_parallel_update_is_one_decision``: PP=2 in worker processes, one update
  with a corrupt tensor for a stage-0 layer and a valid one for a stage-1 layer.

FP8 branches run where this CPU runs vLLM's FP8 cache (AVX-512 / AMX); elsewhere the same
plumbing runs on a bf16 cache, whose layers apply no scales (nothing to refuse or reset).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from _run_script import HERE, run_script
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.engines import greedy_with_logprobs
from kvscale_testing.probe import vllm_engine
from kvscale_testing.server import free_port
from kvscale_testing.skips import CPU_FP8, KV_DTYPE, follows_cpu_fp8, needs_avx512_cpu_for_tp

from kvscale_plugin.hosts.vllm.live import worker_fingerprint

pytestmark = pytest.mark.engine

S1 = {0: (0.05, 0.04), 1: (0.06, 0.05)}
UNUSED_WARNING = "so these corrupt ones are not served"
S2 = {0: (0.5, 0.4), 1: (0.6, 0.5)}


def _tensors(scales: dict[int, tuple[float, float]]) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"model.layers.{i}.self_attn.{kind}", torch.tensor(value))
        for i, pair in scales.items()
        for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)
    ]


_generate = greedy_with_logprobs


@follows_cpu_fp8
def test_direct_calls_on_an_in_process_engine(tiny, kvscale_warnings, caplog):
    caplog.set_level(logging.INFO, logger="kvscale_plugin")
    a = tiny("rl-prefix-s1", scales=S1)
    prompt = (list(reference_token_ids(a)) * 4)[:100]
    with vllm_engine(a, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        worker = llm.llm_engine.model_executor.driver_worker.worker
        model = worker.model_runner.model
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        _, at_s1, _ = _generate(llm, prompt)
        _, _, cached = _generate(llm, prompt)
        assert cached >= 64, "the prompt's prefix is not cached: the test proves nothing"

        # A direct model.load_weights (no collective_rpc): taken, and on an FP8 cache the
        # next request reads nothing cached under s1.
        assert "model.layers.1.self_attn.attn.v_scale" in model.load_weights(_tensors(S2))
        _, at_s2, cached_s2 = _generate(llm, prompt)
        assert worker_fingerprint(worker)["updates"] == 2
        if CPU_FP8:
            assert cached_s2 == 0
            assert at_s2 != pytest.approx(at_s1, abs=1e-5)  # else the test could not fail
        else:
            assert cached_s2 == cached  # a bf16 cache applies no scales: nothing to reset
        _, _, cached = _generate(llm, prompt)
        assert cached >= 64

        # A direct worker.reload_weights back to s1: the same, and the log-probs are the
        # first (uncached) run's at s1 again.
        worker.reload_weights(weights_path=str(a), is_checkpoint_format=True)
        _, back, cached_back = _generate(llm, prompt)
        if CPU_FP8:
            assert cached_back == 0
        assert back == pytest.approx(at_s1, abs=1e-5)

        # A reset that cannot run yet (vLLM's fails while blocks are held, e.g. for a
        # remote decode side): pending, no request reads the prefix cache, retried.
        _, _, cached = _generate(llm, prompt)
        manager = scheduler.kv_cache_manager
        real, fails = manager.reset_prefix_cache, [2]

        def held() -> bool:
            if fails[0]:
                fails[0] -= 1
                return False
            return real()

        manager.reset_prefix_cache = held
        try:
            model.load_weights(_tensors(S2))
            _, pending_logprobs, cached_pending = _generate(llm, prompt)
            _, _, cached_retried = _generate(llm, prompt)
        finally:
            manager.reset_prefix_cache = real
    if CPU_FP8:
        assert fails == [0], "the reset was not retried"
        assert cached_pending == 0  # pending: the prefix cache is not read
        assert pending_logprobs == pytest.approx(at_s2, abs=1e-5)
        assert kvscale_warnings("could not be reset yet")
        assert "(it was pending)" in caplog.text
        assert cached_retried == 0  # the retried reset dropped what was cached before it
    else:
        assert fails == [2]  # nothing changed what the cache is written with
        assert cached_pending == cached_retried == cached
    assert not kvscale_warnings("could not tell whether the KV scales in force changed")


@follows_cpu_fp8
@needs_avx512_cpu_for_tp
def test_spmd_external_launcher_tp2(tiny, tmp_path):
    ckpt = tiny("rl-prefix-s1", scales=S1)
    prompt = (list(reference_token_ids(ckpt)) * 4)[:100]
    env = {**os.environ, "TMPDIR": str(tmp_path), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            str(HERE / "_spmd_sync.py"),
            str(ckpt),
            KV_DTYPE,
            str(tmp_path),
            ",".join(map(str, prompt)),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    files = [tmp_path / f"rank{r}.json" for r in (0, 1)]
    assert proc.returncode == 0 and all(f.exists() for f in files), (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )
    ranks = [json.loads(f.read_text()) for f in files]
    log = proc.stdout + proc.stderr
    for r in ranks:
        assert r["s1_again"]["cached"] >= 64, "no prefix cached: the test proves nothing"
        assert (
            r["to_s2"]["refused"] is None
            and "model.layers.0.self_attn.attn.k_scale" in (r["to_s2"]["names"])
        )
        assert r["fp_s2"]["updates"] == 2 and r["fp_s2"]["tp_size"] == 2
        if CPU_FP8:
            # No cached block read under other scales, on either rank.
            assert r["s2"]["cached"] == 0 and r["s1_back"]["cached"] == 0
            assert r["s2"]["logprobs"] != pytest.approx(r["s1"]["logprobs"], abs=1e-5)
            assert r["s1_back"]["logprobs"] == pytest.approx(r["s1"]["logprobs"], abs=1e-5)
            # One decision: both ranks refuse the corrupt update, naming the tensor, and
            # keep what they served.
            assert "model.layers.0.self_attn.k_scale: NaN" in r["corrupt"]["refused"]
            assert r["fp_after_corrupt"]["fingerprint"] != r["fp_s2"]["fingerprint"]
            assert r["fp_after_corrupt"]["updates"] == 3
            assert r["after_corrupt"]["cached"] >= 64  # nothing changed: nothing reset
        else:
            assert r["s2"]["cached"] >= 64  # bf16: no scale applied, no reset needed
            assert r["corrupt"]["refused"] is None  # bf16: warned on both ranks alike
    assert [r["fp_after_corrupt"]["tp_rank"] for r in ranks] == [0, 1]
    assert ranks[0]["s1_back"]["tokens"] == ranks[1]["s1_back"]["tokens"]
    if not CPU_FP8:
        assert log.count(UNUSED_WARNING) == 2  # each rank warned, once


@follows_cpu_fp8
def test_pipeline_parallel_update_is_one_decision(tiny, tmp_path):
    ckpt = tiny("rl-start", scales={0: (3.5, 2.25), 1: (4.75, 2.5)})
    output: list[str] = []
    r = run_script(
        HERE / "_pp_sync.py", str(ckpt), KV_DTYPE, tmp_path=tmp_path, timeout=400, output=output
    )
    log = "\n".join(output)
    assert [fp["pp_rank"] for fp in r["start"]] == [0, 1]
    assert "name no attention layer" not in log  # the other stage's names are not warned
    if CPU_FP8:
        # Refused as a whole: stage 1 did not take its valid tensor either, and the caller
        # was told (every rank raised; every answer read: the next call reads its own).
        assert r["refused"] is not None and "model.layers.0.self_attn.k_scale: NaN" in r["refused"]
        assert r["after_refused"] == r["start"]
    else:
        assert r["refused"] is None
    # A valid update across both stages: each takes its own layer's.
    # (bf16: the corrupt call was warned about and taken, so it counted on both stages)
    assert [fp["updates"] for fp in r["after_valid"]] == ([2, 2] if CPU_FP8 else [3, 3])
    if CPU_FP8:
        for after, start in zip(r["after_valid"], r["start"], strict=True):
            assert after["fingerprint"] != start["fingerprint"]
    # Callable by name through kvscale's worker extension, on every stage.
    assert r["by_name"] == r["after_valid"]
    assert r["check_by_name"] == [[], []]
