"""A future vLLM, simulated: one internal kvscale touches is missing, or a module it needs
fails to import. Stock starts must not notice; ``--quantization kvscale`` must say what is
lost (a non-core feature: served without it; the core: refused at that engine's start,
naming the version and the supported range). Registration itself never raises.
"""

from __future__ import annotations

import pytest
from kvscale_testing.skips import follows_cpu_fp8
from test_vllm_release import (
    KVSCALE_KV_DTYPE,
    PLAIN,
    assert_started_or_refused_fp8,
    probes,
    vllm_version,
)

from kvscale_plugin.hosts.vllm import internals

pytestmark = pytest.mark.engine


@follows_cpu_fp8
@pytest.mark.slow
def test_missing_target_costs_only_its_feature(tiny, tmp_path):
    plain = tiny("compat-plain", **PLAIN)
    ckpt = tiny("compat-calibrated", num_layers=3)
    # One interpreter: the stock start first, before kvscale activates anything.
    stock, ours = probes(
        tmp_path,
        [
            {"model": str(plain), "simulate": "missing-target"},
            {"model": str(ckpt), "quantization": "kvscale", "kv_cache_dtype": KVSCALE_KV_DTYPE},
        ],
    )
    assert stock["started"] and stock["error"] is None, stock
    assert stock["installed"] == ["scales"] and stock["warnings"] == [], stock

    assert_started_or_refused_fp8(ours)
    assert set(ours["installed"]) == set(internals.FEATURES) - {"mtp-drafts"}
    assert all(layer["source"] == "checkpoint" for layer in ours["scales"].values())
    lost = [w for w in ours["warnings"] if "this feature is unavailable" in w]
    assert len(lost) == 1, ours["warnings"]
    assert "MTP draft layers" in lost[0] and "get_all_weights_renamed_in_a_future_vllm" in lost[0]
    assert f"vLLM {vllm_version()}" in lost[0]


@follows_cpu_fp8
@pytest.mark.slow
def test_core_module_that_fails_to_import_leaves_stock_starts_alone(tiny, tmp_path):
    plain = tiny("compat-plain", **PLAIN)
    ckpt = tiny("compat-calibrated", num_layers=3)
    # One interpreter, the stock starts first: a plain model, and a compressed-tensors
    # checkpoint without -q kvscale (stock's own method serves it); then -q kvscale.
    stock, ct, refused = probes(
        tmp_path,
        [
            {"model": str(plain), "simulate": "module-fails"},
            {"model": str(ckpt), "kv_cache_dtype": "fp8"},
            {"model": str(ckpt), "quantization": "kvscale"},
        ],
    )
    assert stock["started"] and stock["error"] is None, stock
    assert stock["installed"] == [] and stock["warnings"] == [], stock
    assert_started_or_refused_fp8(ct)
    assert all(layer["source"] is None for layer in ct["scales"].values())
    assert ct["warnings"] == [], ct["warnings"]

    assert not refused["started"], refused
    error = refused["error"]
    assert f"cannot work on vLLM {vllm_version()}" in error, error
    assert "kvscale_simulated_moved_module" in error and "fails to import" in error, error
    assert f"supports vLLM >={internals.MIN_VERSION}" in error, error
    said = [w for w in refused["warnings"] if "lacks what --quantization kvscale needs" in w]
    assert len(said) == 1, refused["warnings"]
