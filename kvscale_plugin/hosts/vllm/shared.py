"""vLLM's attention layers that read another layer's KV cache (``Attention.
kv_sharing_target_layer_name``: Gemma-3n / Gemma-4 ``num_kv_shared_layers``): the rule of
``kvscale_plugin.sharing``, translated to vLLM's layers.

vLLM 0.32 builds such a layer with its own ``_k_scale`` / ``_v_scale`` (1.0) and copies no
scale from the target anywhere (gemma3n.py, gemma4.py, gemma4_mtp.py, v1/spec_decode/
gemma4.py). kvscale gives it the target's resolved scales when it is processed, every
sharing layer again at the end of each load cycle (whatever order vLLM processed them in),
and after every reload (``resync_sharing_layers``, from the worker's reload check): vLLM's
layerwise reload restores a layer that loaded nothing without calling its KV method, while
its target's scales change.
"""

from __future__ import annotations

import torch

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm.layers import EngineConfig, layer_records
from kvscale_plugin.hosts.vllm.served import write_kv_scales
from kvscale_plugin.scales import ResolvedScales, unscaled
from kvscale_plugin.sharing import SharedLayers


def sharing_target(layer: torch.nn.Module) -> str | None:
    """The layer whose cache ``layer`` reads, or None when it writes its own."""
    target = getattr(layer, "kv_sharing_target_layer_name", None)
    return target if isinstance(target, str) and target else None


def serve_target_scales(
    cfg: EngineConfig,
    layer: torch.nn.Module,
    name: str,
    own: tuple[tuple[float, ...] | None, tuple[float, ...] | None],
) -> ResolvedScales:
    """Give a sharing layer its target's scales (the target's resolution; unscaled until
    the target is processed: ``finish_load_cycle`` re-syncs), and note what the checkpoint
    shipped under the layer's own name. Returns what it serves."""
    target = sharing_target(layer)
    assert target is not None
    held = cfg.attention_layer(target)
    resolved = getattr(held, "kvscale_resolved", None) or unscaled()
    write_kv_scales(layer, resolved)
    notes = shared_notes(cfg)
    notes.note_own_scales(name, target, own[0], own[1], resolved)
    corrupt, _ = layer_records(layer)
    if corrupt:
        notes.note_unused_corrupt(cfg.on_disk(corrupt).as_mapping())
        corrupt.clear()
    return resolved


def resync_sharing_layers(layers: list[torch.nn.Module]) -> None:
    """Every sharing layer of ``layers`` holds what its target serves now."""
    by_name = {getattr(layer, "layer_name", None): layer for layer in layers}
    for layer in layers:
        name = sharing_target(layer)
        resolved = getattr(by_name.get(name), "kvscale_resolved", None) if name else None
        if resolved is not None:
            write_kv_scales(layer, resolved)


def finish_load_cycle(cfg: EngineConfig) -> None:
    """At the end of a load cycle: every sharing layer re-synced with its target, then the
    notes, once per engine and cause."""
    resync_sharing_layers(cfg.attention_layers())
    for i, message in enumerate(shared_notes(cfg).warnings()):
        warn_once(f"{cfg.warn_scope}shared-kv-{i}", message)


def shared_notes(cfg: EngineConfig) -> SharedLayers:
    notes = cfg.__dict__.get("kvscale_shared")
    if notes is None:
        notes = cfg.kvscale_shared = SharedLayers()
    return notes
