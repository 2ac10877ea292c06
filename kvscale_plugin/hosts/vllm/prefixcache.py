"""No cached KV is read under other scales than it was written with (the ``rl-sync``
feature, with ``live``): when the scales an FP8 cache is written with change, blocks
already in it (the prefix cache, requests in flight) were quantized with the old ones.
vLLM's prefix cache lives in the engine core, which no worker reaches, so
``EngineCore.collective_rpc`` (the path of every sync: ``reload_weights``, weight-transfer
sessions, ``model.load_weights``) asks the workers after each successful call what their
FP8 caches are written with (``scale_epoch``), and if that changed resets the prefix cache
with its running requests (they are recomputed)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.hosts.vllm.layers import (
    engine_layers,
    kvscale_config,
    layer_serves_checkpoint_scales,
)
from kvscale_plugin.loadcycle import layer_record

logger = logging.getLogger("kvscale_plugin")


def scale_epoch(worker: Any) -> tuple[Any, ...]:
    """For the engine core (``collective_rpc``): what this worker's FP8 caches are written
    with, per layer (layers whose cache uses no scales are left out)."""
    held = []
    for layer in engine_layers(worker):
        cfg, record = kvscale_config(layer), layer_record(layer)
        if cfg is None or record is None or record.resolved is None:
            continue
        if not layer_serves_checkpoint_scales(cfg.kv_verdict, layer):
            continue
        held.append((record.name, record.resolved.k_heads, record.resolved.v_heads))
    return tuple(held)


_EPOCH_ATTR = "_kvscale_scale_epoch"
_CORE_WRAPPED = "__kvscale_core_rpc__"


def _is_kvscale_engine(core: Any) -> bool:
    config = getattr(core, "vllm_config", None)
    return (
        getattr(getattr(config, "model_config", None), "quantization", None) == QUANTIZATION_METHOD
    )


def _engine_epoch(core: Any) -> tuple[Any, ...]:
    return tuple(core.model_executor.collective_rpc(scale_epoch))


def _core_collective_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective_rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_kvscale_engine(self):
            return original(self, *args, **kwargs)
        if not hasattr(self, _EPOCH_ATTR):
            setattr(self, _EPOCH_ATTR, _engine_epoch(self))
        # A call that raised is not followed by the check: what kvscale refuses changes no
        # scale, and vLLM 0.32's multiprocess executor stops reading the workers' answers
        # at the first failing rank, so another call now would read the others' stale ones.
        # (A change it missed is found by the next call's check: the epoch stays.)
        result = original(self, *args, **kwargs)
        try:
            _reset_if_changed(self)
        except Exception as exc:  # noqa: BLE001 - said; the call's own outcome stands
            warn_once(
                "live-epoch-failed",
                "kvscale: could not tell whether the KV scales in force changed after "
                "this collective_rpc (%s: %s); if they did, reset the prefix cache "
                "yourself (llm.reset_prefix_cache()).",
                type(exc).__name__,
                exc,
            )
        return result

    setattr(collective_rpc, _CORE_WRAPPED, True)
    return collective_rpc


def _reset_if_changed(core: Any) -> None:
    before = getattr(core, _EPOCH_ATTR, None)
    now = _engine_epoch(core)
    setattr(core, _EPOCH_ATTR, now)
    if before is None or now == before:
        return
    entries = [{entry for worker in epoch for entry in worker} for epoch in (now, before)]
    changed = sorted({name for (name, _k, _v) in entries[0] ^ entries[1]})
    core.reset_prefix_cache(reset_running_requests=True)
    logger.info(
        "kvscale: the KV scales the FP8 cache is written with changed (%s): the prefix "
        "cache was reset and running requests will be recomputed, so no cached KV is read "
        "under other scales than it was written with.",
        shorten(changed, "layers"),
    )


def install() -> None:
    """The ``rl-sync`` feature: ``EngineCore.collective_rpc`` resets the prefix cache when
    the scales in force changed (kvscale engines only; any other engine in the process
    runs vLLM's method unchanged). Idempotent."""
    from vllm.v1.engine.core import EngineCore

    from kvscale_plugin.hosts.vllm.internals import replace

    original = EngineCore.__dict__["collective_rpc"]
    if getattr(original, _CORE_WRAPPED, False):
        return
    replace(EngineCore, "collective_rpc", _core_collective_rpc(original))
