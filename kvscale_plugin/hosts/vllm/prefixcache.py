"""No cached KV is read under other scales than it was written with (the ``rl-sync``
feature, with ``live``): when the scales an FP8 cache is written with change, blocks
already in it (the prefix cache, requests in flight) were quantized with the old ones.

The prefix cache lives in the engine core's scheduler; the scales change in the workers.
Two ways carry the change from one to the other, and both end in one pending reset that
the scheduler runs before its next step:

* **In the worker's process** (an in-process engine, a colocated SPMD engine under
  ``external_launcher``: every rank runs its own scheduler beside its worker): every load
  and update ends in ``live.after_load``, which compares what this engine's FP8 caches are
  written with (``layers_epoch``) with what it was and, if it changed, counts a new scale
  generation in this process (``note_scales``). The scheduler (``Scheduler.schedule``,
  wrapped in kvscale engines) sees the new generation before its next step. Direct calls
  (``model.load_weights``, ``worker.reload_weights``) need no RPC for it.
* **Across processes** (the multiprocess executor): ``EngineCore.collective_rpc`` asks the
  workers after each successful call (``scale_epoch``) and marks the reset pending when
  that changed.

A pending reset (``_try_reset``) first preempts the running requests (recomputed under
the new scales) and resets the prefix cache; when that fails (blocks still held, e.g. for
a remote decode side) it stays pending and is retried before every step, and until it
succeeds no request reads the prefix cache (``skip_reading_prefix_cache``): never
forgotten, said once when it fails and once when it succeeds. It never fails the user's
own call.

A refusal every rank makes (``scales.REFUSED_MARK``) reaches the caller from every rank
alike; vLLM's multiprocess executor reads the ranks' answers in order and stops at the
first failure, so ``EngineCore.collective_rpc`` reads the other ranks' answers to that
call too (``_drain``): the next call reads its own.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.hosts.vllm.connectors import (
    note_local,
    refresh_from_workers,
    refresh_local,
    scheduler_connector,
)
from kvscale_plugin.hosts.vllm.layers import (
    engine_layers,
    kvscale_config,
    layer_serves_checkpoint_scales,
    serves_kvscale,
)
from kvscale_plugin.livecopies import epoch
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.scales import REFUSED_MARK

logger = logging.getLogger("kvscale_plugin")


def layers_epoch(layers: Iterable[Any]) -> tuple[Any, ...]:
    """What ``layers``' FP8 caches are written with, per layer (layers whose cache uses no
    scales are left out)."""
    held = []
    for layer in layers:
        cfg, record = kvscale_config(layer), layer_record(layer)
        if cfg is not None and record is not None:
            if layer_serves_checkpoint_scales(cfg.kv_verdict, layer):
                held.append(record)
    return epoch(held)


def scale_epoch(worker: Any) -> tuple[Any, ...]:
    """For the engine core (``collective_rpc``): what this worker's FP8 caches are written
    with, per layer."""
    return layers_epoch(engine_layers(worker))


#: Scale changes seen in this process's workers (``note_scales``); a scheduler in this
#: process resets when it differs from the one it last saw.
_GENERATION = [0]


def note_scales(cfg: Any, live_state: Any) -> None:
    """After a load or update of ``cfg``'s layers (worker side): a new generation when what
    its FP8 caches are written with changed (not at the first look: nothing was cached)."""
    layers = cfg.attention_layers()
    now = layers_epoch(layers)
    before, live_state.epoch = live_state.epoch, now
    if before is None or now != before:  # a bf16 cache's state never changes after this
        note_local(cfg)
    if before is not None and now != before:
        _GENERATION[0] += 1
        logger.debug("kvscale: the KV scales in force changed (generation %d)", _GENERATION[0])
        from kvscale_plugin.hosts.vllm.backendcopies import warn_captured_graphs

        warn_captured_graphs(cfg.warn_scope, layers, bool(cfg.full_cuda_graphs))


# -- the scheduler side ---------------------------------------------------------------

_SEEN = "_kvscale_seen_generation"
_PENDING = "_kvscale_reset_pending"
_PREEMPTED = "_kvscale_reset_preempted"
_CORE_EPOCH = "_kvscale_scale_epoch"
_WRAPPED = "__kvscale_prefix_reset__"


def mark_pending(scheduler: Any, changed: str) -> None:
    """A reset is due (``changed``: what changed, for the message)."""
    if not getattr(scheduler, _PENDING, None):
        setattr(scheduler, _PENDING, changed)
        setattr(scheduler, _PREEMPTED, False)


def _try_reset(scheduler: Any) -> bool:
    """The pending reset, once: True when done (or none was pending)."""
    changed = getattr(scheduler, _PENDING, None)
    if not changed:
        return True
    first = not getattr(scheduler, _PREEMPTED, False)
    connector = connector_to_reset(scheduler)
    kwargs = {"reset_connector": True} if connector else {}
    try:
        done = bool(scheduler.reset_prefix_cache(reset_running_requests=first, **kwargs))
        why = "" if done else "vLLM's reset returned False"
    except RuntimeError as exc:  # vLLM 0.32: raised when blocks stay held after preempting
        done, why = False, str(exc).split(". ")[0]
    setattr(scheduler, _PREEMPTED, True)
    setattr(scheduler, _SEEN, _GENERATION[0])
    if done:
        setattr(scheduler, _PENDING, None)
        logger.info(
            "kvscale: the KV scales the FP8 cache is written with changed (%s): the prefix "
            "cache%s was reset%s, so no cached KV is read under other scales than it was "
            "written with.",
            changed,
            f" and the KV connector's store ({connector})" if connector else "",
            " and running requests will be recomputed" if first else " (it was pending)",
        )
        return True
    for queue in ("waiting", "kv_holding_waiting"):
        for request in list(getattr(scheduler, queue, None) or ()):
            request.skip_reading_prefix_cache = True
    warn_once(
        f"prefix-reset-pending-{id(scheduler)}-{changed}",
        "kvscale: the KV scales the FP8 cache is written with changed (%s), and the prefix "
        "cache could not be reset yet (%s: blocks still held, e.g. for a remote decode "
        "side). The reset stays pending and is retried before every step; until it "
        "succeeds no request reads the prefix cache.",
        changed,
        why,
    )
    return False


def connector_to_reset(scheduler: Any) -> str | None:
    """The name of the scheduler's KV connector when the reset must clear its store too:
    a connector of vLLM's that keeps KV beyond the block pool under block hashes only (CPU
    offloading, Mooncake's store, ...: vLLM's ``reset_connector``); None for none, for
    kvscale's connectors (their stores are keyed by the scale state), or a vLLM without
    ``reset_connector``."""
    connector = getattr(scheduler, "connector", None)
    if connector is None or scheduler_connector(scheduler) is not None:
        return None
    try:
        takes = "reset_connector" in inspect.signature(scheduler.reset_prefix_cache).parameters
    except (TypeError, ValueError):
        return None
    return type(connector).__name__ if takes else None


def _schedule(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def schedule(self: Any, *args: Any, **kwargs: Any) -> Any:
        if serves_kvscale(self):
            refresh_local(self)
            seen = getattr(self, _SEEN, None)
            if seen is None:
                setattr(self, _SEEN, _GENERATION[0])  # a new scheduler: nothing cached yet
            elif seen != _GENERATION[0]:
                setattr(self, _SEEN, _GENERATION[0])
                mark_pending(self, "an update in this process")
            if getattr(self, _PENDING, None):
                try:
                    _try_reset(self)
                except Exception as exc:  # noqa: BLE001 - never fail a step for it
                    warn_once(
                        "prefix-reset-failed",
                        "kvscale: the pending prefix-cache reset failed (%s: %s); it is "
                        "retried before the next step.",
                        type(exc).__name__,
                        exc,
                    )
        return original(self, *args, **kwargs)

    setattr(schedule, _WRAPPED, True)
    return schedule


# -- the engine core: changes across processes, and refusals every rank makes ------------


def _engine_epoch(core: Any) -> tuple[Any, ...]:
    return tuple(core.model_executor.collective_rpc(scale_epoch))


def _drain(core: Any, exc: BaseException) -> None:
    """After a refusal every rank made (``REFUSED_MARK``), in vLLM's multiprocess
    executor: it read the first rank's answer and stopped; the others' answers to the same
    call are read here, so the next call reads its own."""
    executor = core.model_executor
    mqs = getattr(executor, "response_mqs", None)
    parallel = getattr(getattr(core, "vllm_config", None), "parallel_config", None)
    if (
        REFUSED_MARK.strip() not in str(exc)
        or not mqs
        or len(mqs) < 2
        or getattr(parallel, "enable_fault_tolerance", False)  # it reads them all then
    ):
        return
    for mq in list(mqs)[1:]:
        try:
            mq.dequeue(timeout=300)
        except Exception as error:  # noqa: BLE001 - said; the refusal stands
            warn_once(
                "refusal-drain",
                "kvscale: after a refused update, a rank's answer could not be read (%s); "
                "the next collective_rpc may read a stale answer.",
                error,
            )
            return


def _core_collective_rpc(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def collective_rpc(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not serves_kvscale(self):
            return original(self, *args, **kwargs)
        if not hasattr(self, _CORE_EPOCH):
            setattr(self, _CORE_EPOCH, _engine_epoch(self))
        try:
            result = original(self, *args, **kwargs)
        except Exception as exc:
            _drain(self, exc)
            raise
        try:
            _note_core_epoch(self)
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

    setattr(collective_rpc, _WRAPPED, True)
    return collective_rpc


def _note_core_epoch(core: Any) -> None:
    before = getattr(core, _CORE_EPOCH, None)
    now = _engine_epoch(core)
    setattr(core, _CORE_EPOCH, now)
    if before is None or now == before:
        return
    # What the caches are written with changed: kvscale's connector learns the new state
    # (a second question to the workers, asked only then).
    refresh_from_workers(core)
    entries = [{entry for worker in epoch for entry in worker} for epoch in (now, before)]
    changed = sorted({name for (name, _k, _v) in entries[0] ^ entries[1]})
    scheduler = core.scheduler
    mark_pending(scheduler, shorten(changed, "layers"))
    _try_reset(scheduler)


def install() -> None:
    """The ``rl-sync`` feature's reset: ``EngineCore.collective_rpc`` and
    ``Scheduler.schedule`` wrapped (kvscale engines only; any other engine in the process
    runs vLLM's methods unchanged). Idempotent."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore

    from kvscale_plugin.hosts.vllm.internals import replace

    for owner, name, wrap in (
        (EngineCore, "collective_rpc", _core_collective_rpc),
        (Scheduler, "schedule", _schedule),
    ):
        original = owner.__dict__[name]
        if not getattr(original, _WRAPPED, False):
            replace(owner, name, wrap(original))
