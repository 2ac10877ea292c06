"""`kvscale demo`, the README's main job, run as a user runs it (a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from kvscale_testing.engines import cpu_runs_fp8_cache
from kvscale_testing.probe import FP8_CPU_REFUSAL
from kvscale_testing.skips import follows_cpu_fp8, needs_fp8_cpu_cache

pytestmark = pytest.mark.engine


@follows_cpu_fp8
def test_demo_table_shows_stock_vs_kvscale(tmp_path):
    """The demo's wiring (CLI, progress, table, PNG, JSON) on one variant: the behaviour of
    every variant is proven engine by engine in test_vllm_engine.py."""
    out_png, out_json = tmp_path / "demo.png", tmp_path / "demo.json"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscale_plugin.cli",
            "demo",
            "--cache-dir",
            str(tmp_path / "c"),
            "--out",
            str(out_png),
            "--json",
            str(out_json),
            "--variants",
            "kv_scale-only",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/3] bf16-cache reference: starting engine" in proc.stdout  # progress shown
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"

    rows = {(r["variant"], r["engine"]): r for r in json.loads(out_json.read_text())}
    assert set(rows) == {("kv_scale-only", "stock-fp8"), ("kv_scale-only", "kvscale")}
    stored = json.loads((tmp_path / "c" / "kv_scale-only" / "kvscale_tiny.json").read_text())
    ks = [stored["stored_scales"][str(i)]["k"] for i in range(3)]
    # kv_scale-only: stock leaves v at 1.0 and is clearly worse; kvscale duplicates.
    ours, stock = rows["kv_scale-only", "kvscale"], rows["kv_scale-only", "stock-fp8"]
    assert stock["v_scales"] == [1.0, 1.0, 1.0]
    assert ours["k_scales"] == ours["v_scales"] == pytest.approx(ks, rel=1e-6)
    if cpu_runs_fp8_cache():
        assert ours["mean_err"] * 2 < stock["mean_err"] and ours["mean_err"] < 0.03
    else:
        # Loaded (the scales above come from the engine's layers), then refused by vLLM on
        # this CPU: the demo says why and shows no logprobs.
        for row in (ours, stock):
            assert FP8_CPU_REFUSAL in row["error"] and row["mean_err"] is None, row
        assert "this CPU has neither AVX-512 nor AMX" in proc.stdout

    table = proc.stdout[proc.stdout.index("variant ") :]
    assert len([ln for ln in table.splitlines() if ln.startswith("kv_scale-only ")]) == 2


def test_demo_rejects_an_unknown_variant(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscale_plugin.cli",
            "demo",
            "--variants",
            "per-tensor,nope",
            "--cache-dir",
            str(tmp_path / "c"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and "unknown variant(s) nope" in proc.stderr


@follows_cpu_fp8
def test_demo_on_a_users_checkpoint(tiny, tmp_path):
    ckpt = tiny("kv_scale", naming="kv_scale")
    out_json = tmp_path / "mine.json"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvscale_plugin.cli",
            "demo",
            "--model",
            str(ckpt),
            "--out",
            str(tmp_path / "mine.png"),
            "--json",
            str(out_json),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())}
    assert set(rows) == {"stock-fp8", "kvscale"}
    assert rows["stock-fp8"]["v_scales"] == [1.0, 1.0]
    assert rows["kvscale"]["v_scales"] == rows["kvscale"]["k_scales"] != [1.0, 1.0]


def test_demo_rejects_a_directory_without_config(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "demo", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "no config.json" in proc.stderr


def test_plot_draws_the_scales_of_engines_refused_after_loading(tmp_path):
    """On a CPU without AVX-512 / AMX every FP8 engine is refused after loading: the
    right-hand plot still draws the scales each one's layers held (dotted), as the table
    lists them, instead of only the engines that ran."""
    from kvscale_plugin.demo.results import EngineResult, scale_lines, write_plot

    refused = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    rows = [
        EngineResult("v", "stock-fp8", started=False, error=refused, v_scales=[1.0, 1.0]),
        EngineResult("v", "kvscale", started=False, error=refused, v_scales=[0.5, 0.25]),
        EngineResult("w", "kvscale", started=True, v_scales=[0.75, 0.5], mean_err=0.01),
        EngineResult("x", "stock-fp8", started=False, error="ValueError: bad"),  # nothing read
    ]
    lines = scale_lines(rows)
    assert [(label, style, scales) for label, style, scales in lines] == [
        ("v / stock-fp8 (loaded, refused to run)", ":", [1.0, 1.0]),
        ("v / kvscale (loaded, refused to run)", ":", [0.5, 0.25]),
        ("w / kvscale", "-", [0.75, 0.5]),
    ]
    png = write_plot(rows, tmp_path / "p.png")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_table_summarizes_many_layers_and_keeps_few():
    from kvscale_plugin.demo.results import EngineResult, render_table

    many = [0.5 + 0.01 * i for i in range(30)]
    many[7], many[18] = 0.1, 2.0
    rows = [
        EngineResult(
            "real",
            "kvscale",
            True,
            k_scales=many,
            v_scales=[1.0] * 30,
            cache_dtype="fp8",
            mean_err=0.09,
            max_err=1.1,
            ppl=19.6,
            top1=0.95,
        ),
        EngineResult(
            "few",
            "stock-fp8",
            True,
            k_scales=[3.86, 4.56],
            v_scales=[1.0, 1.0],
            cache_dtype="fp8",
            mean_err=0.08,
            max_err=0.2,
        ),
    ]
    table = render_table(rows)
    real = next(ln for ln in table.splitlines() if ln.startswith("real "))
    assert "0.1@L7 / 0.645 / 2@L18" in real and "1 (all 30)" in real
    assert real.rstrip().endswith("19.60   95.0%")
    few = next(ln for ln in table.splitlines() if ln.startswith("few "))
    assert "3.86 4.56" in few
    assert "min@layer / median / max@layer" in table
    widths = {len(ln) for ln in table.splitlines()[:4]}
    assert len(widths) == 1  # header, rule and rows line up


# The FP8 cache whose perplexity this pipeline compares.
@needs_fp8_cpu_cache
def test_demo_real_pipeline(monkeypatch, tiny, tmp_path, capsys):
    # The --real orchestration (fetch, calibrate, output_scale variant, six engines, table,
    # plot, JSON) on a plain tiny model standing in for SmolLM2 to keep it fast; SmolLM2
    # itself is served in tests/e2e/test_real_model.py.
    from kvscale_plugin.demo import realmodel
    from kvscale_plugin.demo import runner as demo

    plain = tiny("demo-real-plain", num_layers=3, kv_cache_scheme=None, quantization_config=False)
    monkeypatch.setattr(realmodel, "smollm2_checkpoint", lambda cache_dir=None, log=None: plain)
    monkeypatch.setattr(demo, "REAL_CALIBRATION", {"num_samples": 4, "max_len": 128})
    out_json = tmp_path / "real.json"
    rc = demo.main(
        [
            "--real",
            "--tokens",
            "300",
            "--cache-dir",
            str(tmp_path / "c"),
            "--out",
            str(tmp_path / "real.png"),
            "--json",
            str(out_json),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    rows = {(r["variant"], r["engine"]): r for r in json.loads(out_json.read_text())}
    assert list(rows) == [
        ("no scales", "stock-fp8"),
        ("calibrated", "stock-fp8"),
        ("calibrated", "kvscale"),
        ("output_scale", "stock-fp8"),
        ("output_scale", "kvscale"),
    ]
    written = json.loads(
        (tmp_path / "c" / "real" / "calibrated" / "kvscale_calibration.json").read_text()
    )
    k_amax = [max(v) for v in written["k_amax"].values()]
    calibrated = rows["calibrated", "kvscale"]
    assert calibrated["k_scales"] == pytest.approx([a / 448 for a in k_amax], rel=1e-6)
    assert rows["output_scale", "kvscale"]["k_scales"] == calibrated["k_scales"]
    assert not rows["output_scale", "stock-fp8"]["started"]
    assert rows["no scales", "stock-fp8"]["k_scales"] == [1.0, 1.0, 1.0]
    # The boosted stand-in's K/V exceed 448: calibrated scales win by far over 1.0.
    assert calibrated["mean_err"] * 3 < rows["no scales", "stock-fp8"]["mean_err"]
    assert calibrated["top1"] is not None and calibrated["ppl"] > 1
    assert "refused to start: AttributeError" in text and "top-1" in text
    assert (tmp_path / "real.png").read_bytes()[:4] == b"\x89PNG"
