"""SGLang entry point (``sglang.srt.plugins: kvscale``).

SGLang's ``load_plugins()`` runs general plugins in every process that calls it
(launcher, engine, scheduler, detokenizer, ...), so ``register`` is idempotent.
SGLang is imported only inside it; the classes that subclass SGLang's and the
hooks live in ``_sglang_impl`` and are imported lazily.
"""

from __future__ import annotations

import threading

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import logger

#: SGLang releases this adapter is tested against (it leans on internals that move).
TESTED_SGLANG_VERSIONS = ("0.5.23",)

_registered = False
_lock = threading.Lock()


def register() -> None:
    """Register ``--quantization kvscale`` with SGLang, plus the hooks that close its gaps.

    Adds ``kvscale`` to SGLang's quantization registries and CLI choices once, and
    registers ``HookRegistry`` hooks (scale-name mapping, attention layers built
    without ``quant_config``). Safe to call any number of times, in any process.
    """
    global _registered
    with _lock:
        if _registered:
            return
        import sglang

        from kvscale_plugin.hosts._common import base_version, import_adapter

        found = base_version(getattr(sglang, "__version__", "unknown"))
        _sglang_impl = import_adapter(
            "SGLang", found, TESTED_SGLANG_VERSIONS, "kvscale_plugin.hosts._sglang_impl"
        )
        _sglang_impl.register_quantization()
        _sglang_impl.register_hooks()
        _registered = True
        logger.debug(
            "kvscale: registered quantization method '%s' with SGLang", QUANTIZATION_METHOD
        )
