"""Reliability on real in-process vLLM engines (CPU build), tiny local checkpoints.

* The worst of the fuzzed inputs (``tests/unit/test_fuzz_*.py``) through real engines
  (five engines): each either starts with exactly the checkpoint's scales, or fails
  with kvscale's documented message naming every bad tensor (and head) -- or, for a
  damaged file, with the safetensors error that ``kvscale inspect`` predicted (exit 2).
* Reload storm: 20 in-place reloads in one engine, alternating two scale sets and a
  checkpoint without scales; values, buffers (``data_ptr``) and resident memory.
* No code from checkpoints: a checkpoint directory that also holds a Python module and
  pickles with side effects; ``kvscale inspect`` and a kvscale engine read only JSON and
  safetensors.
"""

from __future__ import annotations

import contextlib
import gc
import io
import json
import logging
import math
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.engines import reload_weights, vec_layout_dtype
from kvscale_testing.probe import (
    layer_index,
    layer_scales,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.skips import follows_cpu_fp8, needs_fp8_cpu_cache

from kvscale_plugin.inspection import run_inspect as _run_inspect
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine

PER_HEAD = {**FP8_KV_SCHEME, "strategy": "attn_head"}


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def run_inspect(model_dir: str, as_json: bool = False) -> int:
    """``kvscale inspect`` in-process, its output discarded (not through capsys: vLLM's
    logger keeps the stream it first saw)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        status = _run_inspect(model_dir, as_json=as_json)
    run_inspect.last_output = out.getvalue()  # type: ignore[attr-defined]
    return status


def _engine_error(model_dir: Path) -> str:
    """Start a kvscale engine that must fail; the error text (with its causes)."""
    from safetensors import SafetensorError

    # CorruptScaleError (a ValueError) or the safetensors library's refusal. An explicit
    # FP8 cache: corrupt scales are refused at load, before vLLM's CPU checks the cache
    # (with `auto`, a CPU without AVX-512 / AMX serves bf16, which takes them with a warning).
    with pytest.raises((ValueError, SafetensorError)) as info:
        with vllm_engine(model_dir, quantization="kvscale", kv_cache_dtype="fp8"):
            pass
    parts, exc = [], info.value
    while exc is not None:
        parts.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(parts)


# ------------------------------------------------------------------ the worst, on engines


@follows_cpu_fp8
def test_corrupt_values_of_every_dtype_named_in_one_error(tiny):
    """0 (f32 scalar), 1e300 (f64: inf in the f32 parameter), NaN (f16 [1]), -1.0 (bf16
    [1, 1, 1]) and a [2] per-tensor scale: one start-up error naming each tensor."""
    bad = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.0),
        "model.layers.1.self_attn.v_scale": torch.tensor(1e300, dtype=torch.float64),
        "model.layers.2.self_attn.k_scale": torch.tensor([math.nan], dtype=torch.float16),
        "model.layers.3.self_attn.v_scale": torch.tensor([[[-1.0]]], dtype=torch.bfloat16),
        "model.layers.3.self_attn.k_scale": torch.tensor([2.0, 3.0]),
    }
    ckpt = tiny("fuzz-worst-values", num_layers=4, extra_tensors=bad)
    assert run_inspect(str(ckpt)) == 1  # inspect calls it out first
    text = _engine_error(ckpt)
    assert "CorruptScaleError" in text, text
    for expected in (
        "model.layers.0.self_attn.k_scale: 0",
        "model.layers.1.self_attn.v_scale: inf (infinite)",
        "model.layers.2.self_attn.k_scale: NaN",
        "model.layers.3.self_attn.v_scale: -1.0 (negative)",
        "model.layers.3.self_attn.k_scale: shape (2,) is not a per-tensor scalar",
    ):
        assert expected in text, text
    assert "model.layers.0.self_attn.v_scale" not in text  # the good ones are not named


@follows_cpu_fp8
def test_per_head_nan_head_and_wrong_length_named(tiny):
    scales = {0: ([3.0, math.nan], [2.0, 2.5]), 1: ([3.0, 4.0], [2.0, 2.5])}
    wrong = {"model.layers.1.self_attn.v_scale": torch.full((3, 1, 1), 2.0)}
    ckpt = tiny(
        "fuzz-worst-heads",
        num_layers=2,
        per_head=True,
        kv_cache_scheme=PER_HEAD,
        scales=scales,
        extra_tensors=wrong,
    )
    assert run_inspect(str(ckpt)) == 1
    text = _engine_error(ckpt)
    assert "model.layers.0.self_attn.k_scale[head 1]: NaN" in text, text
    assert (
        "model.layers.1.self_attn.v_scale: shape (3, 1, 1) does not match the "
        "model's 2 KV heads" in text
    ), text
    assert "k_scale[head 0]" not in text


def test_truncated_shard_fails_as_inspect_predicts(tiny, tmp_path):
    ckpt = tmp_path / "truncated"
    shutil.copytree(tiny("default", num_layers=2), ckpt)
    blob = (ckpt / "model.safetensors").read_bytes()
    (ckpt / "model.safetensors").write_bytes(blob[: len(blob) - 1000])
    assert run_inspect(str(ckpt)) == 2
    assert "truncated" in run_inspect.last_output  # type: ignore[attr-defined]
    text = _engine_error(ckpt)
    # The safetensors library refuses the file before any weight reaches kvscale.
    assert "SafetensorError" in text or "safetensors" in text.lower(), text
    print(f"truncated shard, engine error: {text.splitlines()[0][:200]}")


def test_scheme_of_the_wrong_type_starts_unscaled_with_one_warning(tiny, kvscale_warnings):
    scheme = {
        "num_bits": "eight",
        "type": 5,
        "strategy": [],
        "dynamic": "maybe",
        "symmetric": None,
        "not_a_field": {"x": [1]},
    }
    ckpt = tiny("fuzz-worst-scheme", kv_cache_scheme=scheme)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
        logprobs = teacher_forced_logprobs(llm, reference_token_ids(ckpt)[:16])
    assert all(math.isfinite(x) for x in logprobs)
    for s in scales.values():
        assert not s.pool_is_fp8 and s.k == s.v == s.k_float == s.v_cpu == 1.0, s
    warnings = kvscale_warnings("is not supported")
    assert len(warnings) == 1 and "malformed" in warnings[0], warnings


@needs_fp8_cpu_cache
def test_odd_but_valid_scales_load_exactly(tiny):
    """f16 [1], bf16 0-d, f64 [1, 1, 1], a tiny (2e-8) and a huge (9e3) scale: all
    positive finite float32 numbers inside the plausible range [2**-27, 1e4], so the engine
    starts and holds them as given."""
    odd = {
        "model.layers.0.self_attn.k_scale": torch.tensor([4.0], dtype=torch.float16),
        "model.layers.0.self_attn.v_scale": torch.tensor(3.0, dtype=torch.bfloat16),
        "model.layers.1.self_attn.k_scale": torch.tensor([[[2e-8]]], dtype=torch.float64),
        "model.layers.1.self_attn.v_scale": torch.tensor([9e3], dtype=torch.float32),
    }
    ckpt = tiny("fuzz-odd-valid", num_layers=2, extra_tensors=odd)
    want = {0: (4.0, 3.0), 1: (_f32(2e-8), _f32(9e3))}
    # In the cache layout kvscale's write serves (on a CPU with AMX, vLLM's own AMX-layout
    # write and attention turn these extreme scales into NaN logprobs: measured 0/15 finite).
    with vllm_engine(ckpt, quantization="kvscale", dtype=vec_layout_dtype()) as llm:
        scales = layer_scales(llm)
        logprobs = teacher_forced_logprobs(llm, reference_token_ids(ckpt)[:16])
    for name, s in scales.items():
        k, v = want[layer_index(name)]
        assert (s.k, s.k_float, s.k_cpu) == pytest.approx((k, k, k), rel=1e-6), s
        assert (s.v, s.v_float, s.v_cpu) == pytest.approx((v, v, v), rel=1e-6), s
        assert s.pool_is_fp8 and s.source == "checkpoint"
    finite = sum(math.isfinite(x) for x in logprobs)
    print(f"odd-but-valid scales: {finite}/{len(logprobs)} finite logprobs")
    # (A scale whose 448 x scale overflows float32, e.g. 3e38, is rejected as corrupt:
    # served, it turned every logprob into NaN.)
    assert finite == len(logprobs)


# ------------------------------------------------------------------ reload storm


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@needs_fp8_cpu_cache
def test_reload_storm(tiny, kvscale_warnings):
    a = tiny("storm-a", num_layers=2, scales={0: (3.5, 2.25), 1: (4.75, 2.5)})
    b = tiny("storm-b", num_layers=2, scales={0: (5.5, 6.5), 1: (7.25, 8.75)})
    none = tiny("storm-none", num_layers=2, write_scales=False)
    sets = {"a": read_stored_scales(a), "b": read_stored_scales(b)}
    order = [("b", b), ("none", none), ("a", a)]
    rss: dict[int, int] = {}
    with vllm_engine(a, quantization="kvscale") as llm:
        first = layer_scales(llm)
        expected = "a"
        for step in range(1, 21):
            label, ckpt = order[(step - 1) % 3]
            reload_weights(llm, ckpt)
            # A checkpoint without scales: vLLM's layerwise reload restores the attention
            # layers' previous tensors and never calls the KV method for them, so the
            # previous scales stay (the other weights are reloaded); kvscale warns once.
            expected = expected if label == "none" else label
            now = layer_scales(llm)
            assert sorted(now) == sorted(first)
            for name, s in now.items():
                want = sets[expected][layer_index(name)]
                assert (s.k, s.k_float, s.k_cpu) == pytest.approx((want["k"],) * 3, rel=1e-6), (
                    step,
                    label,
                    s,
                )
                assert (s.v, s.v_float, s.v_cpu) == pytest.approx((want["v"],) * 3, rel=1e-6), (
                    step,
                    label,
                    s,
                )
                assert (s.k_ptr, s.v_ptr) == (first[name].k_ptr, first[name].v_ptr), (step, name)
                assert s.pool_is_fp8
            if step in (2, 20):
                gc.collect()
                rss[step] = _rss_bytes()
        logprobs = teacher_forced_logprobs(llm, reference_token_ids(a)[:16])
    assert all(math.isfinite(x) for x in logprobs)
    growth = rss[20] - rss[2]
    missing = kvscale_warnings("no k_scale/v_scale tensors")
    print(
        f"reload storm: RSS after reload 2 = {rss[2] / 2**20:.1f} MiB, after reload 20 = "
        f"{rss[20] / 2**20:.1f} MiB, growth {growth / 2**20:+.1f} MiB; 'scales missing' "
        f"warnings during the storm: {len(missing)}"
    )
    assert growth < 50 * 2**20
    # The no-scales reloads keep the previous scales, and say so once for the engine.
    assert len(missing) == 1 and "reloaded weights carry no" in missing[0], missing


# ------------------------------------------------------------------ no code from checkpoints


class _SideEffect:
    """Unpickling this writes the marker file (what a malicious pickle would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (exec, (f"open({str(self.marker)!r}, 'w').write('unpickled')",))


@needs_fp8_cpu_cache
def test_no_code_from_checkpoints(tiny, tmp_path):
    ckpt = tmp_path / "booby-trapped"
    shutil.copytree(tiny("default", num_layers=2), ckpt)
    marker = tmp_path / "MARKER"
    code = f"open({str(marker)!r}, 'w').write('imported')\n"
    (ckpt / "evil.py").write_text(code + "class EvilConfig: pass\nclass EvilModel: pass\n")
    (ckpt / "modeling_evil.py").write_text(code)
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt", "rng_state.pth"):
        (ckpt / name).write_bytes(pickle.dumps(_SideEffect(marker)))
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["auto_map"] = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"}
    (ckpt / "config.json").write_text(json.dumps(cfg))
    tok = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok["auto_map"] = {"AutoTokenizer": ["evil.EvilConfig", None]}
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok))
    # The trap works: unpickling the .bin does write the marker.
    probe = tmp_path / "probe"
    probe.mkdir()
    shutil.copy(ckpt / "pytorch_model.bin", probe / "x.bin")
    with open(probe / "x.bin", "rb") as f:
        pickle.load(f)  # noqa: S301 - on purpose, to prove the trap
    assert marker.read_text() == "unpickled"
    marker.unlink()

    assert run_inspect(str(ckpt), as_json=True) == 0
    assert not marker.exists()
    with vllm_engine(ckpt, quantization="kvscale") as llm:  # trust_remote_code=False
        scales = layer_scales(llm)
    stored = read_stored_scales(ckpt)
    for name, s in scales.items():
        assert s.k == pytest.approx(stored[layer_index(name)]["k"], rel=1e-6)
    assert not marker.exists(), marker.read_text()


# ------------------------------------------------- q scales, and the INFO line at start-up

# What llm-compressor 0.14's attention-quantization example saves for a q it never
# calibrated on a CPU (uninitialised memory), one value per layer: negative, infinite,
# and positive but absurd.
UNCALIBRATED_Q = (-5e21, math.inf, 2e24, 8.8e-39)


@pytest.mark.parametrize(
    "kv_cache_dtype", ["bfloat16", pytest.param("auto", marks=needs_fp8_cpu_cache)]
)
def test_unread_corrupt_q_scales_warn_once_and_serve(tiny, caplog, kv_cache_dtype):
    """A q scale that no attention here reads (vLLM's CPU attention never quantizes
    queries) does not stop the engine: one warning names every checkpoint tensor as it is
    on disk, the layers serve with the checkpoint's k/v scales (FP8 pool under ``auto``)
    and a q scale of 1.0."""
    caplog.set_level(logging.INFO, logger="kvscale_plugin")
    scales = {i: (0.05 * (i + 1), 0.02 * (i + 1)) for i in range(4)}
    q = {
        f"model.layers.{i}.self_attn.q_scale": torch.tensor([value], dtype=torch.bfloat16)
        for i, value in enumerate(UNCALIBRATED_Q)
    }
    ckpt = tiny("uncalibrated-q", num_layers=4, scales=scales, extra_tensors=q)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype=kv_cache_dtype) as llm:
        held = layer_scales(llm)
        context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
        q_held = {
            name: float(layer._q_scale.reshape(-1)[0])
            for name, layer in context.items()
            if hasattr(layer, "_q_scale")
        }
        logprobs = teacher_forced_logprobs(llm, reference_token_ids(ckpt)[:16])
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("kvscale_plugin")]
    q_warnings = [m for m in messages if "query-scale" in m]
    assert len(q_warnings) == 1, messages
    for i in range(4):
        assert f"model.layers.{i}.self_attn.q_scale" in q_warnings[0], q_warnings
    assert "self_attn.attn.q_scale" not in q_warnings[0]  # vLLM's name is not in the file
    for why in ("(negative)", "(infinite)", "implausible"):
        assert why in q_warnings[0], q_warnings
    assert set(q_held.values()) == {1.0}, q_held
    assert all(math.isfinite(x) for x in logprobs)
    fp8 = kv_cache_dtype == "auto"
    for name, s in held.items():
        want = scales[layer_index(name)] if fp8 else (1.0, 1.0)
        assert (s.k, s.v) == pytest.approx(want, rel=1e-6), s
        assert s.source == ("checkpoint" if fp8 else "unscaled"), s
    # What kvscale did, in one INFO line per load (vLLM's default log level shows it).
    loaded = [m for m in messages if "attention layer(s) loaded" in m]
    assert len(loaded) == 1, messages
    if fp8:
        assert "KV cache fp8" in loaded[0] and "4 with the checkpoint's per-tensor" in loaded[0]
        assert "k 0.05..0.2, v 0.02..0.08" in loaded[0], loaded
    else:
        assert (
            "KV cache bfloat16" in loaded[0] and "4 with a KV cache that does not use" in loaded[0]
        ), loaded


@follows_cpu_fp8
def test_corrupt_q_scale_is_refused_where_attention_reads_it(tiny, monkeypatch):
    """Where queries are quantized with the q scale (FP8 attention on a GPU), a corrupt one
    is refused with the k/v scales' error, naming the checkpoint tensor. Run here by
    giving the CPU layers a query quantizer, which is what decides it."""
    from kvscale_plugin.hosts.vllm import method

    q = {"model.layers.1.self_attn.q_scale": torch.tensor([2e24])}
    ckpt = tiny("uncalibrated-q-read", num_layers=2, extra_tensors=q)
    monkeypatch.setattr(method, "reads_q_scale", lambda layer: True)
    text = _engine_error(ckpt)
    assert "CorruptScaleError" in text, text
    assert "model.layers.1.self_attn.q_scale: 2e+24 (implausible" in text, text
