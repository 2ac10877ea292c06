"""MTP (speculative-decoding draft) layers: their checkpoint KV scales reach the draft's
attention layers (the ``mtp-drafts`` feature: installed by a kvscale engine's config once
its model declares MTP layers, ``ensure_draft_routing``).

vLLM 0.32 builds an MTP draft as its own model (``*_mtp`` model type) from the same
checkpoint, and its drafts route checkpoint names on their own: MiMo's never applies a
quantization config's scale-name mapper and GLM-4-MoE's looks names up in its
parameters, so stock crashes on any MTP-layer scale. kvscale takes the KV-scale tensors
out of the draft's weight stream and loads MTP layer N's into the draft's N-th
attention layer itself, through the same loaders (validation, corrupt-scale record) as
the main stack.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import torch

from kvscale_plugin.hosts.vllm.internals import replace
from kvscale_plugin.hosts.vllm.layers import (
    DRAFT_SCOPE,
    HOST,
    EngineConfig,
    is_kvscale_layer,
)
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.names import map_scale_name, mtp_layer_ordinal
from kvscale_plugin.notices import warn_unmapped_scales

_LAYER_NUMBER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _is_mtp_draft(model_config: Any) -> bool:
    """vLLM 0.32 builds every MTP draft under an ``*_mtp`` model type
    (``SpeculativeConfig.hf_config_override``: ``mimo_mtp``, ``glm4_moe_mtp``,
    ``qwen3_next_mtp``, ``qwen3_5_mtp``, ``deepseek_mtp``, ...)."""
    model_type = getattr(getattr(model_config, "hf_config", None), "model_type", None)
    return isinstance(model_type, str) and model_type.endswith("_mtp")


def _draft_attention_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The draft's kvscale attention layers, in layer order: MTP layer i's is the i-th."""
    layers = [
        module
        for module in model.modules()
        if is_kvscale_layer(module) and hasattr(module, "k_scale")
    ]

    def number(layer: torch.nn.Module) -> int:
        found = _LAYER_NUMBER.findall(str(getattr(layer, "layer_name", "")) + ".")
        return int(found[-1]) if found else -1

    return sorted(layers, key=number)


def _route_draft_scales(weights: Any, layers: list[torch.nn.Module], cfg: EngineConfig) -> Any:
    """Yield ``weights`` minus its KV-scale tensors; load each MTP layer's into the
    draft's attention layer for it, directly through kvscale's loaders.

    vLLM 0.32's MTP drafts route checkpoint names on their own, and some never apply a
    quantization config's scale-name mapper (MiMo's ``AutoWeightsLoader`` finds no
    ``quant_config`` on the model; GLM-4-MoE's ``load_weights`` looks names up in its
    parameters): stock crashes there on any MTP-layer scale. The main stack's scales
    are the target model's and are left out (every draft skips them)."""
    unmapped: set[str] = set()
    for name, tensor in weights:
        mapped = map_scale_name(name, HOST, cfg.model_type)
        if mapped is None:
            yield name, tensor
            continue
        ordinal = mtp_layer_ordinal(name, cfg.num_hidden_layers)
        if ordinal is None or name in cfg.unmapped_scales:
            continue  # the target model's, or already reported by it
        kind = mapped.rsplit(".", 1)[1]
        param = getattr(layers[ordinal], kind, None) if ordinal < len(layers) else None
        loader = getattr(param, "weight_loader", None)
        if param is None or loader is None:
            unmapped.add(name)
            continue
        record = layer_record(layers[ordinal])
        assert record is not None  # built by kvscale's KV method
        records = (record.corrupt, record.corrupt_q)
        for corrupt in records:
            corrupt.forget(name)  # what an earlier load of it said is moot
        loader(param, tensor)
        # The loader names a problem by the draft layer's engine name, which is not in
        # the file: name the checkpoint's tensor instead.
        draft_layer = layers[ordinal].layer_name
        for corrupt in records:
            corrupt.refile(f"{draft_layer}.{kind}", name, note=f"MTP draft layer {draft_layer}")
    if unmapped:
        warn_unmapped_scales(unmapped, f"{cfg.warn_scope}{DRAFT_SCOPE}")


_DRAFT_WRAPPED = "__kvscale_draft_routing__"


def _route_later_loads(
    model: torch.nn.Module, layers: list[torch.nn.Module], cfg: EngineConfig
) -> None:
    """Route every later ``load_weights`` call of this draft too: a weight-sync session
    aimed at the draft (``start_draft_weight_update``; the NCCL engine calls
    ``draft.load_weights`` with the trainer's tensors) meets the same name routing as
    the draft's start-up load. Idempotent; a stream without KV scales passes as is."""
    original = model.load_weights
    if getattr(original, _DRAFT_WRAPPED, False):
        return

    @functools.wraps(original)
    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        return original(_route_draft_scales(weights, layers, cfg), *args, **kwargs)

    setattr(load_weights, _DRAFT_WRAPPED, True)
    replace(model, "load_weights", load_weights)  # this draft model object only


def install_draft_routing() -> None:
    """Idempotent: MTP drafts built by vLLM's default loader get their layers' KV scales
    from kvscale (``_route_draft_scales``), at start-up and in later weight syncs; every
    other model's weights pass untouched."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    original = DefaultModelLoader.get_all_weights
    if getattr(original, _DRAFT_WRAPPED, False):
        return

    def get_all_weights(self: Any, model_config: Any, model: torch.nn.Module) -> Any:
        weights = original(self, model_config, model)
        if not _is_mtp_draft(model_config):
            return weights
        layers = _draft_attention_layers(model)
        if not layers:
            return weights  # no kvscale KV method in this draft: stock behaviour
        for layer in layers:
            layer_record(layer).draft = True  # type: ignore[union-attr]
        cfg = layers[0].quant_method.quant_config
        # The loader has already looked up ``model.load_weights`` for this load (Python
        # evaluates the callee before its argument, this stream): route this stream here,
        # and later loads through the model.
        _route_later_loads(model, layers, cfg)
        return _route_draft_scales(weights, layers, cfg)

    setattr(get_all_weights, _DRAFT_WRAPPED, True)
    get_all_weights.__wrapped__ = original  # type: ignore[attr-defined]
    get_all_weights.__doc__ = original.__doc__
    replace(DefaultModelLoader, "get_all_weights", get_all_weights)


def ensure_draft_routing() -> None:
    """Called by the config once the model declares MTP layers: ``install_draft_routing``
    where the ``mtp-drafts`` feature is active (an engine whose model has no MTP layers
    never gets the loader wrapper). Never raises: a failure costs the drafts' scales only."""
    from kvscale_plugin.hosts.vllm.patching import ensure

    ensure(
        "mtp-drafts",
        install_draft_routing,
        "vllm-mtp-routing",
        "kvscale: MTP draft layers cannot get their checkpoint KV scales on this vLLM "
        "(%s: %s); the draft serves with scale 1.0.",
    )
