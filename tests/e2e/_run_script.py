"""Run a probe script in a fresh interpreter and read its ``RESULT {json}`` line.

Engines with vLLM's multiprocessing executor (TP, PP, MTP drafts on worker processes)
run in their own interpreter, so the plugin is found only through its entry point and
nothing of an earlier engine in the test process is shared.

vLLM picks the ports of its distributed processes itself (a port found free, then bound
by torch's TCPStore), and another process can take one in between: a run that fails
with "Address already in use" is run again, a bounded number of times (``_server``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from _server import PORT_ATTEMPTS, lost_port_race

HERE = Path(__file__).parent


def run_script(
    script: str | Path,
    *args: str,
    tmp_path: Path,
    timeout: int = 400,
    env: Mapping[str, str] | None = None,
    output: list[str] | None = None,
) -> Any:
    """``python script *args`` with vLLM's multiprocessing settings for this one-NUMA-node
    CPU machine (plus ``env``); returns the decoded ``RESULT`` line, and fails with the
    exit status, stdout and stderr tails when there is none or the script did not exit 0.
    ``output``, when given, receives the run's stdout and stderr."""
    env = {**os.environ, **(env or {})}
    env["TMPDIR"] = str(tmp_path)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # one NUMA node: workers share it
    for _ in range(PORT_ATTEMPTS):
        proc = subprocess.run(
            [sys.executable, str(HERE / script), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode == 0 and lines:
            if output is not None:
                output[:] = [proc.stdout, proc.stderr]  # what every process of the run printed
            return json.loads(lines[-1][len("RESULT ") :])
        if not lost_port_race(proc.stdout + proc.stderr):
            break  # a real failure, not a lost port race
    raise AssertionError(
        f"{script}: exit status {proc.returncode}, RESULT printed: {bool(lines)}\n"
        f"stdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    )
