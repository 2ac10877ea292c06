"""Look inside a running vLLM engine (tests and benchmarks only).

The engine itself comes from ``kvscale_testing.probe.vllm_engine`` (what ``kvscale
demo`` runs); the functions here read or drive what only tests need. The ``apply_model``
/ ``collective_rpc`` targets are pickled by reference: a worker process imports this
module, so it must find ``tests/support`` on its ``sys.path`` (inherited from the
process that starts the engine).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def cpu_runs_fp8_cache() -> bool:
    """Whether vLLM's CPU attention can run an FP8 KV cache here (x86 AVX-512 or AMX)."""
    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def attention_layers(llm: Any) -> dict[str, torch.nn.Module]:
    """An in-process engine's attention layers, by name."""
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return {name: layer for name, layer in ctx.items() if hasattr(layer, "_k_scale")}


def reload_weights(llm: Any, model_dir: str | os.PathLike[str]) -> None:
    """In-place reload of ``model_dir``'s safetensors into the running engine (RL weight sync)."""
    from vllm.model_executor.model_loader.weight_utils import safetensors_weights_iterator

    files = sorted(str(p) for p in Path(model_dir).glob("*.safetensors"))
    llm.collective_rpc(
        "reload_weights", kwargs={"weights_iterator": safetensors_weights_iterator(files, False)}
    )


def model_kv_scales(model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """``llm.apply_model`` target (importable, so it works across processes):
    per attention layer (k, v) device-tensor scales, for whatever process holds the model."""
    return {
        name: (float(m._k_scale.reshape(-1)[0]), float(m._v_scale.reshape(-1)[0]))
        for name, m in model.named_modules()
        if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")
    }


def model_kv_head_scales(
    model: torch.nn.Module,
) -> dict[str, tuple[list[float], list[float], float, float]]:
    """``llm.apply_model`` target: per attention layer, every value of the k and v
    device tensors (one per KV head this rank holds) and the two Python floats."""
    return {
        name: _head_scales(m)
        for name, m in model.named_modules()
        if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")
    }


def _head_scales(layer: torch.nn.Module) -> tuple[list[float], list[float], float, float]:
    return (
        [float(x) for x in layer._k_scale.reshape(-1).tolist()],
        [float(x) for x in layer._v_scale.reshape(-1).tolist()],
        float(layer._k_scale_float),
        float(layer._v_scale_float),
    )


def worker_kv_head_scales(
    worker: Any,
) -> dict[str, tuple[list[float], list[float], float, float, bool]]:
    """``llm.collective_rpc`` target: what ``model_kv_head_scales`` reads, for every
    attention layer the worker's engine registered -- the target model's and a
    speculative-decoding draft's (``apply_model`` sees the target only); the last item
    says whether the layer is an MTP draft layer kvscale loaded."""
    context = worker.vllm_config.compilation_config.static_forward_context
    return {
        name: (*_head_scales(m), bool(getattr(getattr(m, "kvscale_record", None), "draft", False)))
        for name, m in context.items()
        if hasattr(m, "_k_scale") and hasattr(m, "kv_cache_dtype")
    }


def vec_layout_dtype() -> str:
    """The model dtype whose CPU KV cache vLLM keeps in its ``vec`` layout, the one
    kvscale's CPU write serves: bf16, except on a CPU with AMX, where vLLM stores a bf16
    model's cache in its AMX layout (vLLM's own write and kernels there) -- fp16 then."""
    return "float16" if torch.cpu._is_amx_tile_supported() else "bfloat16"


def greedy_with_logprobs(llm: Any, prompt: list[int]) -> tuple[list[int], list[float], int]:
    """Six greedy tokens after ``prompt`` (token ids): the tokens, their log-probs, and how
    many prompt tokens the prefix cache served."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
    [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    completion = out.outputs[0]
    logprobs = [next(iter(step.values())).logprob for step in completion.logprobs]
    return list(completion.token_ids), logprobs, out.num_cached_tokens
