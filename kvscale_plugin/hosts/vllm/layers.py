"""What vLLM-side modules need to know about kvscale's attention layers, without
importing the Config / Method module (``method.py``): the host's name, the warn-once
scope of MTP drafts, and the marker that tells a kvscale layer apart.

``mtp``, ``reload``, ``cpu_write`` and ``backend`` test layers through this marker, so
``method`` depends on none of them being importable and none of them imports ``method``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscale_plugin.hosts.vllm.method import KVScaleConfig

HOST = "vllm"
#: "warn once" scope of an MTP draft's own warnings (beside its target model's).
DRAFT_SCOPE = "mtp-draft:"


def is_kvscale_layer(layer: object) -> bool:
    """Whether ``layer``'s KV method is kvscale's (its class sets ``is_kvscale = True``).

    ``is True`` rather than truthiness: a mock or an unrelated method with a
    truthy attribute of that name must not route the layer here.
    """
    return getattr(getattr(layer, "quant_method", None), "is_kvscale", False) is True


def kvscale_config(layer: Any) -> KVScaleConfig | None:
    """The kvscale config whose KV method serves ``layer``, or None for any other layer."""
    return layer.quant_method.quant_config if is_kvscale_layer(layer) else None
