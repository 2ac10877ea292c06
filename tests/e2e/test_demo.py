"""`kvscale demo`, the README's main job, run as a user runs it (a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.engine


def test_demo_table_shows_stock_vs_kvscale(tmp_path):
    out_png, out_json = tmp_path / "demo.png", tmp_path / "demo.json"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "demo", "--cache-dir", str(tmp_path / "c"),
         "--out", str(out_png), "--json", str(out_json)],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[1/11] bf16-cache reference: starting engine" in proc.stdout  # progress shown
    assert out_png.stat().st_size > 10_000 and out_png.read_bytes()[:4] == b"\x89PNG"

    rows = {(r["variant"], r["engine"]): r for r in json.loads(out_json.read_text())}
    stored = json.loads((tmp_path / "c" / "per-tensor" / "kvscale_tiny.json").read_text())
    ks = [stored["stored_scales"][str(i)]["k"] for i in range(3)]

    good = rows["per-tensor", "kvscale"]
    assert good["k_scales"] == pytest.approx(ks, rel=1e-6) and good["mean_err"] < 0.03
    assert rows["scales-missing", "kvscale"]["mean_err"] > 2 * good["mean_err"]
    # kv_scale-only: stock leaves v at 1.0 and is clearly worse; kvscale duplicates.
    assert rows["kv_scale-only", "stock-fp8"]["v_scales"] == [1.0, 1.0, 1.0]
    assert rows["kv_scale-only", "kvscale"]["v_scales"] == rows["kv_scale-only", "kvscale"][
        "k_scales"]
    assert rows["kv_scale-only", "kvscale"]["mean_err"] * 2 < rows[
        "kv_scale-only", "stock-fp8"]["mean_err"]
    # output_scale naming: stock refuses to start, kvscale loads.
    assert not rows["output_scale", "stock-fp8"]["started"]
    assert rows["output_scale", "kvscale"]["k_scales"] == pytest.approx(ks, rel=1e-6)
    # unsupported scheme: stock refuses, kvscale serves an unscaled bf16 cache.
    assert not rows["unsupported", "stock-fp8"]["started"]
    assert rows["unsupported", "kvscale"]["cache_dtype"] == "bf16"

    table = proc.stdout[proc.stdout.index("variant "):]
    assert "refused to start: AttributeError" in table
    assert "refused to start: NotImplementedError" in table
    assert len([ln for ln in table.splitlines() if ln.startswith("per-tensor ")]) == 2


def test_demo_on_a_users_checkpoint(tiny, tmp_path):
    ckpt = tiny("kv_scale", naming="kv_scale")
    out_json = tmp_path / "mine.json"
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "demo", "--model", str(ckpt),
         "--out", str(tmp_path / "mine.png"), "--json", str(out_json)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["engine"]: r for r in json.loads(out_json.read_text())}
    assert set(rows) == {"stock-fp8", "kvscale"}
    assert rows["stock-fp8"]["v_scales"] == [1.0, 1.0]
    assert rows["kvscale"]["v_scales"] == rows["kvscale"]["k_scales"] != [1.0, 1.0]


def test_demo_rejects_a_directory_without_config(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "demo", "--model", str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "no config.json" in proc.stderr
