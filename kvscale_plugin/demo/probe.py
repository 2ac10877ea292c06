"""A real in-process vLLM engine for ``kvscale demo``, and what its attention layers loaded.

In-process mode (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) lets a caller read the
attention layers directly from the engine's forward context.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

#: KV cache size for the tiny models: explicit, or start-up fails on memory utilization.
KV_CACHE_BYTES = 64 * 2**20
#: What every engine here shares: small pools, bf16, short context, deterministic.
ENGINE_DEFAULTS: dict[str, Any] = dict(
    kv_cache_memory_bytes=KV_CACHE_BYTES,
    block_size=32,
    dtype="bfloat16",
    max_model_len=512,
    seed=0,
)


@dataclass(frozen=True)
class LayerScales:
    """What one attention layer holds after loading (what the demo shows of it)."""

    name: str
    k: float  # device tensor (read by kernels)
    v: float
    pool_dtype: torch.dtype | None  # dtype of the allocated KV cache tensor

    @property
    def pool_is_fp8(self) -> bool:
        # The CPU backend stores FP8 as uint8.
        return self.pool_dtype in (torch.uint8, torch.float8_e4m3fn)


def prepare_in_process_env() -> None:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


@contextmanager
def vllm_engine(
    model_dir: str | os.PathLike[str],
    *,
    quantization: str | None = None,
    kv_cache_dtype: str = "auto",
    load_format: str = "auto",
    read_layers: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    **extra: Any,
) -> Iterator[Any]:
    """An in-process ``vllm.LLM`` on ``model_dir``, torn down on exit.

    ``read_layers``: what to keep of the layers of an engine that refused to start
    (``exc.kvscale_loaded_scales``); ``context_layer_scales`` by default."""
    prepare_in_process_env()
    from vllm import LLM

    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        load_format=load_format,
        enforce_eager=True,
        **ENGINE_DEFAULTS,
    )
    kwargs.update(extra)
    configs: list[Any] = []
    try:
        with _record_engine_configs() as configs:
            llm = LLM(**kwargs)
    except BaseException as exc:
        # vLLM refuses some caches (an FP8 cache on a CPU without AVX-512 / AMX) only
        # after the model and its KV scales loaded: keep what the layers hold for the
        # caller (``exc.kvscale_loaded_scales``), read before the teardown below.
        if configs:
            context = configs[-1].compilation_config.static_forward_context
            read = read_layers or context_layer_scales
            exc.kvscale_loaded_scales = read(context)  # type: ignore[attr-defined]
        # A half-built engine leaves vLLM's distributed state behind: the next MoE engine
        # in this process would then fail ("expert parallel group is not initialized").
        from vllm.distributed import cleanup_dist_env_and_memory

        gc.collect()
        cleanup_dist_env_and_memory()
        raise
    try:
        yield llm
    finally:
        shutdown(llm)


def shutdown(llm: Any) -> None:
    """vLLM's own teardown of the in-process engine; the distributed state and memory
    are cleaned up again only where that left them behind (an older vLLM, a half-built
    engine). Each full garbage collection costs ~0.4 s in a process that imported vLLM:
    the cleanup is not repeated when vLLM's shutdown already did it."""
    import torch
    from vllm.distributed import cleanup_dist_env_and_memory

    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001 - best effort: the engine may be half built
        pass
    del llm
    if torch.distributed.is_initialized() or _model_parallel_left():
        gc.collect()
        cleanup_dist_env_and_memory()


def _model_parallel_left() -> bool:
    try:
        from vllm.distributed import model_parallel_is_initialized
    except ImportError:  # pragma: no cover - a vLLM without it: clean up to be safe
        return True
    return bool(model_parallel_is_initialized())


@contextmanager
def _record_engine_configs() -> Iterator[list[Any]]:
    """The configs of engines built inside the block (vLLM's ``create_engine_config``
    wrapped for the block only, then put back: the demo leaves vLLM as it found it)."""
    from vllm.engine.arg_utils import EngineArgs

    original = EngineArgs.__dict__["create_engine_config"]
    seen: list[Any] = []

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        config = original(self, *args, **kwargs)
        seen[:] = [config]
        return config

    EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        EngineArgs.create_engine_config = original  # type: ignore[method-assign]


#: vLLM's refusal of an FP8 KV cache on a CPU without AVX-512 / AMX.
FP8_CPU_REFUSAL = "FP8 KV cache on CPU requires x86 with AVX-512 or AMX"


def layer_scales(
    llm: Any, read_layers: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> dict[str, LayerScales]:
    """Per-layer scales as the engine holds them (``read_layers``: the reader of its static
    forward context; default ``context_layer_scales``)."""
    context = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    return (read_layers or context_layer_scales)(context)


def context_layer_scales(context: dict[str, Any]) -> dict[str, LayerScales]:
    """``layer_scales`` of an engine's static forward context (also one that failed)."""
    out = {}
    for name, layer in context.items():
        if not hasattr(layer, "_k_scale"):
            continue
        out[name] = LayerScales(
            name=name,
            k=float(layer._k_scale.reshape(-1)[0]),
            v=float(layer._v_scale.reshape(-1)[0]),
            pool_dtype=getattr(layer_cache(layer), "dtype", None),
        )
    return out


def layer_cache(layer: Any) -> Any:
    """The layer's KV cache tensor (None before allocation)."""
    cache = layer.kv_cache
    if isinstance(cache, (list, tuple)):
        cache = cache[0] if cache else None
    return cache


def layer_index(name: str) -> int:
    """``model.layers.3.self_attn.attn`` -> 3."""
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


def teacher_forced_logprobs(llm: Any, token_ids: Sequence[int]) -> list[float]:
    """Logprob of each token of ``token_ids`` given its prefix (first token excluded)."""
    from vllm import SamplingParams

    out = llm.generate(
        [{"prompt_token_ids": list(token_ids)}],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    result = []
    for tok, entry in zip(token_ids[1:], out[0].prompt_logprobs[1:], strict=True):
        result.append(float(entry[tok].logprob))
    return result


def logprob_error(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(mean, max) absolute difference between two teacher-forced logprob runs."""
    diffs = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return sum(diffs) / len(diffs), max(diffs)
