"""Two-node vLLM engines on 127.0.0.1, launched as users launch them on two machines
(vLLM's multi-node mode without Ray: node 0 the leader, node 1 ``vllm serve --headless``),
each node a fresh process tree with its own plugin discovery.

* every rank of both nodes serves with kvscale and holds the checkpoint's scales, and
  generates what the same engine generates on one node (tokens and logprobs);
* a node that serves without kvscale (plugin not loaded there, no ``-q kvscale``) makes
  the engine refuse to start, naming its rank -- instead of silently mixing stock's and
  kvscale's cache writes across ranks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _server import PORT_ATTEMPTS, free_port, lost_port_race
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.probe import layer_index
from kvscale_testing.skips import KV_DTYPE, follows_cpu_fp8, needs_avx512_cpu_for_tp
from kvscale_testing.tinymodels import TinySpec, build_tiny_checkpoint

from kvscale_plugin.hosts.vllm.deployment import ENV_TIMEOUT

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent
SCRIPT = str(HERE / "_two_node.py")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    # Two KV heads: one per tensor-parallel rank.
    spec = TinySpec(num_layers=2, num_kv_heads=2)
    return build_tiny_checkpoint(tmp_path_factory.mktemp("two-node") / "tiny", spec)


def _env(tmp_path: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(tmp_path), "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env.update(extra or {})
    return env


def _two_nodes(
    tmp_path: Path,
    model: Path,
    parallel: str,
    kv_dtype: str,
    *,
    node1_quant: str = "kvscale",
    node1_env: dict[str, str] | None = None,
    leader_env: dict[str, str] | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess[str]:
    """Start node 1 (headless), then run node 0 (the leader) to its end; node 1 is torn
    down either way. Retried when a port was taken between choosing and binding."""
    ids = json.dumps(list(reference_token_ids(model))[:12])
    for _ in range(PORT_ATTEMPTS):
        port = str(free_port())
        log = (tmp_path / f"node1-{port}.log").open("w")
        node1 = subprocess.Popen(
            [sys.executable, SCRIPT, "headless", str(model), port, parallel, node1_quant, kv_dtype],
            env=_env(tmp_path, node1_env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        # Output to files, not pipes: the leader's engine core and workers outlive it in
        # multi-node mode and would hold a pipe open until they are killed.
        out_path, err_path = tmp_path / f"node0-{port}.out", tmp_path / f"node0-{port}.err"
        with out_path.open("w") as out, err_path.open("w") as err:
            node0 = subprocess.Popen(
                [
                    sys.executable,
                    SCRIPT,
                    "leader",
                    str(model),
                    ids,
                    port,
                    parallel,
                    "kvscale",
                    kv_dtype,
                ],
                env=_env(tmp_path, leader_env),
                stdout=out,
                stderr=err,
                text=True,
                start_new_session=True,
            )
            try:
                node0.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                err.write(f"\n[leader killed after {timeout} s]")
            finally:
                # Each node's whole process tree (engine core, workers), whatever happened.
                _end(node0)
                _end(node1)
                log.close()
        leader = subprocess.CompletedProcess(
            node0.args, node0.returncode, out_path.read_text(), err_path.read_text()
        )
        node1_log = (tmp_path / f"node1-{port}.log").read_text()
        leader.node1_log = node1_log  # type: ignore[attr-defined]
        if leader.returncode == 0 or not lost_port_race(leader.stdout + leader.stderr + node1_log):
            return leader
    return leader


def _one_node(tmp_path: Path, model: Path, parallel: str, kv_dtype: str) -> dict:
    """The same engine (TP=2 or PP=2, kvscale) on one node: the reference. Output to files
    and the whole process tree killed afterwards (its engine core and workers outlive the
    script's ``os._exit``)."""
    ids = json.dumps(list(reference_token_ids(model))[:12])
    out_path, err_path = tmp_path / "single.out", tmp_path / "single.err"
    with out_path.open("w") as out, err_path.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "single", str(model), ids, parallel, "kvscale", kv_dtype],
            env=_env(tmp_path),
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            err.write("\n[single-node run killed after 600 s]")
        finally:
            _end(proc)
    done = subprocess.CompletedProcess(
        proc.args, proc.returncode, out_path.read_text(), err_path.read_text()
    )
    done.node1_log = ""  # type: ignore[attr-defined]
    return _result(done)


def _end(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    proc.wait(30)


def _result(proc: subprocess.CompletedProcess[str]) -> dict:
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"leader exit {proc.returncode}\nstdout: {proc.stdout[-1500:]}\n"
        f"stderr: {proc.stderr[-4000:]}\nnode 1: {proc.node1_log[-3000:]}"  # type: ignore[attr-defined]
    )
    return json.loads(lines[-1][len("RESULT ") :])


#: The TP case's cache: FP8 (the scheme's, kvscale's write) where vLLM's CPU attention runs
#: one (AVX-512 / AMX), else bf16 (``KV_DTYPE``) -- chosen when the tests are collected, not
#: skipped. Two nodes with TP and a bf16 cache proves nothing the FP8 case does not (the
#: same ranks, the same deployment check; the FP8 case also reads each rank's scales), and
#: each case costs about eight fresh vLLM processes.
TP_KV_DTYPE = KV_DTYPE


@pytest.mark.parametrize(
    ("parallel", "kv_dtype"),
    [
        pytest.param("tp", TP_KV_DTYPE, marks=[needs_avx512_cpu_for_tp, follows_cpu_fp8]),
        ("pp", "bfloat16"),
    ],
)
def test_every_rank_of_both_nodes_serves_with_kvscale(tiny, tmp_path, parallel, kv_dtype):
    """TP=2 (one rank per node, each with its KV head) and PP=2 (one stage per node): the
    deployment check passes on both nodes and the engine generates what the same engine
    generates on one node; with the FP8 cache the scheme gives, every rank of both nodes
    holds the checkpoint's k/v scales."""
    result = _result(_two_nodes(tmp_path, tiny, parallel, kv_dtype))
    assert len(result["tokens"]) == 8
    reference = _one_node(tmp_path, tiny, parallel, kv_dtype)
    gap = max(abs(a - b) for a, b in zip(result["logprobs"], reference["logprobs"], strict=True))
    print(f"two nodes vs one node ({parallel}, {kv_dtype}): max |dlogprob| {gap:.3g}")
    assert result["tokens"] == reference["tokens"]
    assert gap <= 1e-4, (result["logprobs"], reference["logprobs"])
    ranks = result["scales"]
    assert len(ranks) == 2 if parallel == "tp" else len(ranks) >= 1
    if kv_dtype == "auto":
        stored = read_stored_scales(tiny)
        for held in ranks:
            assert len(held) == len(stored), held
            for name, (k, v) in held.items():
                i = layer_index(name)
                assert (k, v) == pytest.approx((stored[i]["k"], stored[i]["v"]), rel=1e-6), name


def test_a_node_without_kvscale_is_refused_naming_its_rank(tiny, tmp_path):
    """Node 1 without the plugin (``VLLM_PLUGINS=""``: none loaded) and without
    ``-q kvscale``, as a forgotten install looks: its rank would serve stock's KV method.
    Node 0 stops the start with kvscale's error naming rank 1."""
    proc = _two_nodes(
        tmp_path,
        tiny,
        "tp",
        "bfloat16",
        node1_quant="none",
        node1_env={"VLLM_PLUGINS": ""},
        leader_env={ENV_TIMEOUT: "20"},
    )
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "DeploymentError" in out, out[-4000:]
    assert "rank(s) 1 of 2 did not report kvscale within 20 s" in out, out[-4000:]
