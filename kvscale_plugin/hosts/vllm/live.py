"""RL weight syncs on a running vLLM engine: the ``rl-sync`` feature (docs/reliability.md,
"RL weight syncs").

* **Scales through ``model.load_weights``.** After start-up vLLM's KV method has consumed
  the scale placeholders, so a KV-scale tensor a trainer sends through
  ``collective_rpc`` -> ``model.load_weights`` (verl, NeMo-RL) has no parameter to land in
  and the model's loader skips it without a word. kvscale wraps the loaded model's own
  ``load_weights`` (that instance only, in a ``-q kvscale`` engine): outside vLLM's own
  load cycles (start-up load, ``reload_weights``, a weight-transfer session: the
  placeholders exist then and the KV method takes the scales) the scale tensors of a call
  are taken out of it, the rest goes to the model, and the scales are one update
  (``take_update``): all validated first (one corrupt tensor refuses them all, naming
  each; the layers keep the scales in force), then written in place to every copy.
* **The served state is checked** after every load and update (``check_served``): each
  copy a backend reads is compared with the scales in force and rewritten where it
  disagrees (said once per check).
* **A fingerprint** of the copies the backend reads (``kvscale_plugin.fingerprint``) and
  an update counter, per worker: ``llm.collective_rpc(worker_fingerprint)``, and logged at
  INFO after each load and update.
* **No cached KV read under other scales**: ``prefixcache``.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from kvscale_plugin._log import warn_once
from kvscale_plugin.fingerprint import digest, entry_line
from kvscale_plugin.hosts.vllm.layers import (
    EngineConfig,
    engine_layers,
    is_kvscale_layer,
    kvscale_config,
)
from kvscale_plugin.hosts.vllm.process import HOST
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.names import main_stack_index
from kvscale_plugin.notices import short_values, warn_rewritten_copies
from kvscale_plugin.scales import ResolvedScales

logger = logging.getLogger("kvscale_plugin")

_WRAPPED = "__kvscale_live_load_weights__"
_HOST_NAME = "vllm"


@dataclass(eq=False)
class LiveState:
    """Per engine config, in this process: how many times scales were taken, and how many
    served-copy checks ran (each check warns under its own key)."""

    updates: int = 0
    checks: int = 0
    #: what this engine's FP8 caches are written with, as last seen (``prefixcache``)
    epoch: tuple[Any, ...] | None = None


_STATES: weakref.WeakKeyDictionary[Any, LiveState] = weakref.WeakKeyDictionary()


def state(cfg: EngineConfig) -> LiveState:
    found = _STATES.get(cfg)
    if found is None:
        found = _STATES[cfg] = LiveState()
    return found


def fnuz() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_fp8_fnuz())


# -- the served copies ------------------------------------------------------------------

#: copy -> (which scale, whether it holds every head of a per-head layer)
_COPIES = {
    "_k_scale": ("k", True),
    "_v_scale": ("v", True),
    "_k_scale_float": ("k", False),
    "_v_scale_float": ("v", False),
    "_k_scale_cpu": ("k", False),
    "_v_scale_cpu": ("v", False),
    "_kvscale_k_max": ("k", False),
    "_kvscale_v_max": ("v", False),
}


Snapshot = dict[int, dict[str, list[float]]]


def snapshot(layers: Iterable[torch.nn.Module]) -> Snapshot:
    """Every served copy of ``layers`` (``_COPIES``), read at once: tensors on a device are
    gathered into one transfer per device (a weight sync may run this per bucket).
    ``id(layer)`` -> copy -> its values."""
    held: Snapshot = {}
    on_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for layer in layers:
        copies = held.setdefault(id(layer), {})
        for copy in _COPIES:
            value = getattr(layer, copy, None)
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1).float()
                if flat.device.type == "cpu":
                    copies[copy] = flat.tolist()
                else:
                    on_device.setdefault(flat.device, []).append((id(layer), copy, flat))
            else:
                copies[copy] = [float(value)]
    for parts in on_device.values():
        values = torch.cat([flat for _, _, flat in parts]).cpu().tolist()
        start = 0
        for key, copy, flat in parts:
            held[key][copy] = values[start : start + flat.numel()]
            start += flat.numel()
    return held


def _f32(values: Iterable[float]) -> list[float]:
    return torch.tensor(list(values), dtype=torch.float32).tolist()


def _expected(resolved: ResolvedScales, scale: str, heads: bool, held: int) -> list[float]:
    per_head = resolved.k_heads if scale == "k" else resolved.v_heads
    one = resolved.k if scale == "k" else resolved.v
    if heads and len(per_head) == held:
        return _f32(per_head)
    return _f32([one] * held)


def disagreeing_copies(
    layer: torch.nn.Module, held: dict[str, list[float]] | None = None
) -> list[tuple[str, list[float], list[float]]]:
    """The copies of ``layer``'s served scales that do not hold the scales in force:
    ``(copy, held, expected)`` for each (``held``: its ``snapshot``, else read here)."""
    record = layer_record(layer)
    resolved = record.resolved if record is not None else None
    if resolved is None:
        return []
    if held is None:
        held = snapshot([layer])[id(layer)]
    wrong = []
    for copy, (scale, heads) in _COPIES.items():
        values = held.get(copy)
        if values is None:
            continue
        expected = _expected(resolved, scale, heads, len(values))
        if _f32(values) != expected:
            wrong.append((copy, values, expected))
    return wrong


def check_served(cfg: EngineConfig, layers: Iterable[torch.nn.Module] | None = None) -> list[str]:
    """Compare every served copy of every kvscale layer with the scales in force (the
    layer's record), rewrite those that disagree, and say so once for this check. Returns
    what was rewritten (``layer.copy``)."""
    from kvscale_plugin.hosts.vllm.served import write_kv_scales

    fixed: list[str] = []
    details: list[str] = []
    layers = list(cfg.attention_layers() if layers is None else layers)
    held = snapshot(layers)
    for layer in layers:
        wrong = disagreeing_copies(layer, held[id(layer)])
        if not wrong:
            continue
        record = layer_record(layer)
        assert record is not None and record.resolved is not None
        write_kv_scales(layer, record.resolved)
        serve_cpu_write(layer)
        name = getattr(layer, "layer_name", "?")
        for copy, values, expected in wrong:
            fixed.append(f"{name}.{copy}")
            details.append(
                f"{name}.{copy} held {short_values(values)}, in force {short_values(expected)}"
            )
    live = state(cfg)
    live.checks += 1
    warn_rewritten_copies(
        f"{cfg.warn_scope}served-copies-{live.checks}",
        details,
        "memory cleared by vLLM's sleep level 2, a refit that wrote one copy only",
    )
    return fixed


def serve_cpu_write(layer: torch.nn.Module) -> None:
    if "cpu-write" in HOST.installed:
        from kvscale_plugin.hosts.vllm.cpu_write import serve_layer

        serve_layer(layer)


# -- the fingerprint ----------------------------------------------------------------------


def fingerprint_lines(layers: Iterable[torch.nn.Module]) -> list[str]:
    """The canonical lines (``kvscale_plugin.fingerprint``) of what ``layers`` serve, read
    from the copies the backend reads; a copy that disagrees with the device tensor adds a
    ``!`` line. Layers outside the main stack, drafts and layers that read another layer's
    cache are not part of it."""
    from kvscale_plugin.hosts.vllm.shared import sharing_target

    factor = 2.0 if fnuz() else 1.0
    entries: dict[tuple[int, str], str] = {}
    extra: list[str] = []
    chosen = []
    for layer in layers:
        record = layer_record(layer)
        index = main_stack_index(getattr(layer, "layer_name", ""))
        if index is None or (record is not None and record.draft):
            continue
        if sharing_target(layer) is not None:
            continue
        chosen.append((index, layer, record is not None and record.heads is not None))
    held = snapshot(layer for _, layer, _ in chosen)
    for index, layer, heads in chosen:
        copies = held[id(layer)]
        for scale in ("k", "v"):
            device = copies.get(f"_{scale}_scale")
            if device is None:
                continue
            values = device if heads else device[:1]
            entries[(index, scale)] = entry_line(index, scale, [x / factor for x in values])
            top = _f32([max(device)])
            for copy, (of, all_heads) in _COPIES.items():
                values = copies.get(copy)
                if of != scale or all_heads or values is None:
                    continue
                if _f32(values) != top * len(values):
                    extra.append(f"! {index} {scale} {copy} {short_values(values)}")
    return [entries[key] for key in sorted(entries)] + sorted(extra)


def layers_fingerprint(layers: Iterable[torch.nn.Module]) -> str:
    """The fingerprint of what ``layers`` serve (compare ``fingerprint.scale_fingerprint``)."""
    return digest(fingerprint_lines(layers))


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
    lines = fingerprint_lines(layers)
    return {
        "fingerprint": digest(lines),
        "updates": sum(state(c).updates for c in configs.values()),
        "layers": sorted({int(line.split(" ", 1)[0]) for line in lines if line[0] != "!"}),
        "consistent": not any(line.startswith("!") for line in lines),
        "tp_rank": get_tensor_model_parallel_rank(),
        "tp_size": get_tensor_model_parallel_world_size(),
        "pp_rank": get_pp_group().rank_in_group,
        "dp_rank": getattr(parallel, "data_parallel_rank", 0),
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
