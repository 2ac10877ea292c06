"""Scale fingerprints: which KV scales an engine serves, as a short digest a trainer can
compare with the one of the tensors it sent (RL weight syncs: docs/reliability.md).

Canonical form (one line per main-stack attention layer and scale, sorted by layer then
``k`` before ``v``)::

    <layer index> <k|v> <float32 values, hex, comma-separated>

* the layer index is the model's own layer number (``layer_index``: the first number
  in the name, as vLLM's ``extract_layer_index`` reads it: ``model.layers.N``,
  ``transformer.h.N``, ``gpt_neox.layers.N``, ``model.language_model.layers.N``) -- of
  the checkpoint tensor name on the trainer's side, of vLLM's / SGLang's attention layer
  name in the engine; MTP drafts' own layers (``mtp.layers.N``) are not part of it, nor,
  on the engine's side, layers that read another layer's cache (pass the engine's
  ``layers`` to leave them out on the trainer's);
* values are the checkpoint's convention: before the x2 of an ``e4m3fnuz`` platform
  (an engine halves what it serves there);
* one value for a per-tensor scale; for a per-head scale, the KV heads one tensor-parallel
  rank serves (``scales.rank_kv_heads``), so each TP rank has its own fingerprint and the
  trainer passes ``tp_rank`` / ``tp_size``;
* q scales are not part of it (no host kvscale serves reads them but vLLM's FA3 path).

An engine appends, after those lines, one ``! <index> <k|v> <copy> <value>`` line for each
served copy (a float, a CPU copy, a per-layer max) that disagrees with its device tensor:
a consistent engine's digest equals the trainer's, a wrong copy changes it.

The digest is the first 16 hex digits of the SHA-256 of ``kvscale-fp2\\n`` and the lines
(each ending in ``\\n``). It fails closed: a fingerprint over no attention layer is an
error (``FingerprintError``), never the digest of nothing. Host-free: imports torch only
(and, for a name only a third-party rule knows, the rule manager: ``kvscale_plugin.names``).

Scale names a trainer may send, as the engines take them: ``<attention module>.k_scale``
/ ``.v_scale``, ``<...>.k_proj.k_scale`` / ``k_proj.output_scale`` (and v), the legacy
single ``<...>.kv_scale`` (a k and a v line), and any name an installed third-party
name-mapping rule package maps (``kvscale_plugin.names.map_scale_name``, the same rules
the engine applies: keyed by the host name it maps to).
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from kvscale_plugin.scales import rank_kv_heads

VERSION = "kvscale-fp2"
_NUMBER = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")
_MTP_OWN = re.compile(r"(?:^|\.)(?:mtp_layers|mtp\.layers)\.\d+\.")


class FingerprintError(ValueError):
    """A fingerprint that would cover no attention layer (it would check nothing)."""


def layer_index(name: str) -> int | None:
    """The model's own layer number in a layer or tensor name (its first number), None
    for an MTP draft's own layers or a name without one."""
    if _MTP_OWN.search(name):
        return None
    found = _NUMBER.search(name)
    return int(found.group(1)) if found else None


def scale_kinds(name: str) -> tuple[str, ...]:
    """Which of k / v a scale tensor called ``name`` sets (none: not a k/v scale)."""
    parts = name.rsplit(".", 2)
    last = parts[-1]
    if last in ("k_scale", "v_scale"):
        return (last[0],)
    if last == "kv_scale":
        return ("k", "v")
    if last == "output_scale" and len(parts) == 3 and parts[1] in ("k_proj", "v_proj"):
        return (parts[1][0],)
    return ()


def value_text(values: Sequence[float]) -> str:
    """Values as float32 bit patterns (hex), comma-separated: exact, platform-free."""
    return ",".join(struct.pack("<f", float(x)).hex() for x in values)


def entry_line(index: int, kind: str, values: Sequence[float]) -> str:
    """One canonical line: ``kind`` is ``k`` or ``v``."""
    return f"{index} {kind} {value_text(values)}"


def digest(lines: Iterable[str]) -> str:
    """The fingerprint of canonical lines (sorted by the caller)."""
    h = hashlib.sha256(f"{VERSION}\n".encode())
    for line in lines:
        h.update(f"{line}\n".encode())
    return h.hexdigest()[:16]


def canonical_lines(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: Collection[int] | None = None,
    applied: bool = True,
    host: str = "vllm",
    model_type: str | None = None,
) -> list[str]:
    """The canonical lines of scale tensors as a checkpoint names them (``scale_kinds``,
    under a numbered layer: ``layer_index``; a name only a third-party rule knows: as the
    rules map it for ``host`` and ``model_type``); other tensors are skipped, and so are
    layers not in ``layers`` (when given: a pipeline stage's, the engine's). ``applied``
    False: the engine's caches apply no scales (bf16), so it serves every value as 1.0."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    entries: dict[tuple[int, str], str] = {}
    for name, tensor in items:
        kinds = scale_kinds(name)
        if not kinds and name.rsplit(".", 1)[-1] not in _NOT_SCALES:
            # A name only a third-party rule knows: keyed by the host name the rules give
            # it, as the engine applies them to what it is sent.
            from kvscale_plugin.names import map_scale_name

            name = map_scale_name(name, host, model_type) or name
            kinds = scale_kinds(name)
        index = layer_index(name) if kinds else None
        if index is None or (layers is not None and index not in layers):
            continue
        values = tensor.detach().float().reshape(-1).tolist()
        if len(values) > 1:  # per head: this rank's
            values = [values[h] for h in rank_kv_heads(len(values), tp_rank, tp_size)]
        if not applied:
            values = [1.0] * len(values)
        for kind in kinds:
            entries[(index, kind)] = entry_line(index, kind, values)
    return [entries[key] for key in sorted(entries)]


#: Tensor names (last part) no rule maps to a k/v scale: the weights a sync sends along
#: are not offered to the rule packages one by one.
_NOT_SCALES = frozenset({"weight", "bias", "weight_scale", "input_scale", "q_scale"})


def scale_fingerprint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: Collection[int] | None = None,
    applied: bool = True,
    host: str = "vllm",
    model_type: str | None = None,
) -> str:
    """The fingerprint an engine (or its TP rank ``tp_rank`` of ``tp_size``) reports once
    it serves ``tensors``: the k/v scale tensors a trainer is about to send, named as a
    checkpoint names them. Compare it with ``worker_fingerprint`` (vLLM, through
    ``collective_rpc``) after the sync. Other tensors in ``tensors`` are ignored, so the
    whole update may be passed. ``layers``: only these layer indices (a pipeline-parallel
    worker serves its stage's: pass its ``worker_fingerprint(...)["layers"]``);
    ``applied``: the worker's ``["applied"]`` (False on a bf16 cache, which serves every
    scale as 1.0: the lines then hold 1.0, so a bf16 engine and its trainer agree);
    ``host`` / ``model_type``: what third-party name-mapping rules are asked with (the
    worker's ``["model_type"]``), for names only such a rule knows. Raises
    ``FingerprintError`` when no tensor is a k/v scale of a numbered layer (there)."""
    lines = canonical_lines(
        tensors,
        tp_rank=tp_rank,
        tp_size=tp_size,
        layers=layers,
        applied=applied,
        host=host,
        model_type=model_type,
    )
    if not lines:
        raise FingerprintError(
            "kvscale: none of these tensors is a k/v scale of a numbered attention layer"
            + (f" among layers {sorted(layers)}" if layers is not None else "")
            + ": a fingerprint over them would check nothing. Pass the scale tensors the "
            "trainer sends (names ending in k_scale / v_scale / kv_scale)."
        )
    return digest(lines)
