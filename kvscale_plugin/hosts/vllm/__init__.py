"""vLLM entry point (``vllm.general_plugins: kvscale``).

vLLM loads general plugins in every process (API server, engine core, each worker), and
calls each plugin with no try/except: a plugin that raises stops every vLLM start, also
the ones that never asked for kvscale. Operators install kvscale into the image that runs
all their engines, so ``register`` does the least it can: it registers the quantization
method ``kvscale`` through vLLM's public registry (after checking, silently, that the
core's targets resolve; where they do not, ``kvscale`` is registered as a method that
refuses to start, naming the version and the supported range). It patches nothing and
logs nothing: an engine started without ``--quantization kvscale`` runs vLLM's own code.

Everything else -- the features that need a vLLM internal, the notice about an untested
vLLM release -- happens in ``activation.activate``, only in a process that builds a kvscale
engine (the config's constructor and unpickling, and ``override_quantization_method`` when
``-q kvscale`` claims a checkpoint).

vLLM is imported only inside ``register``; the classes that subclass vLLM's live in
``method`` (with ``parity``, ``reload``, ``mtp``, ``backend`` and ``cpu_write`` beside it)
and are imported lazily.
"""

from __future__ import annotations

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import follow_host_logging, logger, warn_once
from kvscale_plugin.hosts.vllm.process import HOST


def register() -> None:
    """Register ``--quantization kvscale`` (nothing else: see the module docstring).

    Never raises; idempotent; a failed attempt leaves nothing behind, so a second one
    behaves like the first."""
    with HOST.lock:
        if HOST.registered:
            return
        try:
            from kvscale_plugin.hosts.vllm.install import register_method

            # vLLM's own logger does not propagate: show kvscale's INFO lines through
            # its handlers (level: VLLM_LOGGING_LEVEL), as vLLM shows its own. (Our own
            # logger's handlers; nothing of vLLM's changes.)
            follow_host_logging("vllm")
            register_method()
            HOST.registered = True
            logger.debug("kvscale: registered quantization method '%s'", QUANTIZATION_METHOD)
        except Exception as exc:  # noqa: BLE001 - never break the host
            warn_once(
                f"vllm-register:{type(exc).__name__}",
                "kvscale: could not hook into vLLM (%s: %s); vLLM runs as if kvscale-plugin "
                "were not installed (--quantization kvscale is unavailable).",
                type(exc).__name__,
                exc,
            )
