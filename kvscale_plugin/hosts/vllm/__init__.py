"""vLLM entry point (``vllm.general_plugins: kvscale``).

vLLM loads general plugins in every process (API server, engine core, each worker), and
calls each plugin with no try/except: a plugin that raises stops every vLLM start, also
the ones that never asked for kvscale. So ``register`` never raises. It checks every vLLM
internal the adapter touches (``internals.INTERNALS``) before registering anything, then
installs each feature whose targets hold, all or nothing per feature; a missing target
costs only its feature, with one warning. If the core (``scales``) cannot work on this
vLLM, ``kvscale`` is registered as a method that refuses to start, naming the version and
the supported range -- every other engine starts as if kvscale were not installed.

vLLM is imported only inside ``register``; the classes that subclass vLLM's live in
``method`` (with ``parity``, ``reload``, ``mtp``, ``backend`` and ``cpu_write`` beside it)
and are imported lazily.
"""

from __future__ import annotations

import threading

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import follow_host_logging, logger, warn_once

#: vLLM releases this adapter is tested against: run (CPU builds) and checked statically.
TESTED_VLLM_VERSIONS = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register ``--quantization kvscale`` and every feature this vLLM supports.

    Never raises; idempotent; a failed attempt leaves nothing behind, so a second one
    behaves like the first."""
    global _registered
    with _lock:
        if _registered:
            return
        try:
            from kvscale_plugin.hosts.vllm.install import install_all

            # vLLM's own logger does not propagate: show kvscale's INFO lines through
            # its handlers (level: VLLM_LOGGING_LEVEL), as vLLM shows its own.
            follow_host_logging("vllm")
            install_all()
            _registered = True
            logger.debug("kvscale: registered quantization method '%s'", QUANTIZATION_METHOD)
        except Exception as exc:  # noqa: BLE001 - never break the host
            warn_once(
                f"vllm-register:{type(exc).__name__}",
                "kvscale: could not hook into vLLM (%s: %s); vLLM runs as if kvscale-plugin "
                "were not installed (--quantization kvscale is unavailable).",
                type(exc).__name__,
                exc,
            )
