"""vLLM entry point (``vllm.general_plugins: kvscale``).

vLLM loads general plugins in every process (API server, engine core, each
worker), so ``register`` is idempotent. vLLM is imported only inside it; the
classes that subclass vLLM's live in ``method`` (with ``parity``, ``backend`` and
``cpu_write`` beside it) and are imported lazily.
"""

from __future__ import annotations

import threading

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import logger, warn_once

#: vLLM releases this adapter is tested against (it leans on internals that move).
TESTED_VLLM_VERSIONS = ("0.32.0",)

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register the ``kvscale`` quantization method (and the CUSTOM attention backend)."""
    global _registered
    with _lock:
        if _registered:
            return
        import vllm

        from kvscale_plugin.hosts._common import base_version, import_adapter

        found = base_version(getattr(vllm, "__version__", "unknown"))
        method = import_adapter(
            "vLLM", found, TESTED_VLLM_VERSIONS, "kvscale_plugin.hosts.vllm.method"
        )
        method.register_quantization()
        _register_backend()
        _install_cpu_write()
        _registered = True
        logger.debug("kvscale: registered quantization method '%s'", QUANTIZATION_METHOD)


def _register_backend() -> None:
    # The fused Triton cache-write backend is optional: a failure there must not
    # take the scale loading (the part every platform needs) down with it.
    try:
        from kvscale_plugin.hosts.vllm.backend import register_backend

        register_backend()
    except Exception as exc:  # noqa: BLE001 - reported, and scale loading keeps working
        warn_once(
            "vllm-backend",
            "kvscale: the CUSTOM attention backend (fused FP8 cache write) could not be "
            "registered: %s: %s. Scales are still loaded; --attention-backend CUSTOM is "
            "unavailable.",
            type(exc).__name__,
            exc,
        )


def _install_cpu_write() -> None:
    # Round-to-nearest-even FP8 cache write for kvscale layers on vLLM's CPU
    # platform. Optional like the backend: a failure keeps vLLM's own write.
    try:
        from kvscale_plugin.hosts.vllm.cpu_write import install

        install()
    except Exception as exc:  # noqa: BLE001 - reported, and scale loading keeps working
        warn_once(
            "vllm-cpu-write",
            "kvscale: the CPU FP8 cache write could not be installed: %s: %s. Scales are "
            "still loaded; vLLM's own CPU cache write (round toward zero) is used.",
            type(exc).__name__,
            exc,
        )
