"""FP8 KV-cache write: the Triton kernel and its plain-torch reference.

Importing this package imports ``triton`` when it is installed (without it, as in
vLLM's CPU build, only the plain-torch modules ``reference`` and ``cpu_cache_write``
are available); nothing in the package root imports it, so hosts without Triton
(and the CPU tests that must set ``TRITON_INTERPRET`` first) decide when it is loaded.

One op per module: ``triton_fp8_write`` (the fused Triton kernel and its launcher,
``fp8_cache_write``), ``reference`` (the plain-torch oracle), ``cpu_cache_write`` (the
exact FP8 write into vLLM's CPU cache layout, plain torch) and ``cpu_native`` (the same
write compiled from ``cpu_fp8_write.c`` on first use; the default on vLLM's CPU build).
"""

try:
    from kvscale_plugin.kernels.triton_fp8_write import (
        CONVERSION_ENV,
        Conversion,
        fp8_cache_write,
        use_hardware_conversion,
    )
except ModuleNotFoundError as exc:
    # vLLM's CPU build does not install triton: the plain-torch modules
    # (reference, cpu_cache_write) must stay importable without it.
    if exc.name != "triton":
        raise
from kvscale_plugin.kernels.reference import fp8_cache_write_reference, quantize_e4m3_reference

__all__ = [
    "CONVERSION_ENV",
    "Conversion",
    "fp8_cache_write",
    "fp8_cache_write_reference",
    "quantize_e4m3_reference",
    "use_hardware_conversion",
]
