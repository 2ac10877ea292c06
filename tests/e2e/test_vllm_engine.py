"""`--quantization kvscale` on real in-process vLLM engines (CPU build), tiny local checkpoints.

Every host row of the feature table (README, docs/features.md) is proven here: the values are read
back from the engine's attention layers, and accuracy is measured as teacher-forced
logprobs against a bf16-cache run of the same checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.engines import reload_weights
from kvscale_testing.probe import (
    layer_index,
    layer_scales,
    logprob_error,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.skips import follows_cpu_fp8, needs_fp8_cpu_cache

from kvscale_plugin.scales import CorruptScaleError
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine

REL = 1e-6


def assert_scales_equal_checkpoint(scales: dict, stored: dict) -> None:
    assert len(scales) == len(stored)
    for name, s in scales.items():
        want = stored[layer_index(name)]
        for got in (s.k, s.k_float, s.k_cpu):
            assert got == pytest.approx(want["k"], rel=REL), (name, s)
        for got in (s.v, s.v_float, s.v_cpu):
            assert got == pytest.approx(want["v"], rel=REL), (name, s)


@pytest.fixture(scope="module")
def calibrated(tiny):
    # Three layers: a clear, repeatable logprob signal there (docs/running-engines-on-cpu.md).
    return tiny("calibrated", num_layers=3)


@pytest.fixture(scope="module")
def bf16_reference(calibrated):
    ids = reference_token_ids(calibrated)
    with vllm_engine(calibrated, kv_cache_dtype="bfloat16") as llm:
        return ids, teacher_forced_logprobs(llm, ids)


@needs_fp8_cpu_cache
def test_per_layer_scales_loaded_and_used(calibrated, bf16_reference, tiny):
    ids, reference = bf16_reference
    stored = read_stored_scales(calibrated)
    # Per-layer scales really differ, so a layer mix-up cannot pass.
    assert len({round(v["k"], 4) for v in stored.values()}) == len(stored)

    with vllm_engine(calibrated, quantization="kvscale") as llm:
        scales = layer_scales(llm)
        ours = teacher_forced_logprobs(llm, ids)
    assert_scales_equal_checkpoint(scales, stored)
    for s in scales.values():
        assert s.kv_cache_dtype == "fp8" and s.pool_is_fp8, s  # auto -> FP8 pool
        assert s.source == "checkpoint"

    # Same model, FP8 cache at scale 1.0 (scheme declared, scales missing): K/V clip at 448.
    unscaled_dir = tiny("calibrated-noscales", num_layers=3, write_scales=False)
    with vllm_engine(unscaled_dir, quantization="kvscale") as llm:
        assert all(s.k == 1.0 and s.pool_is_fp8 for s in layer_scales(llm).values())
        at_one = teacher_forced_logprobs(llm, ids)

    ours_mean, ours_max = logprob_error(ours, reference)
    one_mean, one_max = logprob_error(at_one, reference)
    print(
        f"mean|dlogprob| kvscale={ours_mean:.4f} (max {ours_max:.3f}) "
        f"scale-1.0={one_mean:.4f} (max {one_max:.3f})"
    )
    assert ours_mean < 0.03
    assert ours_mean * 2.5 < one_mean


@needs_fp8_cpu_cache
def test_legacy_kv_scale_duplicated_to_v(tiny):
    ckpt = tiny("kv_scale", naming="kv_scale")
    stored = read_stored_scales(ckpt)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        ours = layer_scales(llm)
    assert_scales_equal_checkpoint(ours, stored)
    assert {s.source for s in ours.values()} == {"duplicated"}

    # Stock vLLM 0.32 (auto-detected compressed-tensors) leaves v_scale at 1.0.
    with vllm_engine(ckpt) as llm:
        stock = layer_scales(llm)
    for name, s in stock.items():
        assert s.k == pytest.approx(stored[layer_index(name)]["k"], rel=REL)
        assert s.v == 1.0


@needs_fp8_cpu_cache
@pytest.mark.parametrize("naming", ["output_scale", "k_proj", "qkv_proj"])
def test_scale_namings_loaded(tiny, naming):
    ckpt = tiny(f"naming-{naming}", naming=naming)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(ckpt))


def test_stock_ignores_output_scale_naming(tiny):
    ckpt = tiny("naming-output_scale", naming="output_scale")
    # Stock vLLM 0.32 does not map k_proj.output_scale: it fails to start with an
    # unrelated AttributeError deep in the QKV loader.
    with pytest.raises(AttributeError, match="QKVParallelLinear"):
        with vllm_engine(ckpt):
            pass


@needs_fp8_cpu_cache
def test_scheme_without_scales_uses_one_and_warns_once(tiny, kvscale_warnings):
    ckpt = tiny("noscales", write_scales=False)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
    assert all(s.k == s.v == s.k_float == s.v_cpu == 1.0 for s in scales.values())
    assert all(s.pool_is_fp8 for s in scales.values())
    warnings = kvscale_warnings("no k_scale/v_scale tensors")
    assert len(warnings) == 1, warnings
    assert "model.layers.0.self_attn.attn" in warnings[0]
    assert "model.layers.1.self_attn.attn" in warnings[0]


UNSUPPORTED = {
    "int8": ({**FP8_KV_SCHEME, "type": "int"}, "type=int"),
    "fp4": ({**FP8_KV_SCHEME, "num_bits": 4}, "num_bits=4"),
    "channel": ({**FP8_KV_SCHEME, "strategy": "channel"}, "strategy=channel"),
    "dynamic": ({**FP8_KV_SCHEME, "dynamic": True}, "dynamic=true"),
    "asymmetric": ({**FP8_KV_SCHEME, "symmetric": False}, "symmetric=false"),
    "malformed": ({**FP8_KV_SCHEME, "num_bits": "eight"}, "malformed"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_scheme_starts_unscaled(tiny, kvscale_warnings, case):
    scheme, reason = UNSUPPORTED[case]
    ckpt = tiny(f"unsupported-{case}", kv_cache_scheme=scheme)
    # The checkpoint does carry (valid-looking) scales: they must not be applied.
    assert all(v["k"] != 1.0 for v in read_stored_scales(ckpt).values())
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
        assert teacher_forced_logprobs(llm, reference_token_ids(ckpt))
    for s in scales.values():
        assert s.kv_cache_dtype == "auto" and not s.pool_is_fp8  # auto stayed the model dtype
        assert s.k == s.v == s.k_float == s.v_float == 1.0
    warnings = kvscale_warnings("is not supported")
    assert len(warnings) == 1, warnings
    assert reason in warnings[0]


@needs_fp8_cpu_cache
def test_unsupported_scheme_with_explicit_fp8_ignores_checkpoint_scales(tiny):
    scheme, _ = UNSUPPORTED["channel"]
    ckpt = tiny("unsupported-channel", kv_cache_scheme=scheme)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8") as llm:
        scales = layer_scales(llm)
    assert all(s.pool_is_fp8 and s.k == s.v == 1.0 for s in scales.values())
    assert {s.source for s in scales.values()} == {"unscaled"}


def test_stock_refuses_unsupported_scheme(tiny):
    scheme, _ = UNSUPPORTED["int8"]
    ckpt = tiny("unsupported-int8", kv_cache_scheme=scheme)
    with pytest.raises(NotImplementedError, match="kv cache quantization"):
        with vllm_engine(ckpt):
            pass


def test_no_scheme_is_unchanged(tiny):
    ckpt = tiny("no-scheme", kv_cache_scheme=None)
    ids = reference_token_ids(ckpt)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        ours = layer_scales(llm)
        ours_lp = teacher_forced_logprobs(llm, ids)
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        ours_params = {n for n, _ in model.named_parameters() if n.endswith("_scale")}
    with vllm_engine(ckpt) as llm:
        stock = layer_scales(llm)
        stock_lp = teacher_forced_logprobs(llm, ids)
    assert ours_params == set()  # no scale parameters were created
    assert sorted(ours) == sorted(stock)
    for name in ours:
        assert ours[name].kv_cache_dtype == stock[name].kv_cache_dtype == "auto"
        assert ours[name].pool_dtype == stock[name].pool_dtype
        assert ours[name].k == stock[name].k == 1.0
    assert ours_lp == stock_lp


def test_explicit_kv_cache_dtype_wins(tiny):
    ckpt = tiny("default", num_layers=2)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="bfloat16") as llm:
        scales = layer_scales(llm)
    for s in scales.values():
        assert s.kv_cache_dtype == "bfloat16" and not s.pool_is_fp8
        assert s.source == "unscaled"


@follows_cpu_fp8
def test_corrupt_scales_fail_naming_every_tensor(tiny):
    bad = {0: (0.0, 2.0), 1: (-2.0, 2.0), 2: (2.0, math.nan), 3: (math.inf, 2.0), 4: (2.0, 2.0)}
    malformed = {
        "model.layers.4.self_attn.k_scale": torch.tensor([3], dtype=torch.int32),
        "model.layers.4.self_attn.v_scale": torch.tensor([2.0, 2.0]),
    }
    ckpt = tiny("corrupt", num_layers=5, scales=bad, extra_tensors=malformed)
    # An explicit FP8 cache: the refusal comes at load, before vLLM's CPU checks it.
    with pytest.raises(CorruptScaleError) as info:
        with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8"):
            pass
    text = str(info.value)
    for expected in (
        "model.layers.0.self_attn.k_scale",
        "model.layers.1.self_attn.k_scale",
        "model.layers.2.self_attn.v_scale",
        "model.layers.3.self_attn.k_scale",
        "model.layers.4.self_attn.k_scale: dtype torch.int32",
        "model.layers.4.self_attn.v_scale: shape (2,)",
    ):
        assert expected in text, text
    assert "model.layers.0.self_attn.v_scale" not in text  # 2.0 is fine


@needs_fp8_cpu_cache
def test_an_engine_that_failed_to_start_leaves_no_state_behind(tiny):
    # A half-built engine used to leave vLLM's distributed state behind, and the next
    # MoE engine in the process failed ("expert parallel group is not initialized").
    with pytest.raises(CorruptScaleError):
        ckpt = tiny("corrupt-first", num_layers=2, scales={0: (math.nan, 1.0), 1: (1.0, 1.0)})
        with vllm_engine(ckpt, quantization="kvscale"):
            pass
    ckpt = tiny("moe-after-failure", family="qwen3_moe", num_layers=2)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(ckpt))


def test_no_quantization_config_gives_clear_error(tiny):
    ckpt = tiny("plain", kv_cache_scheme=None, quantization_config=False)
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        with vllm_engine(ckpt, quantization="kvscale"):
            pass


@needs_fp8_cpu_cache
def test_reload_dummy_then_real_then_new_scales(tiny):
    first = tiny("default", num_layers=2)
    second = tiny("reload-b", num_layers=2, scales={0: (5.5, 6.5), 1: (7.25, 8.75)})
    with vllm_engine(first, quantization="kvscale", load_format="dummy") as llm:
        dummy = layer_scales(llm)
        assert all(s.k == 1.0 for s in dummy.values())  # sentinel, never random values

        reload_weights(llm, first)
        real = layer_scales(llm)
        assert_scales_equal_checkpoint(real, read_stored_scales(first))

        for _ in range(3):  # repeated reloads: no compounding, same buffers
            reload_weights(llm, second)
            again = layer_scales(llm)
            assert_scales_equal_checkpoint(again, read_stored_scales(second))
            for name, s in again.items():
                assert (s.k_ptr, s.v_ptr) == (dummy[name].k_ptr, dummy[name].v_ptr)
        reload_weights(llm, first)
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(first))


@needs_fp8_cpu_cache
def test_scheme_with_omitted_fields_uses_library_defaults(tiny, caplog):
    # Real checkpoints sometimes omit strategy / symmetric / dynamic.
    ckpt = tiny("minimal-scheme", kv_cache_scheme={"num_bits": 8, "type": "float"})
    caplog.set_level("INFO", logger="kvscale_plugin")
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
    assert_scales_equal_checkpoint(scales, read_stored_scales(ckpt))
    assert all(s.pool_is_fp8 for s in scales.values())
    assumed = [r.getMessage() for r in caplog.records if "defaults assumed" in r.getMessage()]
    assert assumed and "strategy=tensor" in assumed[0] and "symmetric=true" in assumed[0]
    # Stock vLLM 0.32 refuses the same checkpoint.
    with pytest.raises(ValueError, match="valid QuantizationStrategy|symmetric"):
        with vllm_engine(ckpt):
            pass


@needs_fp8_cpu_cache
def test_reload_legacy_kv_scale_leaves_no_stale_v(tiny):
    big = tiny("kv_scale-big", naming="kv_scale", scales={0: (6.0, 6.0), 1: (7.0, 7.0)})
    small = tiny("kv_scale-small", naming="kv_scale", scales={0: (2.5, 2.5), 1: (3.5, 3.5)})
    with vllm_engine(big, quantization="kvscale") as llm:
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(big))
        reload_weights(llm, small)  # v must follow the new k, not keep 6.0 / 7.0
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(small))


@needs_fp8_cpu_cache
def test_reload_on_fnuz_doubles_once(tiny, monkeypatch):
    from kvscale_plugin.hosts.vllm import method as _vllm_impl

    ckpt = tiny("default", num_layers=2)
    stored = read_stored_scales(ckpt)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        # Pretend to be an FP8-fnuz platform (ROCm MI300) for the reloads only.
        monkeypatch.setattr(_vllm_impl.current_platform, "is_fp8_fnuz", lambda: True)
        for _ in range(3):
            reload_weights(llm, ckpt)
            for name, s in layer_scales(llm).items():
                want = stored[layer_index(name)]
                assert (s.k, s.k_float, s.k_cpu) == pytest.approx((2 * want["k"],) * 3, rel=1e-6)
                assert (s.v, s.v_float, s.v_cpu) == pytest.approx((2 * want["v"],) * 3, rel=1e-6)


@needs_fp8_cpu_cache
def test_real_reload_without_scales_after_a_dummy_start_is_reported(tiny, kvscale_warnings):
    """vLLM's in-place reload never calls the KV method of an attention layer that gets
    no tensor; kvscale still says once (per engine) that the reloaded checkpoint declares
    a scheme but carries no scales, instead of keeping 1.0 silently."""
    first = tiny("default", num_layers=2)
    missing = tiny("scales-missing", num_layers=2, write_scales=False)
    with vllm_engine(first, quantization="kvscale", load_format="dummy") as llm:
        assert kvscale_warnings("reloaded weights carry no") == []
        reload_weights(llm, missing)
        assert all(s.k == s.v == 1.0 for s in layer_scales(llm).values())
        said = kvscale_warnings("reloaded weights carry no")
        assert len(said) == 1 and "model.layers.0.self_attn.attn" in said[0], said
        reload_weights(llm, first)  # scales again: loaded, nothing more said
        assert_scales_equal_checkpoint(layer_scales(llm), read_stored_scales(first))
        reload_weights(llm, missing)  # once per engine, not per reload
        assert len(kvscale_warnings("reloaded weights carry no")) == 1
