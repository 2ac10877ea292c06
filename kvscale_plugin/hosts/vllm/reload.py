"""In-place reloads (``collective_rpc("reload_weights")``, and the weight-transfer
engines' ``start_weight_update`` / ``finish_weight_update`` used for RL weight sync): the
``reload-check`` feature.

Where the check lives:

* **On the layer, in the KV method** (vLLM's public extension point, called by every
  reload mode): the weight loaders record a refused tensor in their layer's record
  (``loadcycle.LayerRecord``); ``process_weights_after_loading`` of a layer that has served
  before sees the whole model's records and, when any scale is corrupt, keeps the scales
  the layer had and marks it refused. It does not raise: it runs inside vLLM's layerwise
  finalize loop (``reload/layerwise.py``, ``finalize_layerwise_processing``), where an
  exception leaves the later attention layers unprocessed and the reload's buffers in
  place, and inside the direct mode's ``finish_direct_reload`` (vLLM >= 0.34), which has
  no rollback either.
* **At the worker's entry points** (the two places still patched, in kvscale engines
  only): ``Worker.reload_weights`` and ``Worker.finish_weight_update`` run vLLM's whole
  reload -- including its after-reload steps (cache resets, ending the weight-update
  session) -- and then read the layers: a corrupt scale anywhere raises
  ``CorruptScaleError`` naming every bad tensor; a layer the reload gave no scale tensor
  is reported. vLLM offers no after-reload hook, and a layer whose every scale tensor was
  refused received nothing, so vLLM never calls its KV method: only a look at the layers
  after the reload finds it.

The records are consumed by that look: the next reload starts clean.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Callable, Iterable
from typing import Any

import torch

from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.hosts.vllm.internals import replace
from kvscale_plugin.hosts.vllm.layers import (
    DRAFT_SCOPE,
    EngineConfig,
    engine_layers,
    kvscale_config,
    layer_serves_checkpoint_scales,
)
from kvscale_plugin.hosts.vllm.process import HOST
from kvscale_plugin.hosts.vllm.qscales import reads_q_scale, warn_unread_q_scales
from kvscale_plugin.hosts.vllm.shared import resync_sharing_layers, sharing_target
from kvscale_plugin.loadcycle import LayerRecord, Verdict, layer_record
from kvscale_plugin.notices import refused_reload_message, warn_verdict
from kvscale_plugin.scales import REFUSED_MARK, CorruptScaleError, CorruptScales

logger = logging.getLogger("kvscale_plugin")


def _record(layer: torch.nn.Module) -> LayerRecord:
    record = layer_record(layer)
    assert record is not None  # engine_layers: every one has a record
    return record


def _is_draft(layer: torch.nn.Module) -> bool:
    return _record(layer).draft


def _uses_checkpoint_scales(layer: torch.nn.Module) -> bool:
    cfg = kvscale_config(layer)
    return cfg is not None and layer_serves_checkpoint_scales(cfg.kv_verdict, layer)


def _configs(layers: Iterable[torch.nn.Module]) -> list[EngineConfig]:
    found = {}
    for layer in layers:
        cfg = kvscale_config(layer)
        if cfg is not None:
            found[id(cfg)] = cfg
    return list(found.values())


def _forget_cycle(layers: Iterable[torch.nn.Module]) -> None:
    """The check has read this cycle: what it recorded is moot for the next one."""
    layers = list(layers)
    for record in map(_record, layers):
        record.corrupt.clear()
        record.corrupt_q.clear()
    for cfg in _configs(layers):
        cfg.cycle.take_verdict()
        cfg.cycle.begin(loading=False)
        cfg.mtp_scales_seen.clear()
        cfg.unmapped_scales.clear()


def report_verdict(
    cfg: EngineConfig, verdict: Verdict, refused: Callable[[CorruptScales], str] | None = None
) -> None:
    """A load cycle's verdict (``loadcycle.Cycle.judge``) in vLLM's terms: its warnings
    once per engine and cause, and a refused reload (or update: ``refused`` words its
    error) raised as ``CorruptScaleError``."""
    warn_verdict(verdict, cfg.warn_scope, draft_scope=DRAFT_SCOPE)
    if verdict.unread_q:
        warn_unread_q_scales(verdict.unread_q, cfg.warn_scope)
    if verdict.refused:
        # Every rank judges the same tensors and raises alike (the multiprocess executor's
        # stop at the first failing rank is handled where it reads the answers:
        # ``prefixcache``).
        message = (refused or (lambda c: refused_reload_message(c, "vLLM")))(verdict.refused)
        raise CorruptScaleError(message + REFUSED_MARK)


def check_reload(layers: list[torch.nn.Module], *, draft: bool) -> None:
    """After vLLM finished a reload of the target model (``draft=False``) or of the MTP
    draft: report the cycle's verdict -- raise ``CorruptScaleError`` when it is refused,
    else warn about the layers it gave no scale tensor. A layer vLLM's reload gave
    nothing (its every scale tensor refused, or none sent) never reached its KV method:
    it is judged here, by the same rule. Consumes the cycle's records either way."""
    reloaded = [layer for layer in layers if _is_draft(layer) == draft]
    # vLLM's layerwise reload restores a layer that loaded nothing (one that reads
    # another layer's cache) without its KV method: it follows its target here.
    resync_sharing_layers(reloaded)
    try:
        configs = _configs(reloaded)
        for layer in reloaded:
            cfg, record = kvscale_config(layer), _record(layer)
            if cfg is not None and not record.judged and sharing_target(layer) is None:
                cfg.cycle.judge(
                    record,
                    serves=_uses_checkpoint_scales(layer),
                    reads_q=reads_q_scale(layer),
                    declared=cfg.kv_verdict.declared,
                )
        for cfg in configs:
            verdict = cfg.cycle.take_verdict()
            report_verdict(cfg, verdict)
            if "rl-sync" in HOST.installed:
                from kvscale_plugin.hosts.vllm import live

                what = "draft reload" if draft else "reload"
                live.after_load(cfg, what, took_scales=verdict.took_scales)
        if not draft:
            _warn_draft_not_reloaded(layers)
    finally:
        _forget_cycle(layers)


def _warn_draft_not_reloaded(layers: list[torch.nn.Module]) -> None:
    """vLLM's ``reload_weights`` reloads the target model only (the model runner passes
    ``get_model()``; the drafter is never given the weights). When an MTP draft served by
    kvscale is alive, say that it keeps the weights and scales it started with -- once per
    engine, also for a reload without MTP-layer scales (the draft's weights are then as
    stale), naming the reload's MTP-layer scale tensors if any."""
    drafts = [layer for layer in layers if _is_draft(layer)]
    configs = _configs(layer for layer in layers if not _is_draft(layer))
    if not drafts or not configs:
        return
    held = ", ".join(
        f"{getattr(layer, 'layer_name', '?')} k={layer._k_scale_float:g} v={layer._v_scale_float:g}"
        for layer in drafts[:4]
    )
    seen = set().union(*(c.mtp_scales_seen for c in configs))
    carried = (
        f" The reload's MTP-layer KV scales ({shorten(seen, 'tensors')}) are not used."
        if seen
        else ""
    )
    warn_once(
        f"{configs[0].warn_scope}reload-mtp-draft",
        "kvscale: this reload updated the target model only (vLLM's reload_weights "
        "reloads the target model only; a weight-sync session reaches the draft through "
        "start_draft_weight_update alone): the MTP draft keeps the weights and KV scales "
        "it started with (%s).%s Sync the draft as well, or restart the engine, to serve "
        "the draft from the new checkpoint.",
        held,
        carried,
    )


_WRAPPED = "__kvscale_reload_check__"


def _reload_weights(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def reload_weights(self: Any, *args: Any, **kwargs: Any) -> Any:
        layers = engine_layers(self)
        _forget_cycle(layers)  # whatever an earlier, unchecked load left
        for cfg in _configs(layers):
            cfg.cycle.begin()  # (vLLM >= 0.34's direct reload re-creates no placeholder)
        result = original(self, *args, **kwargs)
        check_reload(engine_layers(self), draft=False)
        return result

    return reload_weights


def _finish_weight_update(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finish_weight_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        draft = bool(getattr(self, "_weight_update_is_draft", False))
        result = original(self, *args, **kwargs)
        check_reload(engine_layers(self), draft=draft)
        return result

    return finish_weight_update


_ENTRY_POINTS = {
    "reload_weights": _reload_weights,
    "finish_weight_update": _finish_weight_update,
}


def install_worker_wrappers() -> None:
    """Idempotent: the worker's reload entry points check the layers after vLLM's reload
    (and its after-reload steps) ran. Only once vLLM's worker module is loaded -- in an
    engine's worker process (the API server process never imports it, so neither does
    kvscale). A missing entry point costs only this check (one warning)."""
    worker = getattr(sys.modules.get("vllm.v1.worker.gpu_worker"), "Worker", None)
    if worker is None:
        return
    for name, make in _ENTRY_POINTS.items():
        original = worker.__dict__.get(name)
        if original is None:
            warn_once(
                f"reload-entry-{name}",
                "kvscale: this vLLM's Worker has no %s; a reload with corrupt KV scales "
                "through it keeps the previous scales but is not refused with an error.",
                name,
            )
            continue
        if getattr(original, _WRAPPED, False):
            continue
        wrapper = make(original)
        setattr(wrapper, _WRAPPED, True)
        replace(worker, name, wrapper)


def ensure_worker_wrappers() -> None:
    """As each attention layer is built (``activation.layer_built``; in an engine's worker
    process, by then): ``install_worker_wrappers`` where the ``reload-check`` feature is
    installed. Never raises: a failure costs the reload check only, never the load."""
    from kvscale_plugin.hosts.vllm.patching import ensure

    ensure(
        "reload-check",
        install_worker_wrappers,
        "vllm-reload-worker",
        "kvscale: the reload check could not hook into this vLLM's worker (%s: %s); "
        "a reload with corrupt KV scales is not refused.",
    )
