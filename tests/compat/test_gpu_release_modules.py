"""kvscale's start-up check run against the *real modules* of the vLLM releases that have
only a GPU build (0.33.0, 0.34.0): the wheel's Python package imports here without
``vllm._C``. Unpacked from a cached download (build/host-sources) and put on the path ahead
of .venv's vLLM in a fresh interpreter, ``internals.check()`` -- what a kvscale engine's
activation runs -- must say, feature by feature, what the static check of the same sources
says. The static check reads every target; the live one imports them, reads signatures
and the source of the call sites, so the two are independent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from static_check import fetch_sources, internal_problem
from test_static_targets import CACHE, RELEASES

from kvscale_plugin.hosts.vllm import internals

pytestmark = pytest.mark.slow

LIVE = r"""
import json
from collections import Counter
import vllm
from kvscale_plugin.hosts.vllm import internals
# check() resolves each target it checks through internals.problem: counted per feature.
checked, problem = Counter(), internals.problem
def counted(internal):
    checked[internal.feature] += 1
    return problem(internal)
internals.problem = counted
report = internals.check()
print("RESULT " + json.dumps({
    "version": vllm.__version__,
    "file": vllm.__file__,
    "held": [f for f in internals.FEATURES if report.available(f)],
    "problems": {f: p for f, p in report.problems.items() if p},
    "checked": {f: checked[f] for f in internals.FEATURES},
}))
"""


@pytest.mark.parametrize("version", internals.STATIC_TESTED)
def test_the_start_up_check_of_the_real_modules_agrees_with_the_static_check(version, tmp_path):
    sources = fetch_sources(RELEASES[version], "vllm", CACHE)
    env = {**os.environ, "PYTHONPATH": str(sources.root), "TMPDIR": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", LIVE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # not the checkout: nothing shadows the release's package
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    live = json.loads(lines[-1][len("RESULT ") :])
    assert live["version"] == version and Path(live["file"]).is_relative_to(sources.root), live
    static_lost = {
        i.feature
        for i in internals.INTERNALS
        if i.required and internal_problem(sources, i) is not None
    }
    # The GPU wheel detects no CPU platform of its own: CPU-only targets are the exception.
    features = [f for f in internals.FEATURES if f != "cpu-write"]
    live_verdict = {f: f in live["held"] for f in features}
    static_verdict = {f: f not in static_lost for f in features}
    assert live_verdict == static_verdict, (live["problems"], static_lost)
    # Every feature was really checked live (a call site read where one is listed).
    assert all(live["checked"][f] > 0 for f in features), live["checked"]
