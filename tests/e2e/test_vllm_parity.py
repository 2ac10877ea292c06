"""Where stock vLLM is right, ``--quantization kvscale`` decides the same (real vLLM
config classes and engines, CPU build)."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from kvscale_testing.engines import attention_layers
from kvscale_testing.probe import layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.hosts.vllm import parity as vllm_parity

pytestmark = pytest.mark.engine


def test_nvfp4_decision_matches_stock(tiny, tmp_path):
    """``ModelConfig.is_nvfp4_quantized`` compares the method name with
    'compressed-tensors'; under 'kvscale' vLLM alone would say False."""
    import shutil

    from vllm.config import ModelConfig

    from kvscale_plugin.hosts.vllm import register

    register()
    src = tiny("parity-nvfp4", num_layers=1)
    ckpt = tmp_path / "nvfp4"
    shutil.copytree(src, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["quantization_config"]["format"] = "nvfp4-pack-quantized"
    (ckpt / "config.json").write_text(json.dumps(cfg))

    stock = ModelConfig(model=str(ckpt))
    ours = ModelConfig(model=str(ckpt), quantization="kvscale")
    assert (stock.quantization, ours.quantization) == ("compressed-tensors", "kvscale")
    assert stock.is_nvfp4_quantized() is True
    assert ours.is_nvfp4_quantized() is True
    unwrapped = ModelConfig.is_nvfp4_quantized.__wrapped__
    assert unwrapped(ours) is False  # the gap kvscale closes
    dense = ModelConfig(model=str(src), quantization="kvscale")
    assert dense.is_nvfp4_quantized() is False


@needs_fp8_cpu_cache
def test_perf_metrics_know_the_method(tiny):
    from vllm.v1.metrics import perf

    with vllm_engine(tiny("default", num_layers=2), quantization="kvscale") as llm:
        config = llm.llm_engine.vllm_config
        assert config.quant_config.get_name() == "kvscale"
        for parser in (
            perf.AttentionQuantizationConfigParser(),
            perf.FfnQuantizationConfigParser(),
        ):
            args = parser.parse(perf.ParsedArgs(), config)  # stock raises InvalidComponent
            assert args.weight_byte_size == perf._QUANT_WEIGHT_BYTE_SIZE["compressed-tensors"]


def test_vision_tower_difference_is_reported_once(kvscale_warnings):
    vllm_parity.warn_vision_tower_difference(["LlamaForCausalLM"])
    assert kvscale_warnings("vision tower") == []
    vllm_parity.warn_vision_tower_difference(["Gemma4ForConditionalGeneration"])
    vllm_parity.warn_vision_tower_difference(["Gemma4ForConditionalGeneration"])
    assert len(kvscale_warnings("Gemma4ForConditionalGeneration builds its vision tower")) == 1


@needs_fp8_cpu_cache
def test_q_and_prob_scales_match_stock(tiny):
    # A checkpoint without q / prob scales: stock ends with 1.0 for both.
    ckpt = tiny("default", num_layers=2)
    results = {}
    for quant, dtype in ((None, "fp8"), ("kvscale", "auto")):
        with vllm_engine(ckpt, quantization=quant, kv_cache_dtype=dtype) as llm:
            results[quant] = {
                n: (float(a._q_scale), a._q_scale_float, float(a._prob_scale))
                for n, a in attention_layers(llm).items()
            }
    assert results[None] == results["kvscale"]
    assert all(v == (1.0, 1.0, 1.0) for v in results["kvscale"].values())


@needs_fp8_cpu_cache
def test_no_scheme_explicit_fp8_uses_checkpoint_scales_like_stock(tiny):
    scales = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([value], dtype=torch.float32)
        for i in range(2)
        for kind, value in (("k", 3.25 + i), ("v", 2.5 + i))
    }
    ckpt = tiny("no-scheme-with-scales", num_layers=2, kv_cache_scheme=None, extra_tensors=scales)
    seen = {}
    for quant in (None, "kvscale"):
        with vllm_engine(ckpt, quantization=quant, kv_cache_dtype="fp8") as llm:
            seen[quant] = {
                n: (s.k, s.v, s.k_float, s.v_float, s.pool_is_fp8)
                for n, s in layer_scales(llm).items()
            }
    assert seen[None] == seen["kvscale"]
    assert seen["kvscale"]["model.layers.1.self_attn.attn"] == (4.25, 3.5, 4.25, 3.5, True)
    # Under auto, no scheme still means no scale parameters and a bf16 pool.
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        assert all(not s.pool_is_fp8 and s.source is None for s in layer_scales(llm).values())


@needs_fp8_cpu_cache
def test_each_engine_in_a_process_hears_its_own_warnings(tiny, caplog):
    ckpt = tiny("scales-missing", num_layers=2, write_scales=False)
    caplog.set_level(logging.WARNING, logger="kvscale_plugin")
    counts = []
    for _ in range(2):  # no fresh notices in between: a notebook / RL trainer
        with vllm_engine(ckpt, quantization="kvscale"):
            pass
        counts.append(sum("no k_scale/v_scale tensors" in r.getMessage() for r in caplog.records))
    assert counts == [1, 2]


def test_platform_with_a_quantization_list_accepts_kvscale(tmp_path):
    """ROCm and XPU list their methods; vLLM's register_quantization_config appends a
    newly registered name to the current platform's list (checked in a fresh process,
    since the append happens at first registration)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).parent / "_platform_list_probe.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result == {
        "accepted": True,
        "control_refused": True,
        "listed": ["fp8", "compressed-tensors", "kvscale"],
    }
