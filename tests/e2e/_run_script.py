"""Run a probe script in a fresh interpreter and read its ``RESULT {json}`` line.

Engines with vLLM's multiprocessing executor (TP, PP, MTP drafts on worker processes)
run in their own interpreter, so the plugin is found only through its entry point and
nothing of an earlier engine in the test process is shared."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent


def run_script(
    script: str | Path,
    *args: str,
    tmp_path: Path,
    timeout: int = 400,
    env: Mapping[str, str] | None = None,
) -> Any:
    """``python script *args`` with vLLM's multiprocessing settings for this one-NUMA-node
    CPU machine (plus ``env``); returns the decoded ``RESULT`` line, and fails with the
    exit status, stdout and stderr tails when there is none or the script did not exit 0."""
    env = {**os.environ, **(env or {})}
    env["TMPDIR"] = str(tmp_path)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # one NUMA node: workers share it
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"{script}: exit status {proc.returncode}, RESULT printed: {bool(lines)}\n"
        f"stdout: {proc.stdout[-1000:]}\nstderr: {proc.stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])
