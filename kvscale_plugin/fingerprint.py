"""Scale fingerprints: which KV scales an engine serves, as a short digest a trainer can
compare with the one of the tensors it sent (RL weight syncs: docs/reliability.md).

Canonical form (one line per main-stack attention layer and scale, sorted by layer then
``k`` before ``v``)::

    <layer index> <k|v> <float32 values, hex, comma-separated>

* the layer index is the ``N`` of ``[model.[language_model.]]layers.N.`` -- of the
  checkpoint tensor name on the trainer's side, of vLLM's / SGLang's attention layer
  name in the engine; layers outside the main stack (MTP drafts, vision towers) are
  not part of it;
* values are the checkpoint's convention: before the x2 of an ``e4m3fnuz`` platform
  (an engine halves what it serves there);
* one value for a per-tensor scale; for a per-head scale, the KV heads one tensor-parallel
  rank serves (``scales.rank_kv_heads``), so each TP rank has its own fingerprint and the
  trainer passes ``tp_rank`` / ``tp_size``;
* q scales are not part of it (no host kvscale serves reads them but vLLM's FA3 path).

An engine appends, after those lines, one ``! <index> <k|v> <copy> <value>`` line for each
served copy (a float, a CPU copy, a per-layer max) that disagrees with its device tensor:
a consistent engine's digest equals the trainer's, a wrong copy changes it.

The digest is the first 16 hex digits of the SHA-256 of ``kvscale-fp1\\n`` and the lines
(each ending in ``\\n``). Host-free: imports torch only.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Collection, Iterable, Mapping, Sequence

import torch

from kvscale_plugin.names import main_stack_index
from kvscale_plugin.scales import rank_kv_heads

VERSION = "kvscale-fp1"
_KINDS = {"k_scale": "k", "v_scale": "v"}


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
) -> list[str]:
    """The canonical lines of scale tensors as a checkpoint names them
    (``model.layers.N.self_attn.k_scale``, ``...k_proj.k_scale``: any name ending in
    ``k_scale`` / ``v_scale`` under ``layers.N``); other tensors are skipped, and so are
    layers not in ``layers`` (when given: a pipeline stage's)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    entries: dict[tuple[int, str], str] = {}
    for name, tensor in items:
        kind = _KINDS.get(name.rsplit(".", 1)[-1])
        index = main_stack_index(name)
        if kind is None or index is None or (layers is not None and index not in layers):
            continue
        values = tensor.detach().float().reshape(-1).tolist()
        if len(values) > 1:  # per head: this rank's
            values = [values[h] for h in rank_kv_heads(len(values), tp_rank, tp_size)]
        entries[(index, kind)] = entry_line(index, kind, values)
    return [entries[key] for key in sorted(entries)]


def scale_fingerprint(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    *,
    tp_rank: int = 0,
    tp_size: int = 1,
    layers: Collection[int] | None = None,
) -> str:
    """The fingerprint an engine (or its TP rank ``tp_rank`` of ``tp_size``) reports once
    it serves ``tensors``: the k/v scale tensors a trainer is about to send, named as a
    checkpoint names them. Compare it with ``worker_fingerprint`` (vLLM, through
    ``collective_rpc``) after the sync. Other tensors in ``tensors`` are ignored, so the
    whole update may be passed. ``layers``: only these layer indices (a pipeline-parallel
    worker serves its stage's: pass its ``worker_fingerprint(...)["layers"]``)."""
    return digest(canonical_lines(tensors, tp_rank=tp_rank, tp_size=tp_size, layers=layers))
