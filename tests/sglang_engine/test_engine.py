"""``sglang.Engine(..., quantization="kvscale")`` on a CPU: three Engine starts in all.

1. ``attention_backend="torch_native"`` (the one SGLang backend that computes right on
   this CPU), ``kv_cache_dtype="auto"``: the Engine serves. Proven in the scheduler
   process (the test-only probe plugin reports from there): kvscale is registered, its
   config and KV method are on every attention layer, kvscale's record of each layer's
   checkpoint k/v scales equals what the checkpoint stores; torch_native ignores KV
   scales, so kvscale kept the cache in bf16 (one warning naming the backend) instead of
   picking FP8; prompt and decode logprobs match HF transformers' bf16 forward.
2. ``attention_backend="triton"`` (applies KV scales), ``kv_cache_dtype="auto"``:
   kvscale turns ``auto`` into FP8 in the scheduler, the layers hold the checkpoint's
   scales as served, and SGLang refuses the FP8 pool on a CPU without AMX with its own
   text (skipped on a CPU with AMX: SGLang would then want its intel_amx backend and the
   real sgl_kernel CPU ops). The Triton backend is never built: the refusal comes first.
3. ``torch_native`` with an explicit ``kv_cache_dtype="fp8_e4m3"``: kvscale refuses to
   start, naming the backend (hosts/sglang/backends.py).

Not proven here: FP8 attention with the scales applied (no FP8 pool on this CPU).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids

#: Distinct per-layer (k, v) scales, exact in float32 (as tests/sglang_host uses).
SCALES = {0: (3.25, 2.5), 1: (4.75, 2.125)}
#: Prompt / decode logprobs of SGLang's CPU bf16 forward against transformers' bf16
#: forward (different kernels, both bf16): measured max |diff| 0.004 (prompt) and
#: 0.008 (decode) on this model; about 4x that is allowed.
LOGPROB_TOL = 0.03
NEW_TOKENS = 4
AMX_REFUSAL = "CPU FP8 KV cache requires Intel AMX support."


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return tiny("sgl-engine-llama", family="llama", scales=SCALES)


@pytest.fixture(scope="module")
def prompt(checkpoint) -> list[int]:
    return list(reference_token_ids(checkpoint))


@pytest.fixture(scope="module")
def served(run_engine, checkpoint, prompt):
    run = run_engine("torch-native-auto", checkpoint, prompt, NEW_TOKENS)
    assert run.error is None, f"{run.error}\n{run.log[-4000:]}"
    return run


@pytest.fixture(scope="module")
def fp8_asked(run_engine, checkpoint, prompt):
    from sglang.srt.utils import cpu_has_amx_support

    if cpu_has_amx_support():  # checked before the Engine start it would waste
        pytest.skip(
            "this CPU has AMX: SGLang would serve the FP8 cache through its intel_amx "
            "backend, which needs the real sgl_kernel CPU ops (this suite has a stand-in)"
        )
    return run_engine("triton-auto", checkpoint, prompt, NEW_TOKENS, attention_backend="triton")


def stored(checkpoint) -> dict[int, tuple[float, float]]:
    return {i: (s["k"], s["v"]) for i, s in read_stored_scales(checkpoint).items()}


def hf_logprobs(checkpoint, token_ids: list[int]) -> torch.Tensor:
    """log_softmax of transformers' bf16 logits (float32), one row per position."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(checkpoint))
    # Without the KV-only compressed-tensors config, or transformers would attach
    # compressed-tensors' own KV fake-quantization to attention.
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        str(checkpoint), config=config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0]
    return logits.float().log_softmax(-1)


def layers_by_id(probe: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {layer["layer_id"]: layer for layer in probe["layers"].values()}


def test_kvscale_runs_in_the_scheduler_process(served, checkpoint):
    probe = served.probe
    assert probe, f"the probe plugin wrote nothing in the scheduler\n{served.log[-4000:]}"
    # The report comes from another process than the Engine's caller (and this one).
    assert probe["pid"] not in (served.result["pid"], os.getpid())
    assert probe["kvscale_registered"] is True
    assert probe["quant_config"] == "KVScaleConfig"
    layers = layers_by_id(probe)
    assert sorted(layers) == sorted(stored(checkpoint))
    assert {layer["method"] for layer in layers.values()} == {"KVScaleKVCacheMethod"}
    assert probe["kv_cache_dtype"] == "torch.bfloat16"
    assert probe["attn_backend"] == "TorchNativeAttnBackend"


def test_scheduler_layers_hold_the_checkpoint_scales(served, checkpoint):
    """kvscale's record of what each layer loaded is exactly the checkpoint's; on the
    scale-blind torch_native backend the cache stays bf16 and the scales served are 1.0."""
    warnings = [line for line in served.log.splitlines() if "kvscale keeps the KV cache" in line]
    assert len(warnings) == 1, served.log[-4000:]
    assert "torch_native" in warnings[0]
    layers = layers_by_id(served.probe)
    for i, (k, v) in stored(checkpoint).items():
        layer = layers[i]
        assert layer["kvscale_raw"] == {"k_scale": k, "v_scale": v}, layer
        assert (layer["k_scale"], layer["v_scale"]) == (1.0, 1.0), layer
        assert layer["kvscale_source"] == "unscaled", layer


def test_prompt_and_decode_logprobs_match_transformers(served, checkpoint, prompt):
    result = served.result
    out = result["output_token_logprobs"]
    assert len(out) == NEW_TOKENS
    generated = [tok for _, tok in out]
    sequence = prompt + generated
    reference = hf_logprobs(checkpoint, sequence)

    prompt_lp = result["input_token_logprobs"]
    # SGLang 0.5.23 reports the vocabulary's last id as 0 among the prompt's token ids
    # (its logprob is still that token's: checked below); every other id is echoed.
    last_id = len(reference[0]) - 1
    echoed = [tok if tok != last_id else 0 for tok in prompt]
    assert [tok for _, tok in prompt_lp] == echoed
    assert prompt_lp[0][0] is None  # no logprob for the first token
    diffs = []
    for pos in range(1, len(sequence)):
        got = prompt_lp[pos][0] if pos < len(prompt) else out[pos - len(prompt)][0]
        diffs.append(abs(got - float(reference[pos - 1, sequence[pos]])))
    worst = max(diffs)
    print(
        f"\nEngine start {result['start_s']:.1f} s; {len(diffs)} logprobs vs transformers "
        f"bf16: max |diff| {worst:.4f} (prompt {max(diffs[: len(prompt) - 1]):.4f}, "
        f"decode {max(diffs[len(prompt) - 1 :]):.4f})"
    )
    assert worst < LOGPROB_TOL, diffs
    # Greedy decode: each generated token is transformers' argmax, or within bf16 noise
    # of it (a tiny random model can have near-ties; measured: always the argmax).
    for j, tok in enumerate(generated):
        row = reference[len(prompt) - 1 + j]
        assert float(row.max() - row[tok]) < LOGPROB_TOL, (j, tok, int(row.argmax()))


def test_fp8_cache_is_refused_on_a_cpu_without_amx(fp8_asked, checkpoint):
    """``auto`` with the checkpoint's FP8 scheme on a backend that applies KV scales:
    kvscale picks FP8 in the scheduler, the layers hold the checkpoint scales as served,
    and SGLang refuses the FP8 pool here."""
    run = fp8_asked
    assert run.error is not None, "the Engine started with an FP8 KV cache on a CPU without AMX"
    assert AMX_REFUSAL in run.log, run.log[-4000:]
    probe = run.probe
    assert probe["pid"] != run.result["pid"]
    assert probe["kv_cache_dtype"] == "torch.float8_e4m3fn"
    layers = layers_by_id(probe)
    for i, (k, v) in stored(checkpoint).items():
        layer = layers[i]
        assert (layer["k_scale"], layer["v_scale"]) == (k, v), layer
        assert (layer["k_scale_float"], layer["v_scale_float"]) == (k, v), layer
        assert layer["kvscale_source"] == "checkpoint", layer


def test_explicit_fp8_on_a_scale_blind_backend_is_refused(run_engine, checkpoint, prompt):
    run = run_engine("torch-native-fp8", checkpoint, prompt, kv_cache_dtype="fp8_e4m3")
    assert run.error is not None, "an FP8 cache on torch_native started"
    assert "--kv-cache-dtype fp8_e4m3 with --quantization kvscale" in run.log, run.log[-4000:]
    assert "torch_native attention backend" in run.log
    assert AMX_REFUSAL not in run.log  # kvscale refused first, while the model loaded
    assert "kv_cache_dtype" not in run.probe  # the scheduler never got to the pool
