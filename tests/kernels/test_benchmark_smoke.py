"""benchmarks/cache_write.py runs in smoke mode and reports what it timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# A benchmark in a fresh process: `make test`, not `make test-fast`.
pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def test_cache_write_benchmark_smoke() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "cache_write.py"), "--smoke"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    rows = [line for line in out.splitlines() if line and not line.startswith(("#", "tokens"))]
    assert "torch reference" in out
    # Every contender wrote the same bytes as the reference.
    assert rows and all(line.rstrip().endswith("0.00%") or "vLLM" in line for line in rows), out
    if torch.cuda.is_available():
        assert "kvscale fused (software cvt)" in out, out
    else:
        assert "no GPU" in out, out
        assert {line.split()[0] for line in rows} == {"1", "64", "512"}, out
