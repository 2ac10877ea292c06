"""Decisions vLLM 0.32 makes by the quantization *name*: same answers for ``kvscale``
(installed only in a process that builds a kvscale engine).

A compressed-tensors checkpoint served with ``--quantization kvscale`` must get the
decisions stock vLLM makes for it as ``compressed-tensors``. vLLM 0.32 compares the
name against ``"compressed-tensors"`` in these places (found by searching its source
for the string):

* ``ModelConfig.is_nvfp4_quantized`` -- read by ``VllmConfig`` to enable the
  activation-quant fusion pass for NVFP4 checkpoints. Wrapped: for ``kvscale`` it is
  answered exactly as for ``compressed-tensors`` (vLLM's own code, on a view of the
  config whose ``quantization`` says ``compressed-tensors``).
* ``vllm.v1.metrics.perf._QUANT_WEIGHT_BYTE_SIZE`` -- the weight byte size the
  performance metrics assume per method; an unknown name makes the metrics parsers
  raise ``InvalidComponent``. ``kvscale`` gets compressed-tensors' entry.
* The vision towers of ``gemma4_mm``, ``diffusion_gemma`` and ``embedding_gemma2``
  (``quant_config.get_name() in [..., "compressed-tensors"]``) -- inside model
  constructors, not reachable from a plugin. For those architectures kvscale warns
  once (``warn_vision_tower_difference``).

Everything else that tells compressed-tensors apart does so by ``isinstance`` (our
config subclasses vLLM's) or by the checkpoint's own ``quant_method`` (unchanged).
"""

from __future__ import annotations

import threading
from typing import Any

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm.internals import replace, replace_item

STOCK_NAME = "compressed-tensors"
#: Architectures whose constructors decide vision-tower quantization by the name.
VISION_TOWER_BY_NAME = frozenset(
    {
        "Gemma4ForConditionalGeneration",
        "Gemma4UnifiedForConditionalGeneration",
        "DiffusionGemmaForBlockDiffusion",
        "EmbeddingGemma2Model",
    }
)

_lock = threading.Lock()
_WRAPPED = "__kvscale_wrapped__"


class _AsCompressedTensors:
    """A read-only view of a ``ModelConfig`` whose ``quantization`` is the stock name."""

    def __init__(self, config: Any) -> None:
        object.__setattr__(self, "_config", config)

    def __getattr__(self, name: str) -> Any:
        if name == "quantization":
            return STOCK_NAME
        return getattr(self._config, name)


def install() -> None:
    """Idempotent: wrap ``is_nvfp4_quantized`` and add the metrics entry."""
    from vllm.config.model import ModelConfig

    with _lock:
        current = ModelConfig.is_nvfp4_quantized
        if not getattr(current, _WRAPPED, False):
            original = current

            def is_nvfp4_quantized(self: Any) -> bool:
                if self.quantization == QUANTIZATION_METHOD:
                    return original(_AsCompressedTensors(self))
                return original(self)

            setattr(is_nvfp4_quantized, _WRAPPED, True)
            is_nvfp4_quantized.__doc__ = original.__doc__
            is_nvfp4_quantized.__wrapped__ = original  # type: ignore[attr-defined]
            replace(ModelConfig, "is_nvfp4_quantized", is_nvfp4_quantized)

        try:
            from vllm.v1.metrics import perf
        except ImportError:  # metrics module moved: nothing to align
            return
        sizes = getattr(perf, "_QUANT_WEIGHT_BYTE_SIZE", None)
        if isinstance(sizes, dict) and STOCK_NAME in sizes and QUANTIZATION_METHOD not in sizes:
            replace_item(sizes, QUANTIZATION_METHOD, sizes[STOCK_NAME])


def warn_vision_tower_difference(architectures: list[str] | None) -> None:
    """One warning when the model decides vision-tower quantization by the method name."""
    hit = sorted(set(architectures or ()) & VISION_TOWER_BY_NAME)
    if hit:
        warn_once(
            "vision-tower-by-name",
            "kvscale: %s builds its vision tower quantized only when the quantization "
            "method is named 'compressed-tensors' (vLLM 0.32); under 'kvscale' the tower "
            "is quantized only if its sizes are multiples of 64. If the checkpoint "
            "quantizes the vision tower and loading fails, serve it without "
            "--quantization kvscale.",
            ", ".join(hit),
        )
