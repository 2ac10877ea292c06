"""The tests' and benchmarks' in-process vLLM engine: ``kvscale demo``'s engine
(``kvscale_plugin.demo.probe``), with every attention layer read back in full -- the
scale tensors, floats and host copies, per-head values, the data pointers (in-place
reloads), kvscale's resolution and the layer's module path.

What the demo's probe offers (``ENGINE_DEFAULTS``, ``KV_CACHE_BYTES``, ``FP8_CPU_REFUSAL``,
``layer_index``, ``teacher_forced_logprobs``, ``logprob_error``, ``shutdown``) is
re-exported here: tests import their engine harness from this one module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any

from kvscale_plugin.demo import probe
from kvscale_plugin.demo.probe import (
    ENGINE_DEFAULTS,
    FP8_CPU_REFUSAL,
    KV_CACHE_BYTES,
    layer_index,
    logprob_error,
    shutdown,
    teacher_forced_logprobs,
)

__all__ = [
    "ENGINE_DEFAULTS",
    "FP8_CPU_REFUSAL",
    "KV_CACHE_BYTES",
    "LayerScales",
    "context_layer_scales",
    "layer_index",
    "layer_scales",
    "logprob_error",
    "shutdown",
    "teacher_forced_logprobs",
    "vllm_engine",
]


@dataclass(frozen=True)
class LayerScales(probe.LayerScales):
    """What one attention layer holds after loading: the demo's view (``name``, ``k`` /
    ``v`` from the device tensors, ``pool_dtype``) and the rest."""

    k_float: float  # Python floats (read by the CPU backend)
    v_float: float
    k_cpu: float  # host copies
    v_cpu: float
    kv_cache_dtype: str  # the layer's resolved cache dtype string ("fp8", "bfloat16", ...)
    source: str | None  # kvscale's resolution ("checkpoint", "duplicated", ...), None if stock
    k_ptr: int
    v_ptr: int
    # Every value of the device tensors: one per local KV head for per-head layers.
    k_heads: tuple[float, ...] = ()
    v_heads: tuple[float, ...] = ()
    #: Where the layer sits in the model (its scale parameters' parent), where a kvscale
    #: engine recorded it (``hosts/vllm/scalepaths``); None otherwise.
    path: str | None = None


@contextmanager
def vllm_engine(model_dir: str | os.PathLike[str], **kwargs: Any) -> Iterator[Any]:
    """The demo's in-process ``vllm.LLM`` (same arguments); an engine that refused to
    start keeps full ``LayerScales`` in ``exc.kvscale_loaded_scales``."""
    with probe.vllm_engine(model_dir, read_layers=context_layer_scales, **kwargs) as llm:
        yield llm


def layer_scales(llm: Any) -> dict[str, LayerScales]:
    """Per-layer scales as the engine holds them (device tensor, float, CPU copy)."""
    return probe.layer_scales(llm, read_layers=context_layer_scales)  # type: ignore[return-value]


def context_layer_scales(context: dict[str, Any]) -> dict[str, LayerScales]:
    """``layer_scales`` of an engine's static forward context (also one that failed): the
    demo's view of each layer, and the rest."""
    from kvscale_plugin.hosts.vllm.scalepaths import module_path
    from kvscale_plugin.loadcycle import layer_record

    out = {}
    for name, shown in probe.context_layer_scales(context).items():
        layer = context[name]
        out[name] = LayerScales(
            **asdict(shown),
            k_float=float(layer._k_scale_float),
            v_float=float(layer._v_scale_float),
            k_cpu=float(layer._k_scale_cpu),
            v_cpu=float(layer._v_scale_cpu),
            kv_cache_dtype=str(layer.kv_cache_dtype),
            source=getattr(layer_record(layer), "source", None),
            k_ptr=layer._k_scale.data_ptr(),
            v_ptr=layer._v_scale.data_ptr(),
            k_heads=tuple(float(x) for x in layer._k_scale.reshape(-1).tolist()),
            v_heads=tuple(float(x) for x in layer._v_scale.reshape(-1).tolist()),
            path=found[1] if (found := module_path(layer)) is not None else None,
        )
    return out
