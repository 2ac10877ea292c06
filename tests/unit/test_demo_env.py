"""``kvscale demo`` run in a caller's process leaves the caller's environment as it was:
it quiets vLLM's logs for its own engines only. (A test that ran the demo in a pytest-xdist
worker once left ``VLLM_LOGGING_LEVEL=ERROR`` behind, and every probe script that worker
started afterwards lost its INFO lines.)"""

from __future__ import annotations

import os

import pytest

from kvscale_plugin.demo import runner


@pytest.mark.parametrize("preset", [None, "DEBUG"])
def test_demo_restores_the_callers_environment(monkeypatch, capsys, preset):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    if preset is None:
        monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    else:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", preset)
    seen: dict[str, str | None] = {}

    def fake_run(args, out):
        seen["level"] = os.environ.get("VLLM_LOGGING_LEVEL")
        seen["mp"] = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner, "_run", fake_run)
    with pytest.raises(RuntimeError, match="stop here"):
        runner.main(["--variants", "per-tensor"])
    # During the run: quiet, in-process (a level the caller chose is kept).
    assert seen == {"level": preset or "ERROR", "mp": "0"}
    # After it, even when it failed: as before.
    assert os.environ.get("VLLM_LOGGING_LEVEL") == preset
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ
