"""SGLang host: the entry point (``sglang.srt.plugins: kvscale``).

SGLang's ``load_plugins()`` runs general plugins in every process that calls it
(launcher, engine, scheduler, detokenizer, ...), so ``register`` is idempotent.
SGLang is imported only inside it. The package splits by how the code ages:

* ``method``: the ``kvscale`` quantization method (config, KV-cache method, head
  placement, scale loaders), written to SGLang's quantization extension point.
* ``backends``: which SGLang attention backends ignore KV scales, and kvscale's
  decision there (``auto`` keeps the model dtype with one warning; an explicit FP8
  ``--kv-cache-dtype`` is refused), so an FP8 cache is never served at scale 1.0.
* ``patches``: the ``HookRegistry`` patches for SGLang 0.5.23's gaps (scale-name
  mapping, attention built without ``quant_config``, Mixtral routing). These wrap
  SGLang internals, so they are what an SGLang upgrade breaks; a moved target leaves
  ``kvscale`` unoffered (one warning), never a silent fall-back to stock behaviour and
  never an exception into SGLang.
"""

from __future__ import annotations

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import logger, warn_once
from kvscale_plugin.hosts.sglang import state
from kvscale_plugin.hosts.sglang.state import SGLangHost
from kvscale_plugin.releases import SGLANG_RUN, SGLANG_STATIC

#: SGLang releases this adapter is tested against (``kvscale_plugin.releases``): the full
#: suite runs on the first, every patch target is checked in the others' sources.
TESTED_SGLANG_VERSIONS, STATIC_SGLANG_VERSIONS = SGLANG_RUN, SGLANG_STATIC


def register() -> None:
    """Register ``--quantization kvscale`` with SGLang; its gap-closing patches follow in the
    processes that build a kvscale model.

    Checks first that every patch target exists in the installed SGLang (if one moved,
    nothing is registered: one warning names the moved targets, and SGLang runs as if
    kvscale were not installed), then adds ``kvscale`` to SGLang's quantization registries
    and CLI choices once. The ``HookRegistry`` patches are registered and applied when a
    ``ModelConfig`` claims a checkpoint for kvscale (``method.activate``), so a process
    that serves another model runs SGLang's own code. Never raises (SGLang's
    plugin loader would log it, but a plugin must not rely on that); safe to call any
    number of times, in any process.
    """
    with state.lock:
        if state.host is not None:
            return
        try:
            registered = _register()
        except Exception as exc:  # noqa: BLE001 - never break the host
            warn_once(
                f"sglang-register:{type(exc).__name__}",
                "kvscale: could not hook into SGLang (%s: %s); SGLang runs as if "
                "kvscale-plugin were not installed (--quantization kvscale is unavailable).",
                type(exc).__name__,
                exc,
            )
            return
        state.host = registered
        logger.debug(
            "kvscale: registered quantization method '%s' with SGLang", QUANTIZATION_METHOD
        )


def _register() -> SGLangHost:
    import sglang

    from kvscale_plugin.hosts._common import base_version, import_adapter

    found = base_version(getattr(sglang, "__version__", "unknown"))
    tested = TESTED_SGLANG_VERSIONS + STATIC_SGLANG_VERSIONS
    method = import_adapter("SGLang", found, tested, "kvscale_plugin.hosts.sglang.method")
    patches = import_adapter("SGLang", found, tested, "kvscale_plugin.hosts.sglang.patches")
    # Before anything is registered: a moved target leaves kvscale unoffered, not
    # half-installed.
    patches.check_targets()
    method.register_quantization()
    # The HookRegistry patches go in only in a process that builds a kvscale model (when
    # its ModelConfig claims the checkpoint for kvscale, before the model is built).
    return SGLangHost(activate=patches.register_hooks)
