"""RL weight syncs on a running SGLang engine (docs/reliability.md).

* **Every sync path takes its scales.** SGLang post-processes (``process_weights_after_
  loading``, where the KV method serves what its loaders recorded) after a start-up load,
  ``update_weights_from_disk`` and a weight-update session's ``end_weight_update``. A
  ``model.load_weights`` call outside those cycles (the model runner's
  ``update_weights_from_tensor`` / ``load_weights_from_distributed`` called without
  ``begin_weight_update``, checkpoint-engine's ``update_weights_from_ipc``) is never
  post-processed: the scale loaders recorded values that were never served, and SGLang
  answered success. kvscale makes such a call its own load cycle (``standalone_update``):
  the scales it carried are judged together (one corrupt tensor refuses them all, the
  layers keep the scales in force) and served before the call returns; a layer's k or v
  scale sent alone changes that one (the cycle's rule for a reload).
* **The served state is checked** at the end of every cycle (``check_served``): every copy
  a backend reads (``k_scale`` / ``v_scale``, ``k_scale_float`` / ``v_scale_float``,
  the record's mirrors, the per-head copies) is compared with the scales in force and
  rewritten where it disagrees (said once per check).
* **A fingerprint** (``kvscale_plugin.fingerprint``'s canonical form) and an update counter,
  logged at INFO after each cycle and returned by ``Engine.get_server_info()`` under
  ``internal_states[i]["kvscale"]`` (``server_info``).
* **No cached KV read under other scales.** On an FP8 pool, a sync that changed the scales
  in force flushes SGLang's radix cache even when the caller passed
  ``flush_cache=False`` (and a session's ``end_weight_update``, where SGLang flushes
  nothing, flushes it): ``after_sync``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from kvscale_plugin import livecopies
from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.fingerprint import digest, layer_index
from kvscale_plugin.livecopies import Copy, LiveState
from kvscale_plugin.loadcycle import LayerRecord, layer_record
from kvscale_plugin.scales import ResolvedScales

logger = logging.getLogger("kvscale_plugin")

_FP8_DTYPES = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


def state(cfg: Any) -> LiveState:
    """The engine's live state (``livecopies.LiveState``, kept on its config)."""
    return livecopies.state(cfg)


def layers(cfg: Any) -> list[torch.nn.Module]:
    """The config's attention layers that have a record (build order)."""
    return [layer for layer in list(cfg._layers.values()) if layer_record(layer) is not None]


# -- the served copies ------------------------------------------------------------------

#: Every copy of a layer's scales SGLang's backends and cache writes read (besides the
#: record's mirrors): the served tensors (one value: the max), the floats, kvscale's
#: per-head copies.
COPIES = (
    Copy("k_scale", "k"),
    Copy("v_scale", "v"),
    Copy("k_scale_float", "k"),
    Copy("v_scale_float", "v"),
    Copy("kvscale_k_heads", "k", heads=True),
    Copy("kvscale_v_heads", "v", heads=True),
)


def write_scales(layer: torch.nn.Module, record: LayerRecord, resolved: ResolvedScales) -> None:
    """Update the served tensors in place (backends and CUDA graphs hold them), then the
    copies: the floats, the record's mirrors, the per-head copies."""
    k, v = resolved.k, resolved.v
    with torch.no_grad():
        layer.k_scale.data.fill_(k)
        layer.v_scale.data.fill_(v)
        for k_copy, v_copy in record.mirrors:
            k_copy.fill_(k)
            v_copy.fill_(v)
    layer.k_scale_float = k
    layer.v_scale_float = v
    layer.kvscale_k_heads = resolved.k_heads
    layer.kvscale_v_heads = resolved.v_heads


def disagreeing_copies(layer: torch.nn.Module) -> list[tuple[str, list[float], list[float]]]:
    """``(copy, held, in force)`` for each copy of ``layer``'s scales that does not hold
    the scales in force (its record's ``resolved``)."""
    return livecopies.disagreeing(layer, COPIES)


def check_served(cfg: Any) -> list[str]:
    """Compare every served copy of every kvscale layer of ``cfg`` with the scales in force,
    rewrite the layers where one disagrees, and say so once for this check. Returns what
    was rewritten (``layer.copy``)."""
    return livecopies.check_served(
        cfg,
        layers(cfg),
        COPIES,
        lambda layer, record: write_scales(layer, record, record.resolved),
        f"sglang-{id(cfg)}-",
        "memory released and resumed, a refit that wrote one copy only",
    )


# -- the fingerprint ----------------------------------------------------------------------


def _fnuz() -> bool:
    from sglang.kernels.ops.quantization.fp8_kernel import is_fp8_fnuz

    return bool(is_fp8_fnuz())


def fingerprint_lines(attention: Iterable[torch.nn.Module]) -> list[str]:
    """The canonical lines (``kvscale_plugin.fingerprint``) of what ``attention`` layers
    serve, read from their copies (``livecopies.fingerprint_lines``; per-head schemes:
    this rank's heads as kvscale keeps them, ``kvscale_k_heads``). The layer index is the
    ``N`` of the layer's ``layers.N`` name (the ``RadixAttention``'s prefix); drafts and
    layers that read another layer's cache are not part of it."""
    chosen = []
    for layer in attention:
        record = layer_record(layer)
        if record is None or record.draft or record.target is not None:
            continue
        index = layer_index(record.name)
        if index is not None:
            chosen.append((index, layer))
    return livecopies.fingerprint_lines(chosen, COPIES, 2.0 if _fnuz() else 1.0)


def tp_layouts() -> list[tuple[int, int]]:
    """(rank, size) of the attention TP group, then of the TP group (where per-head scales
    may be placed: ``method._head_placement``)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        layouts = []
        for rank_attr, size_attr in (("attn_tp_rank", "attn_tp_size"), ("tp_rank", "tp_size")):
            try:
                rank, size = int(getattr(parallel, rank_attr)), int(getattr(parallel, size_attr))
            except (AttributeError, RuntimeError, ValueError, TypeError):
                continue
            layouts.append((rank, size))
        return layouts or [(0, 1)]
    except ImportError:
        return [(0, 1)]


def _tp() -> tuple[int, int]:
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(parallel.tp_rank), int(parallel.tp_size)
    except Exception:  # noqa: BLE001 - outside a server (tests, tools): one rank
        return 0, 1


def _placement(attention: Iterable[torch.nn.Module]) -> tuple[int, int]:
    """The (rank, size) this rank's per-head scales were placed by (``HeadLayout.placed_by``:
    the attention TP group under DP attention, or the full TP group), which is what
    ``scale_fingerprint(tp_rank=, tp_size=)`` needs; the full TP rank where no layer is
    per-head (its lines do not depend on it)."""
    for layer in attention:
        placed = getattr(getattr(layer_record(layer), "heads", None), "placed_by", None)
        if placed is not None:
            return placed
    return _tp()


def server_info(cfg: Any) -> dict[str, Any]:
    """What ``Engine.get_server_info()["internal_states"][i]["kvscale"]`` holds: the
    fingerprint of what this scheduler's model serves (compare
    ``fingerprint.scale_fingerprint`` of the tensors sent), the update counter (scales
    taken, the start-up load counted), the layer indices it covers, whether every copy
    agrees with the served tensors, and this rank's place: ``tp_rank`` / ``tp_size`` as
    its per-head scales are placed (the attention TP group under DP attention), what
    ``scale_fingerprint`` is given."""
    attention = layers(cfg)
    lines = fingerprint_lines(attention)
    tp_rank, tp_size = _placement(attention)
    live = state(cfg)
    return {
        "fingerprint": digest(lines) if lines else None,  # None: no layer (fails closed)
        "updates": live.updates,
        "checks": live.checks,
        "layers": sorted({int(line.split(" ", 1)[0]) for line in lines if line[0] != "!"}),
        "consistent": not any(line.startswith("!") for line in lines),
        "tp_rank": tp_rank,
        "tp_size": tp_size,
    }


def after_cycle(cfg: Any, *, took_scales: bool) -> None:
    """At the end of every load cycle (start-up load, disk update, session end, a
    ``model.load_weights`` call of its own): check the served copies, count it, log the
    fingerprint. Never raises (a failure here costs this check only)."""
    live = state(cfg)
    label = live.label or ("start-up load" if live.cycles == 0 else "weight-update session")
    try:
        check_served(cfg)
        if live.cycles == 0 or took_scales:
            live.updates += 1
        live.cycles += 1
        attention = layers(cfg)
        logger.info(
            "kvscale: %s: KV scales in force have fingerprint %s (update %d, %d layers).",
            label,
            digest(lines) if (lines := fingerprint_lines(attention)) else "(none: no layer)",
            live.updates,
            len(attention),
        )
    except Exception as exc:  # noqa: BLE001 - never break a load for the check
        warn_once(
            "sglang-live-check-failed",
            "kvscale: the check of the served KV scales failed (%s: %s); what is served "
            "is not verified.",
            type(exc).__name__,
            exc,
        )


# -- model.load_weights outside SGLang's load cycles -------------------------------------


def in_load_cycle(cfg: Any) -> bool:
    """A load cycle is running: the start-up load (layers built, not yet post-processed),
    a disk update or a weight-update session (re-armed by ``restore_weights_before_
    loading``): SGLang post-processes at its end, and the KV method serves the scales then."""
    return bool(cfg.cycle.pending) or not any(
        record.resolved is not None for record in list(cfg.cycle.records.values())
    )


def start_standalone(cfg: Any, model: torch.nn.Module) -> list[torch.nn.Module]:
    """A ``model.load_weights`` call outside any cycle becomes one: every kvscale layer of
    ``model`` re-armed (as SGLang's ``restore_weights_before_loading`` does). Returns them,
    in model order (post-processing order: a layer's cache target before the layer)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    own = [
        m
        for m in model.modules()
        if isinstance(m, RadixAttention)
        and layer_record(m) is not None
        and getattr(getattr(m, "quant_method", None), "quant_config", None) is cfg
    ]
    for layer in own:
        layer.quant_method.restore_weights_before_loading(layer)
    return own


def end_standalone(cfg: Any, own: list[torch.nn.Module], *, failed: bool = False) -> None:
    """Post-process the KV method of every layer of the call (nothing else: weight methods
    are SGLang's, and a call outside a cycle asked for none), which ends the cycle; its
    verdict is left for the caller to report (``method.report_verdict``). ``failed``: the
    model's loader raised; what the call's scale loaders recorded is dropped (every layer
    keeps its scales) and the cycle still ends."""
    for layer in own:
        record = layer_record(layer)
        if failed and record is not None:
            record.loaded.clear()
    live = state(cfg)
    cfg.cycle.caller_reports = cfg.cycle.partial = True
    live.label = "model.load_weights outside a weight-update session"
    try:
        for layer in own:
            layer.quant_method.process_weights_after_loading(layer)
    finally:
        cfg.cycle.caller_reports = cfg.cycle.partial = False
        live.label = None


# -- no cached KV read under other scales ------------------------------------------------


def scale_epoch(cfg: Any) -> tuple[Any, ...]:
    """The scales in force, per layer: what an FP8 cache is written with."""
    return livecopies.epoch(r for r in map(layer_record, layers(cfg)) if r is not None)


def manager_config(manager: Any) -> tuple[Any, bool] | None:
    """(kvscale config, whether the pool is FP8) of the target model of SGLang's scheduler
    weight-update manager; None when that model is not a kvscale model."""
    runner = getattr(getattr(manager, "tp_worker", None), "model_runner", None)
    cfg = getattr(getattr(runner, "model", None), "quant_config", None)
    if not getattr(cfg, "is_kvscale", False):
        return None
    return cfg, getattr(runner, "kv_cache_dtype", None) in _FP8_DTYPES


def after_sync(manager: Any, recv_req: Any, before: tuple[Any, ...], cfg: Any, output: Any) -> Any:
    """After a scheduler-level sync (``SchedulerWeightUpdaterManager``) on an FP8 pool: when
    the scales in force changed and SGLang did not flush its radix cache for this call
    (``flush_cache=False``, or a session's ``end_weight_update``), flush it, so no KV
    written under the old scales is read under the new ones. A flush refused (requests
    still running) fails the call, as SGLang's own flush after an update does."""
    now = scale_epoch(cfg)
    if now == before or getattr(recv_req, "flush_cache", False):
        return output
    changed = sorted({name for (name, _k, _v) in set(now) ^ set(before)})
    if manager.flush_cache():
        logger.info(
            "kvscale: the KV scales the FP8 cache is written with changed (%s) and SGLang "
            "had not flushed its cache for this call: it was flushed, so no cached KV is "
            "read under other scales than it was written with.",
            shorten(changed, "layers"),
        )
        return output
    message = (
        "kvscale: the KV scales the FP8 cache is written with changed "
        f"({shorten(changed, 'layers')}), but the cache could not be flushed because "
        "requests are still running or queued: KV they cached was written under the old "
        "scales. Retract or finish them, then call /flush_cache."
    )
    logger.error("%s", message)
    if hasattr(output, "success") and hasattr(output, "message"):
        import msgspec

        try:
            return msgspec.structs.replace(output, success=False, message=message)
        except TypeError:
            output.success, output.message = False, message
    return output
