"""The compat suite: kvscale on whichever vLLM this venv has (0.30.0 / 0.31.0 in their own
venvs, ``make test-compat``; 0.32.0 in .venv with the rest of the suite).

What a user of any supported release must get: (a) every stock start works exactly as
before with kvscale installed -- tokens' logprobs bit-identical to a run with plugins
disabled, ``--help`` parses; (b) ``--quantization kvscale`` serves the checkpoint's scales
(per tensor and per head), reloads them, refuses a corrupt reload; (c) ``kvscale inspect``
reports against this vLLM; (d) every feature of the checked list holds here.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvscale_testing.checkpoints import read_stored_scales
from kvscale_testing.engines import cpu_runs_fp8_cache, reload_weights
from kvscale_testing.probe import (
    FP8_CPU_REFUSAL,
    layer_index,
    layer_scales,
    vllm_engine,
)
from kvscale_testing.skips import KV_DTYPE, follows_cpu_fp8, needs_fp8_cpu_cache

from kvscale_plugin.hosts.vllm import internals
from kvscale_plugin.scales import CorruptScaleError
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine
HERE = Path(__file__).parent
PER_HEAD = {**FP8_KV_SCHEME, "strategy": "attn_head"}
#: A plain bf16 model: no quantization_config, no scale tensors.
PLAIN = {"quantization_config": False, "kv_cache_scheme": None, "write_scales": False}


def vllm_version() -> str:
    import vllm

    from kvscale_plugin.hosts._common import base_version

    return base_version(vllm.__version__)


#: vLLM's CPU attention runs an FP8 cache only with AVX-512 or AMX; it refuses one
#: elsewhere, after the model (and its KV scales) loaded.
CPU_FP8 = cpu_runs_fp8_cache()
FP8_REFUSED = FP8_CPU_REFUSAL
#: Where it does not, ``-q kvscale`` with ``auto`` serves a bf16 cache (kvscale's degrade);
#: these starts ask for ``fp8`` there, so that each one's loaded scales are still read back
#: (vLLM refuses the cache after loading).
KVSCALE_KV_DTYPE = "auto" if CPU_FP8 else "fp8"


def assert_started_or_refused_fp8(result: dict[str, Any]) -> None:
    """The engine started, or -- only on a CPU without AVX-512 / AMX -- vLLM refused its
    FP8 cache after loading (the scales it loaded are in ``result`` either way)."""
    if CPU_FP8 or result["error"] is None:
        assert result["started"] and result["error"] is None, result
    else:
        assert FP8_REFUSED in result["error"], result


def probes(
    tmp_path: Path, runs: list[dict[str, Any]], env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """``_probe.py`` in one fresh interpreter (plugins are loaded once per process): its
    engines one after another, a result for each."""
    full_env = {**os.environ, "TMPDIR": str(tmp_path), **(env or {})}
    proc = subprocess.run(
        [sys.executable, str(HERE / "_probe.py"), json.dumps(runs)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == len(runs), (
        proc.returncode,
        proc.stdout[-3000:],
        proc.stderr[-5000:],
    )
    return [json.loads(line[len("RESULT ") :]) for line in lines]


def probe(tmp_path: Path, env: dict[str, str] | None = None, **args: Any) -> dict[str, Any]:
    """One engine in a fresh interpreter."""
    return probes(tmp_path, [args], env)[0]


# ---------------------------------------------------------------- (a) stock starts unchanged


STOCK_CASES = {
    "plain": (PLAIN, "auto"),
    # A compressed-tensors checkpoint with k/v scales, FP8 cache, no -q kvscale.
    "ct-fp8": ({}, "fp8"),
}
#: The ``-q kvscale`` starts (b) reads: checkpoint name -> TinySpec fields.
KVSCALE_CASES = {
    "default": {},
    "compat-calibrated": {"num_layers": 3},
    "compat-per-head": {
        "num_layers": 3,
        "per_head": True,
        "kv_cache_scheme": PER_HEAD,
        "head_boost": (1.0, 3.0),
    },
}


@pytest.fixture(scope="module")
def started(tiny, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """Every engine (a) and (b) read, started in two fresh interpreters (not one each):
    with plugins, the stock starts first -- while kvscale has activated nothing in that
    process -- then the ``-q kvscale`` ones; without plugins (``VLLM_PLUGINS=""``), the
    stock starts again. Keys: ``stock:<case>``, ``bare:<case>``, ``kvscale:<checkpoint>``."""
    tmp = tmp_path_factory.mktemp("compat-probes")
    stock = [
        {"model": str(tiny(f"compat-{name}", **fields)), "kv_cache_dtype": kv}
        for name, (fields, kv) in STOCK_CASES.items()
    ]
    ours = [
        {"model": str(tiny(name, **fields)), "quantization": "kvscale", "kv_cache_dtype": kv}
        for name, fields in KVSCALE_CASES.items()
        for kv in [KVSCALE_KV_DTYPE]
    ]
    with_plugin = probes(tmp, stock + ours)
    bare = probes(tmp, stock, env={"VLLM_PLUGINS": ""})
    out: dict[str, dict[str, Any]] = {}
    for name, result in zip(STOCK_CASES, with_plugin[: len(stock)], strict=True):
        out[f"stock:{name}"] = result
    for name, result in zip(STOCK_CASES, bare, strict=True):
        out[f"bare:{name}"] = result
    for name, result in zip(KVSCALE_CASES, with_plugin[len(stock) :], strict=True):
        out[f"kvscale:{name}"] = result
    return out


@follows_cpu_fp8
@pytest.mark.slow
@pytest.mark.parametrize("case", list(STOCK_CASES))
def test_stock_start_is_unchanged_with_kvscale_installed(started, case):
    with_plugin, without = started[f"stock:{case}"], started[f"bare:{case}"]
    assert with_plugin["kvscale_known"] and not without["kvscale_known"]
    # Registered, and nothing else: no feature activated, no vLLM place patched.
    assert with_plugin["installed"] == ["scales"], with_plugin
    assert with_plugin["patched"] == [], with_plugin["patched"]
    # Exactly as before: the same outcome and numbers, bit for bit, and nothing said.
    if STOCK_CASES[case][1] == "fp8":
        assert_started_or_refused_fp8(without)
    else:
        assert without["started"] and without["error"] is None, without
    assert (with_plugin["started"], with_plugin["error"]) == (without["started"], without["error"])
    assert with_plugin.get("logprobs") == without.get("logprobs")
    assert with_plugin["scales"] == without["scales"]
    assert with_plugin["warnings"] == [], with_plugin["warnings"]


HELP = """
import runpy, sys
from kvscale_plugin.hosts.vllm.process import HOST
sys.argv = ["api_server", "--help=quantization"]
try:
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
except SystemExit as exc:
    print("EXIT", exc.code, "INSTALLED", ",".join(sorted(HOST.installed)))
"""


@pytest.mark.slow
def test_cli_help_parses_with_kvscale_installed(tmp_path):
    """vLLM loads general plugins while it parses its command line: a plugin that raises
    there breaks even ``--help``. Here kvscale registers during parsing (the method only:
    no feature activates in a process that builds no kvscale engine) and help prints."""
    proc = subprocess.run(
        [sys.executable, "-c", HELP],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--quantization QUANTIZATION" in proc.stdout, proc.stdout[-2000:]
    assert "EXIT 0 INSTALLED scales\n" in proc.stdout, proc.stdout[-2000:]


# ---------------------------------------------------------------- (b) -q kvscale serves scales


@follows_cpu_fp8
def test_every_listed_feature_holds_on_this_release(started):
    result = started["kvscale:default"]
    assert_started_or_refused_fp8(result)
    assert set(result["installed"]) == set(internals.FEATURES), result
    # One warning may be the CPU's, not the release's: on a CPU with AMX, vLLM picks its AMX
    # cache layout for a bf16 model, which kvscale's CPU write does not handle (yet).
    amx = "uses the 'amx' cache layout here"
    said = [w for w in result["warnings"] if "kvscale" in w and amx not in w]
    assert said == [], result["warnings"]
    # The places a kvscale engine patches (in-process: this process is its worker), each in
    # the checked list with its reason. Not counted: the data-parallel client's method
    # (``dp-answers``), which this process holds as the front end but only a data-parallel
    # deployment runs.
    listed = {i.target for i in internals.PATCHED}
    front_end = {i.target for i in internals.PATCHED if i.feature == "dp-answers"}
    engine = [p for p in result["patched"] if p not in front_end]
    assert 0 < len(engine) <= 6, result["patched"]
    assert {p.removesuffix("['kvscale']") for p in result["patched"]} <= listed, result["patched"]
    report = internals.check()
    assert all(report.available(f) for f in internals.FEATURES), report.problems
    assert vllm_version() in internals.RUN_TESTED


@follows_cpu_fp8
def test_per_tensor_scales_loaded(tiny, started):
    stored = read_stored_scales(tiny("compat-calibrated", **KVSCALE_CASES["compat-calibrated"]))
    assert len({round(v["k"], 4) for v in stored.values()}) == len(stored)
    result = started["kvscale:compat-calibrated"]
    assert_started_or_refused_fp8(result)
    scales = result["scales"]
    assert len(scales) == len(stored), result
    for name, s in scales.items():
        want = stored[layer_index(name)]
        assert s["source"] == "checkpoint", s
        assert s["k"] == pytest.approx([want["k"]], rel=1e-6), name
        assert s["v"] == pytest.approx([want["v"]], rel=1e-6), name
        assert (s["k_float"], s["v_float"]) == pytest.approx((want["k"], want["v"]), rel=1e-6)


@follows_cpu_fp8
def test_per_head_scales_loaded(tiny, started):
    stored = read_stored_scales(tiny("compat-per-head", **KVSCALE_CASES["compat-per-head"]))
    result = started["kvscale:compat-per-head"]
    assert_started_or_refused_fp8(result)
    scales = result["scales"]
    assert len(scales) == len(stored), result
    for name, s in scales.items():
        want = stored[layer_index(name)]
        assert len(want["k"]) == 2 and want["k"][0] != want["k"][1]
        assert s["k"] == pytest.approx(want["k"], rel=1e-6), name
        assert s["v"] == pytest.approx(want["v"], rel=1e-6), name
        assert s["k_float"] == pytest.approx(max(want["k"]), rel=1e-6), name


@follows_cpu_fp8
def test_reload_check_is_on_this_releases_reload_path(tiny):
    """kvscale wraps no reload function: its check is in the KV method, which this
    release's reload calls (the call site is read from vLLM's source), and at the worker's
    ``reload_weights``, which a kvscale engine's worker wraps -- while vLLM's reload
    module stays vLLM's. (The behaviour is proven by the next test where FP8 runs.)"""
    import vllm.model_executor.model_loader.reload.layerwise as layerwise
    from vllm.v1.worker.gpu_worker import Worker

    path = next(
        i for i in internals.INTERNALS if i.target.endswith("layerwise._reload_attention_scales")
    )
    assert internals.problem(path) is None
    with vllm_engine(tiny("default"), quantization="kvscale", kv_cache_dtype=KV_DTYPE):
        assert getattr(Worker.reload_weights, "__kvscale_reload_check__", False)
    import vllm.model_executor.model_loader.reload as reload

    for module in (reload, layerwise):
        wrapped = [n for n, v in vars(module).items() if hasattr(v, "__kvscale_reload_check__")]
        assert wrapped == [], (module.__name__, wrapped)


@needs_fp8_cpu_cache
def test_reload_serves_new_scales_and_refuses_corrupt_ones(tiny):
    first = tiny("compat-reload-a", scales={0: (2.5, 3.5), 1: (4.5, 5.5)})
    second = tiny("compat-reload-b", scales={0: (5.5, 6.5), 1: (7.25, 8.75)})
    bad = tiny("compat-reload-bad", scales={0: (2.0, 3.0), 1: (math.nan, 5.5)})

    def held(llm: Any) -> dict[int, tuple[float, float]]:
        return {layer_index(n): (s.k, s.v) for n, s in layer_scales(llm).items()}

    with vllm_engine(first, quantization="kvscale") as llm:
        assert held(llm) == {0: (2.5, 3.5), 1: (4.5, 5.5)}
        reload_weights(llm, second)
        assert held(llm) == {0: (5.5, 6.5), 1: (7.25, 8.75)}
        with pytest.raises(CorruptScaleError, match=r"layers\.1\.self_attn\.k_scale: NaN"):
            reload_weights(llm, bad)
        assert held(llm) == {0: (5.5, 6.5), 1: (7.25, 8.75)}


# ---------------------------------------------------------------- (c) inspect


def test_inspect_reports_against_the_installed_vllm(tiny):
    ckpt = tiny("compat-calibrated", num_layers=3)
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "inspect", str(ckpt), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert report["host_version"] == vllm_version(), report["host_version"]
    assert report["stock"]["engine"] == f"vllm {vllm_version()}"
    assert report["kvscale"]["outcome"] == "starts"
