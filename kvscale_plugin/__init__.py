"""kvscale-plugin: calibrated per-layer FP8 KV-cache scales for vLLM and SGLang.

The core modules (``scheme``, ``scales``, ``names``, ``hookspecs``,
``checkpoint``, ``kernels``) import no host engine; host adapters live in
``kvscale_plugin.hosts`` and import their host lazily.
"""

from kvscale_plugin.hookspecs import hookimpl, hookspec

__version__ = "0.1.0"
QUANTIZATION_METHOD = "kvscale"

__all__ = ["QUANTIZATION_METHOD", "__version__", "hookimpl", "hookspec"]
