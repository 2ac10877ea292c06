"""Pipeline parallelism (PP=2, multiprocessing executor, vLLM's CPU build) and what the
CPU build says to ``LLM(data_parallel_size=2)``.

PP=2 runs in a fresh interpreter (``_multiproc_pp.py``): the plugin is found through its
entry point in every process, and each pipeline rank is asked for the scales it holds
(``llm.apply_model``, read inside the workers). Data parallelism through the OpenAI
server is in ``test_vllm_serving.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _run_script import run_script
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.probe import (
    layer_index,
    logprob_error,
    teacher_forced_logprobs,
    vllm_engine,
)
from kvscale_testing.skips import needs_fp8_cpu_cache

pytestmark = pytest.mark.engine


def _run_multiproc(ckpt: Path, ids: list[int], mode: str, size: int, tmp_path: Path) -> dict:
    args = (str(ckpt), json.dumps(ids), mode, str(size))
    return run_script("_multiproc_pp.py", *args, tmp_path=tmp_path)


@needs_fp8_cpu_cache
def test_pipeline_parallel_ranks_hold_their_layers_scales(tiny, tmp_path):
    ckpt = tiny("calibrated", num_layers=3)
    ids = list(reference_token_ids(ckpt))
    stored = read_stored_scales(ckpt)
    with vllm_engine(ckpt, kv_cache_dtype="bfloat16") as llm:
        reference = teacher_forced_logprobs(llm, ids)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        tp1 = teacher_forced_logprobs(llm, ids)

    result = _run_multiproc(ckpt, ids, "pp", 2, tmp_path)
    ranks = result["scales"]
    assert len(ranks) == 2  # one answer per pipeline stage
    held = [sorted(layer_index(name) for name in rank) for rank in ranks]
    # vLLM splits 3 layers as [0, 1] | [2]: each rank holds exactly its layers' scales.
    assert sorted(i for layers in held for i in layers) == sorted(stored)
    assert all(layers for layers in held) and not set(held[0]) & set(held[1]), held
    for rank in ranks:
        for name, (k, v) in rank.items():
            assert k == pytest.approx(stored[layer_index(name)]["k"], rel=1e-6), name
            assert v == pytest.approx(stored[layer_index(name)]["v"], rel=1e-6), name

    pp_mean, pp_max = logprob_error(result["logprobs"], reference)
    tp_mean, tp_max = logprob_error(tp1, reference)
    same_mean, same_max = logprob_error(result["logprobs"], tp1)
    print(
        f"PP=2 ranks hold layers {held}; mean|dlogprob| vs bf16 cache: PP=2 {pp_mean:.4f} "
        f"(max {pp_max:.3f}), TP=1 {tp_mean:.4f} (max {tp_max:.3f}); PP=2 vs TP=1 "
        f"{same_mean:.2e} (max {same_max:.2e})"
    )
    assert pp_mean < 0.03
    assert pp_mean <= tp_mean + 0.005 and same_max < 0.05


def test_llm_data_parallel_is_refused_by_vllm(tiny):
    """vLLM 0.32 refuses ``LLM(data_parallel_size=2)`` before building anything (on every
    platform but TPU, unless ``distributed_executor_backend="external_launcher"``); the
    server's ``--data-parallel-size`` is the supported path (test_vllm_serving.py)."""
    ckpt = tiny("calibrated", num_layers=3)
    from vllm import LLM

    with pytest.raises(ValueError, match=r"data_parallel_size=2\) is not supported for single-"):
        LLM(model=str(ckpt), quantization="kvscale", data_parallel_size=2)
