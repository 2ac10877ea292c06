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

import functools
import itertools
import logging
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.fingerprint import digest, entry_line
from kvscale_plugin.hosts.vllm.layers import (
    EngineConfig,
    engine_layers,
    is_kvscale_layer,
    kvscale_config,
    layer_serves_checkpoint_scales,
)
from kvscale_plugin.hosts.vllm.process import HOST
from kvscale_plugin.hosts.vllm.runtime import last_rank
from kvscale_plugin.loadcycle import layer_record, read_scale
from kvscale_plugin.names import main_stack_index, map_scale_name, scale_kind
from kvscale_plugin.notices import short_values, warn_rewritten_copies
from kvscale_plugin.scales import CorruptScaleError, CorruptScales, ResolvedScales, ScaleSource

logger = logging.getLogger("kvscale_plugin")

_WRAPPED = "__kvscale_live_load_weights__"
_HOST_NAME = "vllm"


@dataclass(eq=False)
class LiveState:
    """Per engine config, in this process: how many times scales were taken, and how many
    served-copy checks ran (each check warns under its own key)."""

    updates: int = 0
    checks: int = 0


_STATES: weakref.WeakKeyDictionary[Any, LiveState] = weakref.WeakKeyDictionary()


def state(cfg: EngineConfig) -> LiveState:
    found = _STATES.get(cfg)
    if found is None:
        found = _STATES[cfg] = LiveState()
    return found


def _fnuz() -> bool:
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
        _serve_cpu_write(layer)
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


def _serve_cpu_write(layer: torch.nn.Module) -> None:
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

    factor = 2.0 if _fnuz() else 1.0
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


# -- scale tensors through the model's own load_weights ---------------------------------


def _landing(cfg: Any, name: str, paths: list[Any]) -> tuple[torch.nn.Module, str] | None | bool:
    """Where a weight called ``name`` goes: (attention layer, kind) for a KV scale of this
    model, None for any other weight, False for a KV-scale name that lands on no layer.
    ``paths``: the call's ``ModelPaths``, built at its first scale name."""
    from kvscale_plugin.hosts.vllm.scalepaths import ModelPaths

    mapped = map_scale_name(name, _HOST_NAME, cfg.model_type)
    kind = scale_kind(name)
    if mapped is None and kind is None and not name.endswith(".kv_scale"):
        return None
    if not paths:
        paths.append(ModelPaths(cfg.attention_layers()))
    found = paths[0].land(name, mapped)
    if found is not None:
        landing, layer = found
        return layer, landing.kind
    if mapped is not None:
        layer = cfg.attention_layer(mapped.rsplit(".", 1)[0])
        if layer is not None:
            return layer, mapped.rsplit(".", 1)[1]
    return False


def _in_load_cycle(cfg: Any) -> bool:
    """vLLM's own load cycle is running (start-up load, reload, weight-transfer session):
    the layers hold scale placeholders then, and the KV method takes the scales."""
    return any(hasattr(layer, "k_scale") for layer in cfg.attention_layers())


def wrap_model(cfg: Any, model: torch.nn.Module) -> None:
    """Wrap ``model``'s own ``load_weights`` (this instance only). Idempotent."""
    original = model.load_weights
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any):
        if _in_load_cycle(cfg):
            return original(weights, *args, **kwargs)
        taken: list[tuple[str, torch.Tensor, Any]] = []
        rest = _divert(cfg, weights, taken)
        first = next(rest, None)
        loaded = (
            original(itertools.chain([first], rest), *args, **kwargs)
            if first is not None
            else set()
        )
        names = take_update(cfg, taken)
        return loaded | names if isinstance(loaded, set) else loaded

    setattr(load_weights, _WRAPPED, True)
    model.load_weights = load_weights


def _divert(
    cfg: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    taken: list[tuple[str, torch.Tensor, Any]],
) -> Iterator[tuple[str, torch.Tensor]]:
    paths: list[Any] = []
    for name, tensor in weights:
        where = _landing(cfg, name, paths)
        if where is None:
            yield name, tensor
        else:
            taken.append((name, tensor, where))


def take_update(cfg: Any, taken: list[tuple[str, torch.Tensor, Any]]) -> set[str]:
    """One update: the KV-scale tensors of one ``model.load_weights`` call, validated
    together, then written in place; the served copies checked; counted and logged.
    Returns the names taken. Raises ``CorruptScaleError`` (nothing written) when any is
    corrupt."""
    from kvscale_plugin.hosts.vllm.qscales import reads_q_scale
    from kvscale_plugin.hosts.vllm.served import write_kv_scales, write_scales
    from kvscale_plugin.hosts.vllm.shared import resync_sharing_layers, sharing_target

    corrupt = CorruptScales()
    nowhere: list[str] = []
    updates: dict[int, tuple[torch.nn.Module, dict[str, tuple[float, ...]]]] = {}
    for name, tensor, where in taken:
        if where is False:
            nowhere.append(name)
            continue
        layer, kind = where
        record = layer_record(layer)
        if record is None or kind not in ("k_scale", "v_scale", "q_scale"):
            continue  # zero points (accepted, dropped), prob_scale (read by no backend)
        if kind == "q_scale" and not reads_q_scale(layer):
            continue  # no attention backend here reads it
        values, problems = read_scale(name, tensor, record.heads, is_query=kind == "q_scale")
        if values is None:
            corrupt.add(problems)
            continue
        kinds = updates.setdefault(id(layer), (layer, {}))[1]
        kinds[kind] = values
        if name.endswith(".kv_scale"):  # the legacy single scale: k and v
            kinds["v_scale"] = values
    if nowhere:
        warn_once(
            f"{cfg.warn_scope}live-unmapped-{','.join(sorted(nowhere))}",
            "kvscale: KV-scale tensor(s) that name no attention layer of this model were "
            "dropped from the update: %s (check the names against `kvscale inspect` of a "
            "checkpoint of the model).",
            shorten(nowhere, "tensors"),
        )
    if corrupt:
        lines = "\n".join(
            f"  - {name}: {why}" for name, why in sorted(corrupt.as_mapping().items())
        )
        message = (
            f"kvscale: refused the {len(corrupt)} corrupt KV-scale tensor(s) of this "
            f"model.load_weights call:\n{lines}\nNo scale of the call was taken: every "
            "attention layer keeps the scales in force (the call's other weights were "
            "loaded). Fix them where they are computed (a scale is a positive, finite "
            "number) and send the scales again."
        )
        if last_rank():
            raise CorruptScaleError(message)
        # Every rank refuses the same tensors (each checks all heads); only the last one
        # raises: vLLM's multiprocess executor reads the ranks' answers in order and stops
        # at the first failure, so a raise on an earlier rank would leave the later ranks'
        # answers queued for the next collective_rpc.
        logger.warning("%s (Raised by the engine's last rank.)", message)
        return set()
    factor = 2.0 if _fnuz() else 1.0
    names: set[str] = set()
    served = 0
    for layer, kinds in updates.values():
        record = layer_record(layer)
        assert record is not None
        names.update(f"{record.name}.{kind}" for kind in kinds)
        if sharing_target(layer) is not None or not layer_serves_checkpoint_scales(
            cfg.kv_verdict, layer
        ):
            continue  # reads another layer's cache / a cache that uses no scales
        current = record.resolved
        k_heads = _scaled(kinds.get("k_scale"), factor) or (current.k_heads if current else (1.0,))
        v_heads = _scaled(kinds.get("v_scale"), factor) or (current.v_heads if current else (1.0,))
        resolved = ResolvedScales(
            max(k_heads), max(v_heads), ScaleSource.CHECKPOINT, k_heads, v_heads
        )
        if "q_scale" in kinds:
            q = _scaled(kinds["q_scale"], factor) or (1.0,)
            write_scales(layer, resolved, q, float(getattr(layer, "_prob_scale_float", 1.0)))
        else:
            write_kv_scales(layer, resolved)
        record.served(resolved, ScaleSource.CHECKPOINT.value)
        _serve_cpu_write(layer)
        served += 1
    resync_sharing_layers(cfg.attention_layers())
    total = len(cfg.attention_layers())
    what = "weights-only model.load_weights"
    if updates:
        what = (
            f"KV-scale update through model.load_weights: {len(names)} tensor(s) for "
            f"{len(updates)} of {total} attention layers taken ({served} serve them)"
        )
        if len(updates) < total:
            what += f"; the other {total - len(updates)} keep theirs"
    after_load(cfg, what, took_scales=bool(updates), quiet=not updates)
    return names


def _scaled(values: tuple[float, ...] | None, factor: float) -> tuple[float, ...] | None:
    return tuple(x * factor for x in values) if values else None


def wrap_loaded_models(cfg: Any) -> None:
    """At the end of a start-up load: every model this config's layers belong to gets the
    wrapped ``load_weights`` (the target model and an MTP draft)."""
    from kvscale_plugin.hosts.vllm.scalepaths import module_path

    roots: dict[int, torch.nn.Module] = {}
    for layer in cfg.attention_layers():
        found = module_path(layer)
        if found is not None:
            roots[id(found[0])] = found[0]
    for root in roots.values():
        if callable(getattr(root, "load_weights", None)):
            wrap_model(cfg, root)
