"""The scale state KV was written with, for KV that leaves an engine's block pool: a KV
connector's store, a prefill/decode (P/D) transfer (docs/deployment.md).

An FP8 cache's bytes mean something only under the k/v scales they were quantized with.
The scale state names those scales in a form every engine serving the same model under
the same scales computes alike, whatever its tensor- or pipeline-parallel layout:

* one line per attention layer that has scales in force (its engine name, sorted), with
  **every** head's k and v scale (a per-head layer's whole vector, gathered from the
  tensor-parallel ranks that each serve some of its heads), as float32 hex
  (``fingerprint.value_text``);
* ``tag``: the first 16 hex digits of the SHA-256 of ``kvscale-ss1\\n`` and those lines;
* ``applied``: whether the engine's caches apply them (an FP8 cache). A layer whose cache
  applies no scales (bf16) is served unscaled (1.0: what it applies), so every bf16 engine
  of a model has one state, which updates do not change -- its KV does not depend on them;
  that state travels and is compared, but never makes a store or a transfer unusable.

Workers compute it from their layers' records (each PP stage its own layers; TP ranks the
same lines), the engine merges them (``merge``). Pure: no host import.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvscale_plugin.fingerprint import value_text

VERSION = "kvscale-ss1"
#: The key of the state in a request's ``kv_transfer_params``.
PARAMS_KEY = "kvscale_scale_state"


class ScaleStateError(ValueError):
    """Workers of one engine disagree on the scales a layer is written with."""


@dataclass(frozen=True)
class ScaleState:
    """What an engine's caches are written with (see the module's docstring)."""

    tag: str
    applied: bool
    layers: int

    def to_params(self) -> dict[str, Any]:
        """As it travels in ``kv_transfer_params`` (JSON)."""
        return {"tag": self.tag, "applied": self.applied, "layers": self.layers}

    @classmethod
    def from_params(cls, params: Mapping[str, Any] | None) -> ScaleState | None:
        """The producer's state in a request's ``kv_transfer_params`` (None when absent or
        malformed: the producer ran without kvscale, or an older kvscale)."""
        found = (params or {}).get(PARAMS_KEY)
        if not isinstance(found, Mapping):
            return None
        tag, applied, layers = found.get("tag"), found.get("applied"), found.get("layers")
        if not isinstance(tag, str) or not isinstance(applied, bool):
            return None
        return cls(tag, applied, layers if isinstance(layers, int) else 0)

    def describe(self) -> str:
        return f"{self.tag} ({'FP8, applied' if self.applied else 'not applied: no FP8 cache'})"


#: One layer as one worker serves it: k and v values, and which of the layer's heads they
#: are (None: all of them, in order -- a per-tensor scale, or a worker with every head).
LayerPart = tuple[tuple[float, ...], tuple[float, ...], tuple[int, ...] | None]
#: One worker's part: layer name -> its ``LayerPart``, and whether its caches apply them.
Part = tuple[dict[str, LayerPart], bool]


def part(
    entries: Iterable[tuple[str, Iterable[float], Iterable[float], Iterable[int] | None]],
    applied: bool,
) -> Part:
    """A worker's part of the state from ``(layer name, k values, v values, head indices)``
    of the layers with scales in force (head indices: which checkpoint heads a per-head
    layer's values are on this tensor-parallel rank; None for all)."""
    return {
        name: (tuple(k), tuple(v), tuple(heads) if heads is not None else None)
        for name, k, v, heads in entries
    }, bool(applied)


def merge(parts: Iterable[Part | None]) -> ScaleState | None:
    """The engine's state from its workers' parts (None when no worker has a layer with
    scales in force: not a kvscale engine): each layer's heads gathered from every rank
    that serves some (TP), each stage's layers (PP). Raises ``ScaleStateError`` when two
    workers hold different scales for one head of a layer (names it and both values)."""
    layers: dict[str, tuple[dict[int, float], dict[int, float]]] = {}
    applied = False
    for found in parts:
        if not found:
            continue
        entries, their_applied = found
        for name, (k, v, heads) in entries.items():
            held = layers.setdefault(name, ({}, {}))
            for kind, values, into in (("k", k, held[0]), ("v", v, held[1])):
                indices = heads if heads is not None and len(heads) == len(values) else None
                for i, value in zip(indices or range(len(values)), values, strict=True):
                    if into.get(i, value) != value:
                        raise ScaleStateError(
                            f"kvscale: the workers of this engine hold different {kind} "
                            f"scales for head {i} of layer {name!r} ({into[i]} and {value}); "
                            "check them with collective_rpc('kvscale_check') and push the "
                            "scales again."
                        )
                    into[i] = value
        applied = applied or their_applied
    if not layers:
        return None
    full = {
        name: (tuple(k[i] for i in sorted(k)), tuple(v[i] for i in sorted(v)))
        for name, (k, v) in layers.items()
    }
    return ScaleState(tag(full), applied, len(full))


def tag(layers: Mapping[str, tuple[Iterable[float], Iterable[float]]]) -> str:
    """The tag of ``layers`` (name -> (k heads, v heads))."""
    h = hashlib.sha256(f"{VERSION}\n".encode())
    for name in sorted(layers):
        k, v = layers[name]
        h.update(f"{name} k {value_text(tuple(k))}\n{name} v {value_text(tuple(v))}\n".encode())
    return h.hexdigest()[:16]


def readable(producer: ScaleState | None, consumer: ScaleState | None) -> bool:
    """Whether KV the producer wrote may be read by the consumer: always when the consumer's
    cache applies no scales (bf16: nothing depends on them); else only under the same tag
    (a producer without a state -- no kvscale, or no scales in force -- wrote under scales
    nobody can name: never read into a cache that applies them)."""
    if consumer is None or not consumer.applied:
        return True
    return producer is not None and producer.applied and producer.tag == consumer.tag
