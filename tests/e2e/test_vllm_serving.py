"""Concurrent serving with data parallelism: the OpenAI server with ``--quantization
kvscale --data-parallel-size 2`` (two engine cores, vLLM's CPU build, multiprocessing)
on 127.0.0.1.

* Each data-parallel engine serves a fixed text (pinned with vLLM's
  ``X-data-parallel-rank`` header) with the teacher-forced logprobs of an in-process
  kvscale engine: both engine cores loaded the checkpoint's scales.
* A bounded burst (64 completions, 8 at a time, each with a timeout) all succeed with
  the requested token counts, and the fixed text's logprobs under that load stay within
  the noise measured on the idle server.

Only 127.0.0.1 traffic; every loop is bounded; the server stops by itself
(``_server.openai_server``: terminate, wait, kill).
"""

from __future__ import annotations

import random
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from _server import openai_server

from kvscale_plugin.demo.probe import teacher_forced_logprobs, vllm_engine
from kvscale_plugin.demo.tinymodels import reference_token_ids

pytestmark = pytest.mark.engine

BURST, CONCURRENCY, TIMEOUT_S = 64, 8, 120
IDLE_RUNS_PER_RANK = 3
DP = 2


def _max_dev(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def _served_per_engine(metrics: str) -> dict[str, float]:
    """Finished requests per engine (``vllm:request_success_total{engine=...}``)."""
    counts: dict[str, float] = {}
    for m in re.finditer(r"^vllm:request_success_total\{([^}]*)\} ([0-9.e+]+)$", metrics, re.M):
        engine = re.search(r'engine="(\d+)"', m[1])
        if engine:
            counts[engine[1]] = counts.get(engine[1], 0.0) + float(m[2])
    return counts


def test_data_parallel_server_takes_a_burst_within_idle_noise(tiny, tmp_path):
    ckpt = tiny("calibrated", num_layers=3)
    ids = list(reference_token_ids(ckpt))
    rng = random.Random(0)
    # Prompts of different lengths and token counts, so batches really mix.
    jobs = [
        (rng.sample(ids, rng.randint(4, len(ids) - 1)), rng.randint(1, 24)) for _ in range(BURST)
    ]

    env = {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # one NUMA node: engines share it
    with openai_server(
        ckpt, tmp_path, extra=["--data-parallel-size", str(DP)], env=env, ready_s=300
    ) as server:
        # Idle: the fixed text on each engine, repeatedly, then two at once (unpinned).
        per_rank = {
            r: [server.prompt_logprobs(ids, rank=r) for _ in range(IDLE_RUNS_PER_RANK)]
            for r in range(DP)
        }
        with ThreadPoolExecutor(2) as pool:
            pair = list(pool.map(lambda _: server.prompt_logprobs(ids), range(2)))
        idle = [run for runs in per_rank.values() for run in runs] + pair
        base = idle[0]
        idle_noise = max(_max_dev(run, base) for run in idle)

        def complete(job: tuple[list[int], int]) -> tuple[int, int, float]:
            prompt, n = job
            t0 = time.monotonic()
            answer = server.post(
                "/v1/completions",
                {
                    "model": server.model,
                    "prompt": prompt,
                    "max_tokens": n,
                    "temperature": 0.0,
                    "ignore_eos": True,
                    "return_token_ids": True,
                },
                timeout=TIMEOUT_S,
            )
            return n, len(answer["choices"][0]["token_ids"]), time.monotonic() - t0

        t0 = time.monotonic()
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            burst, loaded = [], []
            for i, job in enumerate(jobs):
                burst.append(pool.submit(complete, job))
                if i % 8 == 4:  # the fixed text queued among the burst, each engine in turn
                    rank = (i // 8) % DP
                    loaded.append(pool.submit(server.prompt_logprobs, ids, TIMEOUT_S, rank))
            results = [f.result(timeout=TIMEOUT_S * 4) for f in burst]
            under_load = [f.result(timeout=TIMEOUT_S * 4) for f in loaded]
        wall = time.monotonic() - t0
        served = _served_per_engine(server.get_text("/metrics"))

    # The same text on an in-process kvscale engine (TP=1, no DP).
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        in_process = teacher_forced_logprobs(llm, ids)

    assert len(results) == BURST
    for asked, got, _ in results:
        assert got == asked
    latencies = sorted(r[2] for r in results)
    load_dev = max(_max_dev(run, base) for run in under_load)
    rank_dev = {r: max(_max_dev(run, in_process) for run in runs) for r, runs in per_rank.items()}
    print(
        f"DP={DP} server: requests finished per engine {served}; each engine vs in-process "
        f"kvscale max |dlogprob| {rank_dev}; burst of {BURST}, {CONCURRENCY} at a time: "
        f"{wall:.1f} s wall, latency p50 {latencies[BURST // 2]:.2f} s / max "
        f"{latencies[-1]:.2f} s; idle noise {idle_noise:.2e} over {len(idle)} runs; under "
        f"load {load_dev:.2e} over {len(under_load)} runs"
    )
    # Both engine cores serve with the checkpoint's scales (scale 1.0 would be ~0.08 off).
    assert all(dev <= 1e-3 for dev in rank_dev.values()), rank_dev
    assert len(served) == DP and all(n > 0 for n in served.values()), served
    # Under load the fixed text shares batches with other requests: within the idle noise,
    # with a floor of 1e-3 (a bf16 logprob's last bits) when the idle server is bit-stable.
    assert load_dev <= max(2 * idle_noise, 1e-3), (idle_noise, load_dev)
