"""SGLang's attention layers that read another layer's KV cache (Gemma-3n / Gemma-4
``num_kv_shared_layers``): the rule of ``kvscale_plugin.sharing``, translated to SGLang.

SGLang 0.5.23 builds a sharing layer's ``RadixAttention`` with its *target's* ``layer_id``
(``models/gemma3n_causal.py``, ``models/gemma4_causal.py``: it reads the target's KV-pool
slot and writes nothing) and with ``quant_config``, so kvscale's KV method gives it
placeholders of its own, under its own name (``model.layers.N.self_attn.attn``), and a
record whose ``target`` is that layer. The
backends that apply KV scales (triton, intel_amx) dequantize the target's FP8 bytes with
the sharer's own ``k_scale`` / ``k_scale_float``: 1.0 in stock SGLang, or whatever the
checkpoint ships under the sharer's name. kvscale serves the target's resolved scales
instead, when the sharer is processed (targets come first in SGLang's module order) and
again at the end of every load cycle (``method._end_cycle``).

A layer shares when the layer index in its name differs from its ``layer_id`` and a layer
of that index was built (a draft's layer whose ``layer_id`` is past the stack, as MTP
drafts number theirs, has no such layer). The Gemma-4 assistant drafter is not covered:
SGLang rebinds its layers' ``layer_id`` after the KV pool is allocated
(``gemma4_mtp.bind_frozen_kv_context``), long after loading.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_INDEX = re.compile(r"layers\.(\d+)\.")


def sharing_target(name: str, layer: Any, built: Mapping[str, Any]) -> str | None:
    """The name of the layer whose cache ``layer`` (called ``name``) reads, or None."""
    match = _INDEX.search(name)
    layer_id = getattr(layer, "layer_id", None)
    if match is None or not isinstance(layer_id, int) or int(match[1]) == layer_id:
        return None
    target = f"{name[: match.start()]}layers.{layer_id}.{name[match.end() :]}"
    return target if target in built else None
