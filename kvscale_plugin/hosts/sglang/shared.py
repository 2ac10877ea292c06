"""SGLang's attention layers that read another layer's KV cache (Gemma-3n / Gemma-4
``num_kv_shared_layers``): the rule of ``kvscale_plugin.sharing``, translated to SGLang.

SGLang 0.5.23 builds a sharing layer's ``RadixAttention`` with its *target's* ``layer_id``
(``models/gemma3n_causal.py``, ``models/gemma4_causal.py``: it reads the target's KV-pool
slot and writes nothing) and with ``quant_config``, so kvscale's KV method gives it
placeholders of its own, under its own name (``model.layers.N.self_attn.attn``). The
backends that apply KV scales (triton, intel_amx) dequantize the target's FP8 bytes with
the sharer's own ``k_scale`` / ``k_scale_float``: 1.0 in stock SGLang, or whatever the
checkpoint ships under the sharer's name. kvscale serves the target's resolved scales
instead, when the sharer is processed (targets come first in SGLang's module order) and
again at the end of every load cycle.

A layer shares when the layer index in its name differs from its ``layer_id`` and a layer
of that index was built (a draft's layer whose ``layer_id`` is past the stack, as MTP
drafts number theirs, has no such layer). The Gemma-4 assistant drafter is not covered:
SGLang rebinds its layers' ``layer_id`` after the KV pool is allocated
(``gemma4_mtp.bind_frozen_kv_context``), long after loading.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from kvscale_plugin._log import warn_once
from kvscale_plugin.scales import CorruptScales, ResolvedScales, unscaled
from kvscale_plugin.sharing import SharedLayers

_INDEX = re.compile(r"layers\.(\d+)\.")


def sharing_target(name: str, layer: Any, built: Mapping[str, Any]) -> str | None:
    """The name of the layer whose cache ``layer`` (called ``name``) reads, or None."""
    match = _INDEX.search(name)
    layer_id = getattr(layer, "layer_id", None)
    if match is None or not isinstance(layer_id, int) or int(match[1]) == layer_id:
        return None
    target = f"{name[: match.start()]}layers.{layer_id}.{name[match.end() :]}"
    return target if target in built else None


def serve_target(
    notes: SharedLayers,
    state: Any,
    target: Any,
    loaded: Mapping[str, float | tuple[float, ...]],
    own_corrupt: CorruptScales,
    on_disk: Mapping[str, str],
) -> ResolvedScales:
    """What a sharing layer serves (its target's scales in force; unscaled until the
    target served), noting what the checkpoint shipped under the layer's own name
    (corrupt tensors named as on disk: ``on_disk``, parameter -> checkpoint name)."""
    resolved = getattr(target, "resolved", None) or unscaled()

    def values(kind: str) -> tuple[float, ...] | None:
        value = loaded.get(kind)
        return None if value is None else value if isinstance(value, tuple) else (value,)

    notes.note_own_scales(state.name, target.name, values("k_scale"), values("v_scale"), resolved)
    if own_corrupt:
        notes.note_unused_corrupt(own_corrupt.renamed(on_disk).as_mapping())
        own_corrupt.clear()
    return resolved


def finish_cycle(
    notes: SharedLayers,
    states: Mapping[str, Any],
    write: Callable[[Any, ResolvedScales], None],
    scope: str = "",
) -> None:
    """At the end of a load cycle: every sharing layer holds what its target serves now
    (``write(state, resolved)``), then the notes, once per engine and cause."""
    for state in list(states.values()):
        target = states.get(state.target) if state.target else None
        if target is not None and target.resolved is not None:
            write(state, target.resolved)
    for i, message in enumerate(notes.warnings()):
        warn_once(f"{scope}sglang-shared-kv-{i}", "%s", message)
