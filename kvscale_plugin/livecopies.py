"""What an engine serves after every load and update, written once for every host: the
copies of each layer's scales a backend reads, checked against the scales in force and
rewritten where they disagree; the fingerprint's lines read from them; the per-engine
live state (updates counted, checks run, what the FP8 caches are written with).

Each host adapter hands in one table (``Copy`` rows: which attributes of its attention
layers hold a copy of the k or v scale, and whether a copy holds every head of a per-head
layer or one value, the layer's max) and how to write a layer's scales in force. Pure:
plain tensors, floats and tuples; never a host object's type.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvscale_plugin.fingerprint import entry_line
from kvscale_plugin.loadcycle import LayerRecord, layer_record
from kvscale_plugin.notices import short_values, warn_rewritten_copies
from kvscale_plugin.scales import ResolvedScales

#: The attribute a host object keeps its ``LiveState`` in (one pattern for every host).
STATE_ATTR = "kvscale_live"


@dataclass(eq=False)
class LiveState:
    """Per engine (kept on the host's config object of the engine, in this process): how
    many loads set scales (the start-up load counted as 1), how many load cycles ended,
    how many served-copy checks ran (each warns under its own key), what the FP8 caches
    were last written with, and what the next cycle's INFO line calls it."""

    updates: int = 0
    cycles: int = 0
    checks: int = 0
    epoch: tuple[Any, ...] | None = None
    label: str | None = None


def state(owner: Any) -> LiveState:
    """``owner``'s live state (made at first use)."""
    found = getattr(owner, STATE_ATTR, None)
    if not isinstance(found, LiveState):
        found = LiveState()
        setattr(owner, STATE_ATTR, found)
    return found


@dataclass(frozen=True)
class Copy:
    """One copy of a layer's k or v scale that a backend or cache write reads."""

    attr: str
    kind: str  # "k" or "v"
    heads: bool = False  # holds every head of a per-head layer (else one value: the max)


Table = Sequence[Copy]
#: id(layer) -> copy name -> its values
Snapshot = dict[int, dict[str, list[float]]]


def _copies(layer: Any, table: Table) -> Iterable[tuple[str, str, bool, Any]]:
    for copy in table:
        yield copy.attr, copy.kind, copy.heads, getattr(layer, copy.attr, None)
    record = layer_record(layer)
    for i, (k_copy, v_copy) in enumerate(record.mirrors if record is not None else ()):
        yield f"mirrors[{i}].k", "k", False, k_copy
        yield f"mirrors[{i}].v", "v", False, v_copy


def snapshot(layers: Iterable[Any], table: Table) -> Snapshot:
    """Every copy of ``layers``' scales (``table``, and each record's mirrors), read at once:
    tensors on a device are gathered into one transfer per device (a weight sync may run
    this per bucket)."""
    held: Snapshot = {}
    on_device: dict[torch.device, list[tuple[int, str, torch.Tensor]]] = {}
    for layer in layers:
        copies = held.setdefault(id(layer), {})
        for name, _kind, _heads, value in _copies(layer, table):
            if value is None:
                continue
            if isinstance(value, torch.Tensor):
                flat = value.detach().reshape(-1).float()
                if flat.device.type == "cpu":
                    copies[name] = flat.tolist()
                else:
                    on_device.setdefault(flat.device, []).append((id(layer), name, flat))
            elif isinstance(value, (tuple, list)):
                copies[name] = [float(x) for x in value]
            else:
                copies[name] = [float(value)]
    for parts in on_device.values():
        values = torch.cat([flat for _, _, flat in parts]).cpu().tolist()
        start = 0
        for key, name, flat in parts:
            held[key][name] = values[start : start + flat.numel()]
            start += flat.numel()
    return held


def f32(values: Iterable[float]) -> list[float]:
    """``values`` as float32 numbers (how every copy is compared)."""
    return torch.tensor([float(x) for x in values], dtype=torch.float32).tolist()


def _kinds(layer: Any, table: Table) -> dict[str, tuple[str, bool]]:
    return {name: (kind, heads) for name, kind, heads, _ in _copies(layer, table)}


def expected(resolved: ResolvedScales, kind: str, heads: bool, held: int) -> list[float]:
    """What a copy of ``held`` values holds when it agrees with ``resolved``."""
    per_head = resolved.k_heads if kind == "k" else resolved.v_heads
    if heads and len(per_head) == held:
        return f32(per_head)
    return f32([resolved.k if kind == "k" else resolved.v] * max(held, 1))


def disagreeing(
    layer: Any, table: Table, held: dict[str, list[float]] | None = None
) -> list[tuple[str, list[float], list[float]]]:
    """``(copy, held, in force)`` for each copy of ``layer``'s scales that does not hold
    the scales in force (its record's ``resolved``); ``held``: its ``snapshot``."""
    record = layer_record(layer)
    if record is None or record.resolved is None:
        return []
    if held is None:
        held = snapshot([layer], table)[id(layer)]
    wrong = []
    for name, (kind, heads) in _kinds(layer, table).items():
        values = held.get(name)
        if values is None:
            continue
        want = expected(record.resolved, kind, heads, len(values))
        if f32(values) != want:
            wrong.append((name, values, want))
    return wrong


def check_served(
    owner: Any,
    layers: Iterable[Any],
    table: Table,
    rewrite: Callable[[Any, LayerRecord], None],
    scope: str,
    causes: str,
) -> list[str]:
    """Compare every copy of every layer's scales with the scales in force, rewrite the
    layers where one disagrees (``rewrite(layer, record)``), and say so once for this check
    (``scope``: the engine's warning scope; ``causes``: what clears copies on this host).
    Returns what was rewritten (``layer.copy``)."""
    layers = list(layers)
    held = snapshot(layers, table)
    fixed: list[str] = []
    details: list[str] = []
    for layer in layers:
        wrong = disagreeing(layer, table, held[id(layer)])
        if not wrong:
            continue
        record = layer_record(layer)
        assert record is not None and record.resolved is not None
        rewrite(layer, record)
        for copy, values, want in wrong:
            fixed.append(f"{record.name}.{copy}")
            details.append(
                f"{record.name}.{copy} held {short_values(values)}, in force {short_values(want)}"
            )
    live = state(owner)
    live.checks += 1
    warn_rewritten_copies(f"{scope}served-copies-{live.checks}", details, causes)
    return fixed


def fingerprint_lines(
    chosen: Iterable[tuple[int, Any]], table: Table, factor: float = 1.0
) -> list[str]:
    """The canonical lines (``kvscale_plugin.fingerprint``) of what the ``(index, layer)``
    pairs serve, read from their copies: each scale from the table's first copy of its kind
    that holds every head (this rank's heads for a per-head layer, else its first value),
    divided by the platform's ``factor``; every other copy that disagrees with that copy's
    max adds a ``!`` line."""
    chosen = list(chosen)
    held = snapshot((layer for _, layer in chosen), table)
    entries: dict[tuple[int, str], str] = {}
    extra: list[str] = []
    for index, layer in chosen:
        record = layer_record(layer)
        per_head = record is not None and record.heads is not None
        copies = held[id(layer)]
        kinds = _kinds(layer, table)
        for kind in ("k", "v"):
            primary = next((n for n, (k, h) in kinds.items() if k == kind and h), None)
            values = copies.get(primary) if primary else None
            if not values:
                continue
            entries[(index, kind)] = entry_line(
                index, kind, [x / factor for x in (values if per_head else values[:1])]
            )
            top = f32([max(values)])
            for name, (of, heads) in kinds.items():
                seen = copies.get(name)
                if of != kind or name == primary or seen is None:
                    continue
                if (f32([max(seen)]) if heads else f32(seen)) != top * (1 if heads else len(seen)):
                    extra.append(f"! {index} {kind} {name} {short_values(seen)}")
    return [entries[key] for key in sorted(entries)] + sorted(extra)


def epoch(records: Iterable[LayerRecord]) -> tuple[Any, ...]:
    """What the layers of ``records`` (those whose caches use the scales) are written with."""
    return tuple(
        (record.name, record.resolved.k_heads, record.resolved.v_heads)
        for record in records
        if record.resolved is not None
    )
