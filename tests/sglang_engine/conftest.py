"""SGLang's own ``sglang.Engine`` on a CPU, with ``quantization="kvscale"``.

Run in the SGLang venv (``make test-sglang``). tests/sglang_host drives SGLang's modules
in this process; here the Engine users run starts as it does for them: a scheduler
subprocess that discovers the ``sglang.srt.plugins`` entry points itself, loads the
model, sizes the KV pool and serves. Each Engine runs in ``engine_driver.py`` in its own
process group, killed whole afterwards (at most one Engine at a time).

What a CPU-only machine needs for that, all in ``site/`` (test tree only, never
installed): ``sitecustomize.py`` (PyPI's CUDA torchvision made importable in every
process of the Engine), ``sgl_kernel/`` (a stand-in for SGLang's CPU kernel package,
used only by speculative decoding) and ``kvscale_engine_probe/`` (a test-only SGLang
plugin that writes what the scheduler's attention layers hold to a JSON file; its
``.dist-info`` is written into a temporary folder here, so it is discovered as an
installed distribution without installing anything). ``SGLANG_USE_CPU_ENGINE=1`` makes
SGLang pick its CPU platform.
"""

from __future__ import annotations

import importlib.util
import json
import os
import runpy
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
SITE = HERE / "site"
SUPPORT = HERE.parent / "support"
DRIVER = HERE / "engine_driver.py"
#: Generous: an Engine starts in ~25-50 s on 2 busy cores; a hung start is killed.
ENGINE_TIMEOUT_S = 420


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


if sglang_installed():
    # Before anything here imports transformers or sglang (both import torchvision).
    runpy.run_path(str(SITE / "sitecustomize.py"))
else:  # in the vLLM venv: nothing here can run (tests/conftest.py excludes the folder)
    collect_ignore_glob = ["test_*.py"]


@dataclass(frozen=True)
class EngineRun:
    """One Engine start: the driver's result, the scheduler's probe report, the log."""

    result: dict[str, Any]
    probe: dict[str, Any]
    log: str
    wall_s: float

    @property
    def error(self) -> str | None:
        return self.result.get("error")


@pytest.fixture(scope="session")
def engine_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The environment an Engine's processes get: the shims and the probe's metadata."""
    if not sglang_installed():
        pytest.skip("sglang is not installed (run tests/sglang_engine in .venv-sglang)")
    dist = tmp_path_factory.mktemp("probe-dist")
    info = dist / "kvscale_engine_probe-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvscale-engine-probe\nVersion: 0.1\n"
    )
    (info / "entry_points.txt").write_text(
        "[sglang.srt.plugins]\nkvscale_engine_probe = kvscale_engine_probe:register\n"
    )
    paths = [str(SITE), str(dist), str(SUPPORT)]
    if os.environ.get("PYTHONPATH"):
        paths.append(os.environ["PYTHONPATH"])
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(paths),
        SGLANG_USE_CPU_ENGINE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("SGLANG_PLUGINS", None)  # a user's allow-list would hide kvscale or the probe
    return env


@pytest.fixture(scope="session")
def run_engine(
    engine_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Callable[..., EngineRun]:
    """``run_engine(name, model_path, input_ids, max_new_tokens=4, steps=None,
    **engine_kwargs)`` (``steps``: weight updates, see engine_driver.py)."""

    def run(
        name: str,
        model_path: Path,
        input_ids: list[int],
        max_new_tokens: int = 4,
        steps: list[dict[str, str]] | None = None,
        **engine_kwargs: Any,
    ) -> EngineRun:
        work = tmp_path_factory.mktemp(f"engine-{name}")
        kwargs = dict(
            model_path=str(model_path),
            device="cpu",
            attention_backend="torch_native",
            quantization="kvscale",
            dtype="bfloat16",
            max_total_tokens=2048,  # the KV pool: a few MB, not a share of the RAM
            log_level="warning",
        )
        kwargs.update(engine_kwargs)
        spec = {
            "engine": kwargs,
            "input_ids": input_ids,
            "max_new_tokens": max_new_tokens,
            "steps": steps or [],
        }
        (work / "spec.json").write_text(json.dumps(spec))
        env = dict(engine_env, KVSCALE_ENGINE_PROBE=str(work / "probe.json"))
        log_path = work / "engine.log"
        start = time.monotonic()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(
                [sys.executable, str(DRIVER), str(work / "spec.json"), str(work / "out.json")],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole below
            )
            try:
                proc.wait(timeout=ENGINE_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)  # the Engine's leftover children
                except ProcessLookupError:
                    pass
                proc.wait()
        wall = time.monotonic() - start
        text = log_path.read_text(errors="replace")
        out = work / "out.json"
        if not out.exists():
            pytest.fail(
                f"the Engine driver wrote no result (exit status {proc.returncode}, "
                f"{wall:.0f} s; log {log_path}):\n{text[-4000:]}"
            )
        probe = work / "probe.json"
        return EngineRun(
            result=json.loads(out.read_text()),
            probe=json.loads(probe.read_text()) if probe.exists() else {},
            log=text,
            wall_s=wall,
        )

    return run
