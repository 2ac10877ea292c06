"""SGLang host: the entry point (``sglang.srt.plugins: kvscale``).

SGLang's ``load_plugins()`` runs general plugins in every process that calls it
(launcher, engine, scheduler, detokenizer, ...), so ``register`` is idempotent.
SGLang is imported only inside it. The package splits by how the code ages:

* ``method``: the ``kvscale`` quantization method (config, KV-cache method, head
  placement, scale loaders), written to SGLang's quantization extension point.
* ``patches``: the ``HookRegistry`` patches for SGLang 0.5.23's gaps (scale-name
  mapping, attention built without ``quant_config``, Mixtral routing). These wrap
  SGLang internals, so they are what an SGLang upgrade breaks; a moved target is an
  error, never a silent fall-back to stock behaviour.
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
    """Register ``--quantization kvscale`` with SGLang, plus the patches that close its gaps.

    Checks first that every patch target exists in the installed SGLang (a
    ``RuntimeError`` naming the moved targets otherwise, with nothing registered), then
    adds ``kvscale`` to SGLang's quantization registries and CLI choices once and
    registers the ``HookRegistry`` patches. Safe to call any number of times, in any
    process.
    """
    global _registered
    with _lock:
        if _registered:
            return
        import sglang

        from kvscale_plugin.hosts._common import base_version, import_adapter

        found = base_version(getattr(sglang, "__version__", "unknown"))
        method = import_adapter(
            "SGLang", found, TESTED_SGLANG_VERSIONS, "kvscale_plugin.hosts.sglang.method"
        )
        patches = import_adapter(
            "SGLang", found, TESTED_SGLANG_VERSIONS, "kvscale_plugin.hosts.sglang.patches"
        )
        # Before anything is registered: a moved target leaves kvscale unoffered, not
        # half-installed.
        patches.check_targets()
        method.register_quantization()
        patches.register_hooks()
        _registered = True
        logger.debug(
            "kvscale: registered quantization method '%s' with SGLang", QUANTIZATION_METHOD
        )
