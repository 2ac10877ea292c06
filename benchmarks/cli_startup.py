"""CLI start-up time: ``python -c pass``, ``kvscale --help`` and ``kvscale inspect``, side by side.

Each command runs in a fresh process, ``--runs`` times (interleaved, after one warm-up
run each); the table shows the median, min and max wall time, and -- from one more run
with ``python -X importtime`` -- whether the command imported torch, compressed-tensors or
a host engine (vLLM, SGLang). ``kvscale inspect`` reads a tiny checkpoint written here
(two layers of per-tensor k/v scales and a kv_cache_scheme), or ``--model DIR``.

    python benchmarks/cli_startup.py [--runs 7] [--model DIR]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# kvscale_testing: the tests' helpers (tests/support), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from kvscale_testing.scale_checkpoint import scale_only_checkpoint  # noqa: E402

WATCHED = ("torch", "compressed_tensors", "vllm", "sglang")


def kvscale_command() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m``."""
    script = Path(sys.executable).with_name("kvscale")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kvscale_plugin.cli"]


def wall_time(argv: list[str]) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stderr}")
    return elapsed


def imported(argv: list[str]) -> set[str]:
    """Top-level packages ``argv`` imports (``argv[0]`` a Python script or interpreter)."""
    if argv[0] != sys.executable:
        argv = [sys.executable, *argv]  # the console script, run by its interpreter
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run(
        argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env
    )
    return {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command (default 7)")
    parser.add_argument("--model", type=Path, default=None, help="checkpoint for kvscale inspect")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvscale-cli-startup-") as tmp:
        model = args.model or scale_only_checkpoint(Path(tmp) / "tiny")
        kvscale = kvscale_command()
        commands = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "kvscale --help": [*kvscale, "--help"],
            "kvscale inspect TINY": [*kvscale, "inspect", str(model)],
        }
        for argv in commands.values():
            wall_time(argv)  # warm-up: page cache, .pyc files
        times: dict[str, list[float]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, argv in commands.items():
                times[name].append(wall_time(argv))
        imports = {name: imported(argv) for name, argv in commands.items()}

    print(f"# {' '.join(kvscale)}; {args.runs} runs each (after one warm-up), wall time in s")
    print(f"# inspect: {model if args.model else 'tiny 2-layer checkpoint with a kv_cache_scheme'}")
    header = f"{'command':<22}{'median':>8}{'min':>8}{'max':>8}  imports"
    print(header)
    print("-" * len(header))
    for name, values in times.items():
        heavy = ", ".join(p for p in WATCHED if p in imports[name]) or "none of " + "/".join(
            WATCHED
        )
        print(
            f"{name:<22}{statistics.median(values):>8.3f}{min(values):>8.3f}"
            f"{max(values):>8.3f}  {heavy}"
        )


if __name__ == "__main__":
    main()
