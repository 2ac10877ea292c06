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
  scale sent alone changes that one (``_keep_the_other_scale``).
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
from dataclasses import dataclass
from typing import Any

import torch

from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.fingerprint import digest, entry_line
from kvscale_plugin.loadcycle import LayerRecord, layer_record
from kvscale_plugin.names import main_stack_index
from kvscale_plugin.notices import short_values, warn_rewritten_copies
from kvscale_plugin.scales import ResolvedScales

logger = logging.getLogger("kvscale_plugin")

_STATE_ATTR = "kvscale_live"
_FP8_DTYPES = {
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")
    if hasattr(torch, name)
}


@dataclass
class LiveState:
    """Per kvscale config (one model, in this process): load cycles ended, updates that
    carried scales (the start-up load counted as 1), checks of the served copies, and
    what the next cycle's INFO line calls it (set by the entry point running it)."""

    cycles: int = 0
    updates: int = 0
    checks: int = 0
    label: str | None = None


def state(cfg: Any) -> LiveState:
    found = getattr(cfg, _STATE_ATTR, None)
    if found is None:
        found = LiveState()
        setattr(cfg, _STATE_ATTR, found)
    return found


def layers(cfg: Any) -> list[torch.nn.Module]:
    """The config's attention layers that have a record (build order)."""
    return [layer for layer in list(cfg._layers.values()) if layer_record(layer) is not None]


# -- the served copies ------------------------------------------------------------------


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


def _f32(values: Iterable[float]) -> list[float]:
    return torch.tensor([float(x) for x in values], dtype=torch.float32).tolist()


def _number(value: Any) -> list[float] | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return _f32(value.detach().float().reshape(-1).tolist())
    if isinstance(value, (tuple, list)):
        return _f32(value)
    return _f32([value])


def served_copies(layer: torch.nn.Module, record: LayerRecord) -> dict[str, list[float] | None]:
    """Every copy of ``layer``'s scales a backend or cache write reads, by name."""
    copies: dict[str, list[float] | None] = {
        "k_scale": _number(getattr(layer, "k_scale", None)),
        "v_scale": _number(getattr(layer, "v_scale", None)),
        "k_scale_float": _number(getattr(layer, "k_scale_float", None)),
        "v_scale_float": _number(getattr(layer, "v_scale_float", None)),
        "kvscale_k_heads": _number(getattr(layer, "kvscale_k_heads", None)),
        "kvscale_v_heads": _number(getattr(layer, "kvscale_v_heads", None)),
    }
    for i, (k_copy, v_copy) in enumerate(record.mirrors):
        copies[f"mirrors[{i}].k"] = _number(k_copy)
        copies[f"mirrors[{i}].v"] = _number(v_copy)
    return copies


def _expected(resolved: ResolvedScales, copy: str, held: int) -> list[float]:
    kind = "v" if copy.startswith("v_") or copy.endswith(("_v_heads", ".v")) else "k"
    if copy.endswith("_heads"):
        return _f32(resolved.k_heads if kind == "k" else resolved.v_heads)
    return _f32([resolved.k if kind == "k" else resolved.v] * max(held, 1))


def disagreeing_copies(layer: torch.nn.Module) -> list[tuple[str, list[float] | None, list[float]]]:
    """``(copy, held, in force)`` for each copy of ``layer``'s scales that does not hold
    the scales in force (its record's ``resolved``)."""
    record = layer_record(layer)
    if record is None or record.resolved is None:
        return []
    wrong = []
    for copy, held in served_copies(layer, record).items():
        expected = _expected(record.resolved, copy, len(held or ()))
        if held != expected:
            wrong.append((copy, held, expected))
    return wrong


def check_served(cfg: Any) -> list[str]:
    """Compare every served copy of every kvscale layer of ``cfg`` with the scales in force,
    rewrite the layers where one disagrees, and say so once for this check. Returns what
    was rewritten (``layer.copy``)."""
    fixed: list[str] = []
    details: list[str] = []
    for layer in layers(cfg):
        wrong = disagreeing_copies(layer)
        if not wrong:
            continue
        record = layer_record(layer)
        assert record is not None and record.resolved is not None
        write_scales(layer, record, record.resolved)
        for copy, held, expected in wrong:
            fixed.append(f"{record.name}.{copy}")
            details.append(
                f"{record.name}.{copy} held {short_values(held)}, in force {short_values(expected)}"
            )
    live = state(cfg)
    live.checks += 1
    warn_rewritten_copies(
        f"sglang-served-copies-{id(cfg)}-{live.checks}",
        details,
        "memory released and resumed, a refit that wrote one copy only",
    )
    return fixed


# -- the fingerprint ----------------------------------------------------------------------


def _fnuz() -> bool:
    from sglang.kernels.ops.quantization.fp8_kernel import is_fp8_fnuz

    return bool(is_fp8_fnuz())


def fingerprint_lines(attention: Iterable[torch.nn.Module]) -> list[str]:
    """The canonical lines (``kvscale_plugin.fingerprint``) of what ``attention`` layers
    serve, read from the served tensors (per-head schemes: this rank's heads as kvscale
    keeps them, ``kvscale_k_heads``); a copy that disagrees with the served tensor adds a
    ``!`` line. The layer index is the ``N`` of the layer's ``layers.N`` name (the
    ``RadixAttention``'s prefix); drafts and layers that read another layer's cache are
    not part of it."""
    factor = 2.0 if _fnuz() else 1.0
    entries: dict[tuple[int, str], str] = {}
    extra: list[str] = []
    for layer in attention:
        record = layer_record(layer)
        if record is None or record.draft or record.target is not None:
            continue
        index = main_stack_index(record.name)
        if index is None:
            continue
        copies = served_copies(layer, record)
        for kind in ("k", "v"):
            device = copies[f"{kind}_scale"]
            if device is None:
                continue
            heads = copies[f"kvscale_{kind}_heads"] if record.heads is not None else None
            values = heads if heads else device[:1]
            entries[(index, kind)] = entry_line(index, kind, [x / factor for x in values])
            for copy, held in copies.items():
                if held is None or copy == f"{kind}_scale":
                    continue
                of = "v" if copy.startswith("v_") or copy.endswith(("_v_heads", ".v")) else "k"
                if of != kind:
                    continue
                seen = [max(held)] if copy.endswith("_heads") and held else held
                if seen != device[:1] * len(seen):
                    extra.append(f"! {index} {kind} {copy} {short_values(held)}")
    return [entries[key] for key in sorted(entries)] + sorted(extra)


def _tp() -> tuple[int, int]:
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return int(parallel.tp_rank), int(parallel.tp_size)
    except Exception:  # noqa: BLE001 - outside a server (tests, tools): one rank
        return 0, 1


def server_info(cfg: Any) -> dict[str, Any]:
    """What ``Engine.get_server_info()["internal_states"][i]["kvscale"]`` holds: the
    fingerprint of what this scheduler's model serves (compare
    ``fingerprint.scale_fingerprint`` of the tensors sent), the update counter (scales
    taken, the start-up load counted), the layer indices it covers, whether every copy
    agrees with the served tensors, and this rank's place."""
    lines = fingerprint_lines(layers(cfg))
    tp_rank, tp_size = _tp()
    live = state(cfg)
    return {
        "fingerprint": digest(lines),
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
            digest(fingerprint_lines(attention)),
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


def _keep_the_other_scale(record: LayerRecord | None) -> None:
    """A call that carried a layer's ``k_scale`` only (or ``v_scale`` only) changes that
    one: the other stays in force (a trainer sending buckets may send a layer's two scales
    in different calls). In a load cycle a lone scale serves k and v (a checkpoint with one
    scale per layer); a layer whose scales in force came that way keeps that rule."""
    if record is None or not record.raw:
        return
    kinds = ("k_scale", "v_scale")
    if sum(kind in record.loaded for kind in kinds) != 1:
        return
    for kind in kinds:
        if kind not in record.loaded and kind in record.raw:
            record.loaded[kind] = record.raw[kind]


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
        _keep_the_other_scale(record)
    live = state(cfg)
    cfg.cycle.caller_reports = True
    live.label = "model.load_weights outside a weight-update session"
    try:
        for layer in own:
            layer.quant_method.process_weights_after_loading(layer)
    finally:
        cfg.cycle.caller_reports = False
        live.label = None


# -- no cached KV read under other scales ------------------------------------------------


def scale_epoch(cfg: Any) -> tuple[Any, ...]:
    """The scales in force, per layer: what an FP8 cache is written with."""
    held = []
    for layer in layers(cfg):
        record = layer_record(layer)
        if record is not None and record.resolved is not None:
            held.append((record.name, record.resolved.k_heads, record.resolved.v_heads))
    return tuple(held)


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
