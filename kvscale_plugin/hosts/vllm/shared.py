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

from typing import Any

import torch

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm.layers import EngineConfig, is_kvscale_layer
from kvscale_plugin.hosts.vllm.served import write_kv_scales
from kvscale_plugin.loadcycle import LayerRecord, attach_record, layer_record
from kvscale_plugin.scales import ResolvedScales


def sharing_target(layer: torch.nn.Module) -> str | None:
    """The layer whose cache ``layer`` reads, or None when it writes its own."""
    target = getattr(layer, "kv_sharing_target_layer_name", None)
    return target if isinstance(target, str) and target else None


def serving(layer: torch.nn.Module | None) -> ResolvedScales | None:
    """The scales ``layer`` serves (None: none yet, or not a layer kvscale served)."""
    record = layer_record(layer) if layer is not None else None
    return record.resolved if record is not None else None


def resync_sharing_layers(layers: list[torch.nn.Module]) -> None:
    """Every sharing layer of ``layers`` holds what its target serves now."""
    by_name = {getattr(layer, "layer_name", None): layer for layer in layers}
    for layer in layers:
        name = sharing_target(layer)
        resolved = serving(by_name.get(name)) if name else None
        if resolved is not None:
            write_kv_scales(layer, resolved)


def finish_load_cycle(cfg: EngineConfig) -> None:
    """At the end of a load cycle: every sharing layer re-synced with its target, then the
    notes, once per engine and cause."""
    resync_sharing_layers(cfg.attention_layers())
    for i, message in enumerate(cfg.shared.warnings()):
        warn_once(f"{cfg.warn_scope}shared-kv-{i}", message)


# -- the Gemma-4 assistant drafter (``gemma4_mtp``, speculative decoding) --------------
#: Where vLLM wires the drafter's Q-only layers to the target's cache, per release:
#: ``Gemma4Proposer`` (0.30-0.33), ``Gemma4Speculator`` (0.34's model runner).
_ASSISTANT_WIRING = (
    ("vllm.v1.spec_decode.gemma4", "Gemma4Proposer"),
    ("vllm.v1.worker.gpu.spec_decode.gemma4.speculator", "Gemma4Speculator"),
)
_WIRED = "__kvscale_follows_targets__"


def follow_targets(layers: dict[str, Any]) -> None:
    """Every attention layer that reads a kvscale layer's cache but has no kvscale KV
    method of its own (the assistant drafter: a bf16 checkpoint, no quantization config)
    holds that layer's scales; given a record (no cycle's) so that reloads re-sync it
    (``layers.engine_layers``)."""
    for name, layer in layers.items():
        target = sharing_target(layer)
        resolved = serving(layers.get(target or ""))
        if resolved is not None and not is_kvscale_layer(layer):
            if layer_record(layer) is None:
                attach_record(layer, LayerRecord(str(name), target=target))
            write_kv_scales(layer, resolved)


def install_assistant_sync() -> None:
    """Idempotent, in an engine whose speculative config is Gemma-4's assistant: after the
    proposer wires its layers to the target's cache (``_setup_gemma4_kv_sharing``; vLLM
    copies no scale there), they hold the target layers' scales."""
    import functools
    import importlib

    from kvscale_plugin.hosts.vllm.patching import replace

    for module, name in _ASSISTANT_WIRING:
        try:
            owner = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue  # not in this release
        original = owner.__dict__.get("_setup_gemma4_kv_sharing")
        if original is None or getattr(original, _WIRED, False):
            continue

        def wire(self: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            result = _original(self, *args, **kwargs)
            follow_targets(dict(self.vllm_config.compilation_config.static_forward_context))
            return result

        functools.update_wrapper(wire, original)
        setattr(wire, _WIRED, True)
        replace(owner, "_setup_gemma4_kv_sharing", wire)


def ensure_assistant_sync() -> None:
    """As each layer is built (``activation.layer_built``; an engine's worker process):
    ``install_assistant_sync`` where the engine drafts with Gemma-4's assistant and the
    ``mtp-drafts`` feature is installed. Never raises: a failure costs the drafter's scales."""
    from vllm.config import get_current_vllm_config_or_none

    from kvscale_plugin.hosts.vllm.patching import ensure

    spec = getattr(get_current_vllm_config_or_none(), "speculative_config", None)
    uses = getattr(spec, "use_gemma4_mtp", None)
    if callable(uses) and uses():
        ensure(
            "mtp-drafts",
            install_assistant_sync,
            "vllm-gemma4-assistant",
            "kvscale: cannot follow the Gemma-4 assistant drafter's layers (%s: %s); they "
            "read the target's FP8 cache at scale 1.0, as in stock vLLM.",
        )
