"""The FP8 cache ``make bench-rl`` simulates in the trainer's attention
(``kvscale_plugin.calibration.simulate_fp8_cache``) against a real ``-q kvscale`` vLLM
engine with an FP8 cache on the same tiny checkpoint: teacher-forced log-probs of the
same tokens.

Tolerance: the engine computes in bf16 and transformers in float32, so even with no FP8
anywhere the two differ; that difference (a bf16-cache engine vs the unquantized
transformers model) is the noise floor, and the FP8 engine must match the simulation within
twice it plus 0.01 nats (mean over tokens). The scales are small enough that FP8 clips, so
the simulated FP8 effect is several times that tolerance (else the test proves nothing).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.probe import teacher_forced_logprobs, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.calibration.simulate import simulate_fp8_cache

pytestmark = [pytest.mark.engine, needs_fp8_cpu_cache]

SCALES = {0: (0.004, 0.003), 1: (0.005, 0.004)}


def _plain_copy(ckpt: Path, out: Path) -> Path:
    """``ckpt`` without its quantization_config: transformers then runs its own attention
    (with one, compressed-tensors hooks the attention with its own KV quantization)."""
    shutil.copytree(ckpt, out)
    config = json.loads((out / "config.json").read_text())
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config))
    return out


def _hf_logprobs(ckpt: Path, token_ids: list[int], scales: dict | None) -> list[float]:
    from contextlib import nullcontext

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    names = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor([value])
        for i, pair in (scales or {}).items()
        for kind, value in zip("kv", pair, strict=True)
    }
    ids = torch.tensor([token_ids])
    with torch.no_grad(), simulate_fp8_cache(model, names) if scales else nullcontext():
        logits = model(input_ids=ids).logits.float()
    logp = torch.log_softmax(logits[0, :-1], dim=-1)
    return logp.gather(1, ids[0, 1:, None]).squeeze(1).tolist()


def _mean_gap(a: list[float], b: list[float]) -> float:
    return sum(abs(x - y) for x, y in zip(a, b, strict=True)) / len(a)


def test_the_simulated_cache_matches_the_engine(tiny, tmp_path):
    ckpt = tiny("sim-vs-engine", scales=SCALES)
    plain_ckpt = _plain_copy(ckpt, tmp_path / "plain")
    token_ids = list(reference_token_ids(ckpt))[:96]
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="auto") as llm:
        engine_fp8 = teacher_forced_logprobs(llm, token_ids)
    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="bfloat16") as llm:
        engine_bf16 = teacher_forced_logprobs(llm, token_ids)
    sim_fp8 = _hf_logprobs(plain_ckpt, token_ids, SCALES)
    plain = _hf_logprobs(plain_ckpt, token_ids, None)
    floor = _mean_gap(engine_bf16, plain)
    tolerance = 2 * floor + 0.01
    effect = _mean_gap(sim_fp8, plain)
    gap = _mean_gap(engine_fp8, sim_fp8)
    print(f"noise floor {floor:.4f}, FP8 effect {effect:.4f}, engine vs simulation {gap:.4f}")
    assert effect > 3 * tolerance, "FP8 changes too little here: the test proves nothing"
    assert gap <= tolerance
