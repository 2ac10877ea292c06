"""RL weight syncs on a running vLLM engine, the ``rl-sync`` feature (docs/reliability.md,
"RL weight syncs"): vLLM's side of ``kvscale_plugin.livecopies``.

* **The served state is checked** after every load and update (``check_served``): each
  copy a backend reads (``COPIES``) is compared with the scales in force and rewritten
  where it disagrees (said once per check).
* **A fingerprint** of the copies the backend reads (``kvscale_plugin.fingerprint``) and
  an update counter, per worker: ``llm.collective_rpc(worker_fingerprint)``, and logged at
  INFO after each load and update.
* Scales sent through ``model.load_weights``: ``update``; no cached KV read under other
  scales: ``prefixcache``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

from kvscale_plugin import livecopies
from kvscale_plugin._log import warn_once
from kvscale_plugin.fingerprint import digest, layer_index
from kvscale_plugin.hosts.vllm import backendcopies
from kvscale_plugin.hosts.vllm.layers import (
    EngineConfig,
    engine_layers,
    is_kvscale_layer,
    kvscale_config,
    layer_serves_checkpoint_scales,
)
from kvscale_plugin.hosts.vllm.process import HOST
from kvscale_plugin.livecopies import Copy, LiveState
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.notices import warn_rewritten_copies

logger = logging.getLogger("kvscale_plugin")


def state(cfg: EngineConfig) -> LiveState:
    """The engine's live state (``livecopies.LiveState``, kept on its config)."""
    return livecopies.state(cfg)


def fnuz() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_fp8_fnuz())


# -- the served copies ------------------------------------------------------------------

#: Every copy of a layer's scales vLLM's backends and kvscale's CPU write read: the device
#: tensors (every head of a per-head layer), the floats, the CPU copies, kvscale's maxima.
COPIES = (
    Copy("_k_scale", "k", heads=True),
    Copy("_v_scale", "v", heads=True),
    Copy("_k_scale_float", "k"),
    Copy("_v_scale_float", "v"),
    Copy("_k_scale_cpu", "k"),
    Copy("_v_scale_cpu", "v"),
    Copy("_kvscale_k_max", "k"),
    Copy("_kvscale_v_max", "v"),
)


def disagreeing_copies(layer: torch.nn.Module) -> list[tuple[str, list[float], list[float]]]:
    """The copies of ``layer``'s served scales that do not hold the scales in force."""
    return livecopies.disagreeing(layer, COPIES)


def _rewrite(layer: torch.nn.Module, record: Any) -> None:
    from kvscale_plugin.hosts.vllm.served import write_kv_scales

    write_kv_scales(layer, record.resolved)
    serve_cpu_write(layer)


def check_served(cfg: EngineConfig, layers: Iterable[torch.nn.Module] | None = None) -> list[str]:
    """Compare every served copy of every kvscale layer with the scales in force (the
    layer's record), rewrite those that disagree, and say so once for this check. Returns
    what was rewritten (``layer.copy``)."""
    layers = list(cfg.attention_layers() if layers is None else layers)
    causes = "memory cleared by vLLM's sleep level 2, a refit that wrote one copy only"
    fixed = livecopies.check_served(cfg, layers, COPIES, _rewrite, cfg.warn_scope, causes)
    # What a GPU backend's impl keeps, computed from the floats (``backendcopies``):
    # kvscale's writer brings them along, so one that disagrees now was set elsewhere.
    details = []
    for layer in layers:
        for copy, held, want in backendcopies.refresh(layer):
            name = getattr(layer, "layer_name", type(layer).__name__)
            fixed.append(f"{name}.{copy}")
            details.append(f"{name}.{copy} held {held:g}, in force {want:g}")
    warn_rewritten_copies(
        f"{cfg.warn_scope}impl-copies-{state(cfg).checks}",
        details,
        "a backend that computed them from other scale floats",
    )
    return fixed


def serve_cpu_write(layer: torch.nn.Module) -> None:
    if "cpu-write" in HOST.installed:
        from kvscale_plugin.hosts.vllm.cpu_write import serve_layer

        serve_layer(layer)


# -- the fingerprint ----------------------------------------------------------------------


def fingerprint_lines(layers: Iterable[torch.nn.Module]) -> list[str]:
    """The canonical lines (``kvscale_plugin.fingerprint``) of what ``layers`` serve, read
    from the copies the backend reads (``livecopies.fingerprint_lines``). Layers outside
    the main stack, drafts and layers that read another layer's cache are not part of it."""
    from kvscale_plugin.hosts.vllm.shared import sharing_target

    chosen = []
    for layer in layers:
        record = layer_record(layer)
        index = layer_index(getattr(layer, "layer_name", ""))
        if index is None or (record is not None and record.draft):
            continue
        if sharing_target(layer) is not None:
            continue
        chosen.append((index, layer))
    return livecopies.fingerprint_lines(chosen, COPIES, 2.0 if fnuz() else 1.0)


def layers_fingerprint(layers: Iterable[torch.nn.Module]) -> str | None:
    """The fingerprint of what ``layers`` serve (compare ``fingerprint.scale_fingerprint``);
    None when it covers no attention layer (it would check nothing)."""
    lines = fingerprint_lines(layers)
    return digest(lines) if lines else None


def worker_fingerprint(worker: Any) -> dict[str, Any]:
    """For ``llm.collective_rpc(worker_fingerprint)``: this worker's fingerprint over its
    own layers and heads, with its update counter (scales taken, the start-up load
    counted) and its place (TP / PP / DP ranks)."""
    layers = [layer for layer in engine_layers(worker) if is_kvscale_layer(layer)]
    configs = {id(c): c for c in map(kvscale_config, layers) if c is not None}
    from vllm.distributed import (
        get_pp_group,
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    parallel = getattr(getattr(worker, "vllm_config", None), "parallel_config", None)
    # The replica: vLLM's data_parallel_index where it has one (a dense model's workers
    # keep data_parallel_rank 0 in every replica), else data_parallel_rank.
    replica = getattr(parallel, "data_parallel_index", None)
    lines = fingerprint_lines(layers)
    served = [
        layer
        for layer in layers
        if layer_serves_checkpoint_scales(kvscale_config(layer).kv_verdict, layer)
    ]
    return {
        # None: no attention layer here serves scales to fingerprint (fails closed)
        "fingerprint": digest(lines) if lines else None,
        "updates": sum(state(c).updates for c in configs.values()),
        "layers": sorted({int(line.split(" ", 1)[0]) for line in lines if line[0] != "!"}),
        "consistent": not any(line.startswith("!") for line in lines),
        # False: a bf16 cache, which serves every scale as 1.0 (scale_fingerprint(applied=))
        "applied": bool(served),
        # What third-party name-mapping rules are asked with (scale_fingerprint(model_type=)).
        "model_type": next((c.model_type for c in configs.values()), None),
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "pp_rank": get_pp_group().rank_in_group,
        "dp_rank": replica if replica is not None else getattr(parallel, "data_parallel_rank", 0),
        # A dense model's replicas are independent engines, each told a size of 1 (vLLM's
        # reconfigure_for_independent_dp_rank); kvscale's DP client wrapper says how many
        # answered (extension.install_all_answers).
        "dp_size": getattr(parallel, "data_parallel_size", 1),
    }


def worker_check(worker: Any) -> list[str]:
    """For ``llm.collective_rpc(worker_check)`` (e.g. right after ``wake_up``, which calls no
    plugin): ``check_served`` on this worker's layers now; returns the copies rewritten."""
    layers = [layer for layer in engine_layers(worker) if is_kvscale_layer(layer)]
    configs = {id(c): c for c in map(kvscale_config, layers) if c is not None}
    return [copy for cfg in configs.values() for copy in check_served(cfg)]


def announce(cfg: EngineConfig, what: str, level: int = logging.INFO) -> None:
    """The line after a load or update: the fingerprint and the counter."""
    if not logger.isEnabledFor(level):
        return
    layers = cfg.attention_layers()
    logger.log(
        level,
        "kvscale: %s: KV scales in force have fingerprint %s (update %d, %d layers).",
        what,
        layers_fingerprint(layers),
        state(cfg).updates,
        len(layers),
    )


def after_load(cfg: EngineConfig, what: str, *, took_scales: bool, quiet: bool = False) -> None:
    """After a start-up load, a reload or an update: check the served copies, count it,
    log the fingerprint (at INFO; ``quiet``: a weights-only ``model.load_weights`` call, one
    of a sync's many buckets, logs it at DEBUG unless a copy was rewritten). Never raises (a
    failure here costs this check only)."""
    try:
        from kvscale_plugin.hosts.vllm.prefixcache import note_scales

        note_scales(cfg, state(cfg))
        fixed = check_served(cfg)
        if took_scales:
            state(cfg).updates += 1
        announce(cfg, what, logging.DEBUG if quiet and not fixed else logging.INFO)
    except Exception as exc:  # noqa: BLE001 - never break a load for the check
        warn_once(
            f"{cfg.warn_scope}live-check-failed",
            "kvscale: the check of the served KV scales failed (%s: %s); what is served "
            "is not verified.",
            type(exc).__name__,
            exc,
        )
