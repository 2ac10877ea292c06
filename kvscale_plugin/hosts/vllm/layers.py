"""What vLLM-side modules need to know about kvscale's attention layers, without
importing the Config / Method module (``method.py``): the host's name, the warn-once
scope of MTP drafts, the marker that tells a kvscale layer apart, and what its config
offers them (``EngineConfig``).

``mtp``, ``reload``, ``served``, ``shared``, ``cpu_write`` and ``backend`` test layers
through this marker and type their config as ``EngineConfig``, so none of them imports
``method`` (not even for type checking): the package has no import circle.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin.loadcycle import Cycle, layer_record
from kvscale_plugin.scales import CorruptScales
from kvscale_plugin.scheme import SchemeVerdict
from kvscale_plugin.sharing import SharedLayers

HOST = "vllm"
#: "warn once" scope of an MTP draft's own warnings (beside its target model's).
DRAFT_SCOPE = "mtp-draft:"


class EngineConfig(Protocol):
    """What the vLLM-side modules read of a kvscale engine's config (``method.KVScaleConfig``)."""

    warn_scope: str
    kv_verdict: SchemeVerdict
    model_type: str | None
    num_hidden_layers: int | None
    total_num_kv_heads: int | None
    total_num_heads: int | None
    unmapped_scales: set[str]
    mtp_scales_seen: set[str]
    cycle: Cycle
    shared: SharedLayers
    full_cuda_graphs: bool | None

    def on_disk(self, corrupt: CorruptScales) -> CorruptScales: ...

    def attention_layers(self) -> list[torch.nn.Module]: ...

    def attention_layer(self, name: str) -> torch.nn.Module | None: ...


def is_kvscale_layer(layer: object) -> bool:
    """Whether ``layer``'s KV method is kvscale's (its class sets ``is_kvscale = True``).

    ``is True`` rather than truthiness: a mock or an unrelated method with a
    truthy attribute of that name must not route the layer here.
    """
    return getattr(getattr(layer, "quant_method", None), "is_kvscale", False) is True


def kvscale_config(layer: Any) -> EngineConfig | None:
    """The kvscale config whose KV method serves ``layer``, or None for any other layer."""
    return layer.quant_method.quant_config if is_kvscale_layer(layer) else None


def layer_serves_checkpoint_scales(verdict: SchemeVerdict, layer: Any) -> bool:
    """The one policy (``loadcycle.serves_checkpoint_scales``) for a vLLM attention layer:
    its cache dtype, as vLLM resolved it for that layer, and vLLM's notion of a quantized
    cache; an undeclared scheme with an FP8 cache uses scales, as stock vLLM does."""
    from vllm.v1.kv_cache_interface import is_quantized_kv_cache

    from kvscale_plugin.loadcycle import serves_checkpoint_scales

    dtype = str(layer.kv_cache_dtype)
    return serves_checkpoint_scales(verdict, dtype, quantized=is_quantized_kv_cache(dtype))


def serves_kvscale(owner: Any) -> bool:
    """Whether ``owner`` (an engine core, scheduler or engine client: it holds the
    ``vllm_config``) belongs to a ``-q kvscale`` engine."""
    model_config = getattr(getattr(owner, "vllm_config", None), "model_config", None)
    return getattr(model_config, "quantization", None) == QUANTIZATION_METHOD


def engine_layers(worker: Any) -> list[torch.nn.Module]:
    """Every attention layer of the worker's engine (target and draft) served by kvscale's
    KV method: vLLM registers each in the engine's forward context, by name."""
    return config_layers(getattr(worker, "vllm_config", None))


def config_layers(config: Any) -> list[torch.nn.Module]:
    """``engine_layers`` of the engine whose ``VllmConfig`` is ``config``."""
    context = getattr(getattr(config, "compilation_config", None), "static_forward_context", {})
    return [
        layer
        for layer in dict(context).values()
        if is_kvscale_layer(layer) or layer_record(layer) is not None
    ]
