"""kvscale-plugin: calibrated per-layer FP8 KV-cache scales for vLLM and SGLang.

The core (``fp8``, ``scheme``, ``scales``, ``names``, ``hookspecs``, ``checkpoint``,
``kernels``, ``inspection``, ``calibration``) imports no host engine
(``tests/unit/test_layout.py`` checks it); host adapters live in ``kvscale_plugin.hosts``
and import their host lazily; ``demo`` is what ``kvscale demo`` runs.
"""

from kvscale_plugin.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
QUANTIZATION_METHOD = "kvscale"

__all__ = ["QUANTIZATION_METHOD", "__version__", "hookimpl", "hookspec"]
