"""The load cycle, decided once for every host: the weight loaders a host gives its KV
method's placeholders (``scale_loader``, ``zero_point_loader``), what each scale tensor a
loader is given holds (``read_scale``), whether a layer serves the checkpoint's k/v scales
(``serves_checkpoint_scales``), and what a load or reload does with what it loaded
(``decide``). The host adapters translate their host's API to these calls and back; what
the user is told about a cycle is worded in ``notices``.

A layer's cache serves checkpoint scales when it is a statically quantized cache
(FP8 with one scale per layer or per head) and the scheme allows it: a supported scheme,
or -- where the host's stock code does so (vLLM) -- no scheme and an FP8 cache the user
asked for. Caches that compute their scales on the fly (vLLM's ``fp8_per_token_head`` and
the int8 / int4 per-token-head modes) and layers kept out of the quantized cache
(``--kv-cache-dtype-skip-layers``: their dtype is the model's) never do: their checkpoint
scales are neither applied nor validated as served.

The one rule for a load cycle (start-up load, or a reload: an in-place weight update)
per attention layer, given whether it serves checkpoint scales:

============================================  ==============================================
what the cycle loaded                         outcome
============================================  ==============================================
a corrupt scale anywhere, cache serves them   start-up: refused (the load raises, naming
                                              every bad tensor as on disk); reload: every
                                              layer keeps the scales in force, and the host
                                              refuses the reload once it has finished
a corrupt scale, cache does not use them      nothing served changes (the corrupt values
(bf16, a scheme kvscale does not serve)       never become the scales in force); one warning
                                              names the tensors
valid k and/or v scales                       served (resolved: one k_scale / v_scale /
                                              kv_scale for both), in place; in an update
                                              call a lone k or v keeps the other in force
no scale for the layer, reload                the scales in force are kept (one warning per
                                              engine: a trainer's update carries none)
no scale for the layer, start-up              1.0 (one warning for a declared scheme,
                                              none after a dummy load)
============================================  ==============================================

Per layer, the cycle's state is one ``LayerRecord`` (the same for both hosts), kept on the
host's attention layer for its lifetime; the config of an engine owns one ``Cycle``: the
records it built in this process, which are still to be processed, the union of what their
loaders refused (read once per cycle, not once per layer), the INFO line that says, when
the last layer is processed, what the cycle served, and the cycle's one ``Verdict``:
``Cycle.judge`` applies the rule to a layer (every host-specific fact -- the cache serves
the scales, attention reads q scales, scales were expected -- is an argument) and files
the outcome; the host takes the verdict at the cycle's end (``Cycle.take_verdict``) and
only raises, returns or logs it in its own API.

Pure: hosts hand in plain tensors and flags, never a host object.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from kvscale_plugin._log import logger, warn_once
from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.scales import (
    CorruptScales,
    ResolvedScales,
    ScaleProblem,
    ScaleSource,
    resolve_kv_scales,
    scale_problem_records,
    unscaled,
)
from kvscale_plugin.scheme import SchemeVerdict
from kvscale_plugin.sharing import SharedLayers

#: Zero points a checkpoint may ship beside its scales: accepted and dropped (the KV
#: cache is quantized symmetrically; a non-zero one is warned about).
ZERO_POINT_NAMES = ("q_zero_point", "k_zero_point", "v_zero_point")

#: Cache dtypes (suffix) whose scales are computed per token and head as the cache is written.
DYNAMIC_SUFFIX = "per_token_head"


def computes_own_scales(cache_dtype: str) -> bool:
    """The cache quantizes with scales it computes itself (checkpoint scales unused)."""
    return str(cache_dtype).endswith(DYNAMIC_SUFFIX)


def serves_checkpoint_scales(verdict: SchemeVerdict, cache_dtype: str, *, quantized: bool) -> bool:
    """Whether a layer whose cache is ``cache_dtype`` (``quantized``: the host says it is
    a quantized cache) serves the checkpoint's k/v scales: a supported scheme, or no
    scheme and an FP8 cache the user chose (vLLM's stock code loads per-tensor scales
    then; SGLang builds no KV method without a scheme, so it never asks)."""
    if not quantized or computes_own_scales(cache_dtype):
        return False
    return verdict.supported or not verdict.declared


def read_scale(
    tensor_name: str,
    loaded: torch.Tensor,
    heads: HeadLayout | None = None,
    *,
    is_query: bool = False,
) -> tuple[tuple[float, ...] | None, list[ScaleProblem]]:
    """What one scale tensor a loader is given holds for this rank: ``(values, [])`` with
    one value (per-tensor) or this rank's heads (``heads``: a per-head scheme), or
    ``(None, problems)``. Every element of the full tensor is checked (all heads, not only
    this rank's), and a tensor whose heads cannot be placed on this rank is a problem."""
    shape = tuple(loaded.shape)
    expected = None if heads is None else heads.expected_heads(shape, is_query=is_query)
    problems = scale_problem_records(tensor_name, loaded, num_heads=expected)
    if not problems and heads is not None and heads.heads is None:
        problems = [ScaleProblem(tensor_name, str(heads.problem))]
    if problems:
        return None, problems
    values = loaded.detach().float().reshape(-1)
    if heads is None:
        return (float(values[0]),), []
    return heads.take(values, is_query=is_query), []


# Loaders are plain functions (not functools.partial): vLLM's in-place reload wraps them
# and reads their __name__; its replay binds the first argument "param". SGLang passes
# loaders extra positional arguments (shard ids), which they ignore.
def scale_loader(
    record: LayerRecord, kind: str, heads: HeadLayout | None, *, into_param: bool = False
) -> Callable[..., None]:
    """Scale ``kind``'s weight loader, the same for every host: each tensor it is given is
    read by ``loadcycle.read_scale`` (every element checked, this rank's ``heads`` kept); a
    bad one goes to the layer's record of refusals (``corrupt``, ``corrupt_q`` for a q
    scale; reported with every other after loading), a good one to ``record.loaded``. The
    served tensors change only when the cycle is processed. ``into_param``: the value is
    copied into the placeholder too (vLLM's layerwise reload counts the elements a loader
    copies to know that a layer loaded something; SGLang's placeholder is the served
    tensor, which must not change before the cycle is decided)."""
    is_query = kind == "q_scale"
    corrupt = record.corrupt_q if is_query else record.corrupt

    def load_kv_scale(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        name = record.tensor_name(kind)
        corrupt.forget(name)
        values, problems = read_scale(name, loaded_weight, heads, is_query=is_query)
        if values is None:
            corrupt.add(problems)
            return
        record.loaded[kind] = values
        if into_param:
            param.data.copy_(torch.tensor(values, dtype=torch.float32).reshape(param.shape))

    return load_kv_scale


def zero_point_loader(tensor_name: str) -> Callable[..., None]:
    """Zero points are accepted and dropped (symmetric only); a non-zero one is reported."""

    def load_kv_zero_point(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        if loaded_weight.numel() and bool((loaded_weight.float() != 0).any()):
            warn_once(
                f"zero-point:{tensor_name}",
                "kvscale: checkpoint tensor '%s' holds a non-zero zero point; KV-cache "
                "quantization is symmetric here, so it is ignored. Re-export the checkpoint "
                "with a symmetric kv_cache_scheme if K/V are off-centre.",
                tensor_name,
            )

    return load_kv_zero_point


class Action(str, Enum):
    """What a layer's post-load processing does with its served scales."""

    SERVE = "serve"  # write ``Outcome.resolved`` (in place)
    KEEP = "keep"  # leave the scales in force as they are
    REFUSE = "refuse"  # a start-up load with corrupt scales: raise naming every tensor


@dataclass(frozen=True)
class Outcome:
    """The decision for one layer of a load cycle (``decide``)."""

    action: Action
    resolved: ResolvedScales | None = None  # what SERVE writes
    # KEEP of a reload refused for corrupt scales (the host refuses it once it finished).
    refused: bool = False
    # KEEP of a reload that carried no scale for this layer (warned about once).
    carried_none: bool = False
    # Corrupt scales the layer's cache does not use (warned about, never served).
    unused_corrupt: bool = False

    @property
    def missing(self) -> bool:
        """SERVE of 1.0 for a layer that serves checkpoint scales but loaded none."""
        return self.resolved is not None and self.resolved.source is ScaleSource.DEFAULT


def decide(
    *,
    serves: bool,
    reload: bool,
    corrupt: bool,
    k: tuple[float, ...] | None,
    v: tuple[float, ...] | None,
    fnuz: bool = False,
) -> Outcome:
    """The rule of the module docstring for one layer: ``serves`` (its cache serves
    checkpoint scales: ``serves_checkpoint_scales``), ``reload`` (the layer has served
    before), ``corrupt`` (the cycle refused a tensor anywhere in the model), ``k`` / ``v``
    (what the cycle loaded for this layer, validated; None: nothing)."""
    if not serves:
        return Outcome(Action.SERVE, unscaled(), unused_corrupt=corrupt)
    if corrupt:
        return Outcome(Action.KEEP, refused=True) if reload else Outcome(Action.REFUSE)
    if k is None and v is None and reload:
        return Outcome(Action.KEEP, carried_none=True)
    return Outcome(Action.SERVE, resolve_kv_scales(k, v, fnuz=fnuz))


@dataclass
class Verdict:
    """What one load cycle did, filed layer by layer by ``Cycle.judge`` (tensors named as
    on disk, layers by the host's names). The host reports it in its own API."""

    #: the cycle is refused for these: at start-up the load raises; in a reload every
    #: layer kept the scales in force. Corrupt k/v scales, and q scales where attention
    #: reads them.
    refused: CorruptScales = field(default_factory=CorruptScales)
    #: corrupt k/v scales no cache uses (a bf16 cache): warned about, never served.
    unused: CorruptScales = field(default_factory=CorruptScales)
    #: corrupt q scales nothing reads: warned about, never served.
    unread_q: CorruptScales = field(default_factory=CorruptScales)
    #: layers a reload carried no scale for: they keep the scales in force.
    kept_without_scales: list[str] = field(default_factory=list)
    #: layers served 1.0 for want of scales where scales were expected.
    missing: list[str] = field(default_factory=list)
    #: a layer of the cycle had served before (the cycle is a reload).
    reload: bool = False
    #: a layer of the cycle is a speculative-decoding draft's.
    draft: bool = False
    #: a layer was given new k/v scales (the cycle counts as a scale update).
    took_scales: bool = False


#: The attribute a host's attention layer keeps its ``LayerRecord`` in.
RECORD_ATTR = "kvscale_record"


@dataclass(eq=False)
class LayerRecord:
    """One attention layer's load-cycle state, for every host: built with the layer (by
    ``Cycle.record``), kept on it for its lifetime, read and written by the host's KV
    method, its scale loaders and its reload check."""

    name: str
    #: per-head schemes: which checkpoint heads this rank serves (``heads.HeadLayout``).
    heads: HeadLayout | None = None
    #: the layer whose KV cache this one reads (``sharing.py``), or None.
    target: str | None = None
    #: what this cycle's loaders read, validated: kind (``k_scale``...) -> values.
    loaded: dict[str, tuple[float, ...]] = field(default_factory=dict)
    #: what they refused (k/v; q apart: only hosts that quantize queries refuse it).
    corrupt: CorruptScales = field(default_factory=CorruptScales)
    corrupt_q: CorruptScales = field(default_factory=CorruptScales)
    #: kind -> the checkpoint tensor loaded into it when it is not ``<name>.<kind>`` (an
    #: MTP layer's scale loaded into a draft layer): problems are named by it.
    checkpoint_names: dict[str, str] = field(default_factory=dict)
    #: the scales in force (None until the layer first served: then a load is a reload),
    #: the loaded values they came from (where a host keeps them), and how the INFO line
    #: counts them.
    resolved: ResolvedScales | None = None
    raw: dict[str, tuple[float, ...]] | None = None
    source: str | None = None
    #: judged in the cycle being reported (a layer no KV method processed is judged when
    #: the host ends the cycle: ``Cycle.judge``).
    judged: bool = False
    #: a speculative-decoding draft's layer (its own warnings and reload rules).
    draft: bool = False
    #: host-side copies kept equal to the served k/v scales (SGLang's Qwen3 fused write).
    mirrors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def tensor_name(self, kind: str) -> str:
        """The name problems with scale ``kind`` are reported by."""
        return self.checkpoint_names.get(kind, f"{self.name}.{kind}")

    def start(self) -> None:
        """A new load cycle: nothing loaded yet, and what an earlier one refused under
        this layer's names is moot (records a host re-filed under other names stay until
        its reload check reads them)."""
        self.loaded.clear()
        for records in (self.corrupt, self.corrupt_q):
            records.forget_under(self.name)
            for name in self.checkpoint_names.values():
                records.forget(name)

    def value(self, kind: str) -> tuple[float, ...] | None:
        """What this cycle loaded for ``kind`` (None: nothing)."""
        return self.loaded.get(kind)

    def served(self, resolved: ResolvedScales, source: str | None = None) -> None:
        """The layer now serves ``resolved``, counted as ``source`` (default: its own)."""
        self.resolved = resolved
        self.source = source or resolved.source.value


class Cycle:
    """One engine's load cycles in this process (its config owns it): the layers' records,
    the layers still to process in the current cycle, and at its end one INFO line on what
    they were given (otherwise ``--quantization kvscale`` says nothing at a host's default
    log level). Reloads and MTP drafts build their layers again: each cycle gets its line."""

    def __init__(
        self,
        target_of: Callable[[LayerRecord], str | None] | None = None,
        on_disk: Mapping[str, str] | None = None,
    ) -> None:
        self.records: weakref.WeakValueDictionary[str, LayerRecord] = weakref.WeakValueDictionary()
        # Whose cache a layer reads, where the host knows it only after building the
        # layer (vLLM): asked when the cycle's refusals are gathered.
        self._target_of = target_of
        # The host's parameter name -> checkpoint tensor (as on disk), kept up to date by
        # its name mapping: the verdict names tensors as the file does.
        self._on_disk: Mapping[str, str] = on_disk if on_disk is not None else {}
        self.pending: set[str] = set()
        # The host's own load is running (``begin`` .. ``close``): scale tensors go to the
        # KV method's loaders then. Known from the cycle, never from placeholder
        # attributes (vLLM >= 0.34 keeps its placeholders after loading).
        self.loading = False
        self.partial = False  # an update call: changes only what it names
        # Tensors refused for layers this process does not hold (another pipeline stage's):
        # every rank judges the whole update, so a refusal anywhere is one everywhere.
        self.elsewhere = CorruptScales(self._changed)
        self._processed: dict[str, tuple[str, ResolvedScales, str]] = {}
        self._refused: tuple[CorruptScales, CorruptScales] | None = None
        self.verdict = Verdict()
        # How many times the host loaded the model's weights (0 after a dummy load: SGLang
        # counts them); whether the entry point running the cycle reports its verdict.
        self.weight_loads = 0
        self.caller_reports = False

    def record(self, name: str, layer: object, **fields: Any) -> LayerRecord:
        """A new record for ``layer``, registered under ``name`` and kept on the layer
        (``attach_record``); its refusals reach the cycle."""
        record = LayerRecord(
            name,
            corrupt=CorruptScales(self._changed),
            corrupt_q=CorruptScales(self._changed),
            **fields,
        )
        self.records[name] = record
        return attach_record(layer, record)

    def _changed(self) -> None:
        self._refused = None

    def built(self, name: str) -> None:
        """Layer ``name`` takes part in the cycle (built, or re-armed for a reload)."""
        self.pending.add(name)
        self.loading = True

    def begin(self, loading: bool = True) -> None:
        """The host's own load starts (a reload entry point that re-creates nothing), or
        has ended (``loading=False``: scale tensors sent after it are an update)."""
        self.loading = loading
        self.elsewhere.clear()

    def refused(self) -> tuple[CorruptScales, CorruptScales]:
        """Every k/v and every q tensor the cycle's layers refused (layers that read another
        layer's cache left out: their own scales are unused), computed again only after a
        loader changed a record."""
        if self._refused is None:
            kv, q = CorruptScales(), CorruptScales()
            kv.update(self.elsewhere)
            for record in list(self.records.values()):
                if self._target_of is not None:
                    record.target = self._target_of(record)
                if record.target is None:
                    kv.update(record.corrupt)
                    q.update(record.corrupt_q)
            self._refused = (kv, q)
        return self._refused

    def judge(
        self,
        record: LayerRecord,
        *,
        serves: bool,
        reads_q: bool = False,
        declared: bool = True,
        dummy_load: bool = False,
        fnuz: bool = False,
    ) -> Outcome:
        """``decide`` for ``record``'s layer with what this cycle loaded and refused, filed in
        the cycle's verdict. ``serves``: its cache serves checkpoint scales
        (``serves_checkpoint_scales``); ``reads_q``: its attention reads q scales (a corrupt
        one is then refused with the k/v scales; else it is unread); ``declared``: the
        checkpoint declares a KV scheme (without one, a layer without scales is not
        warned about, as stock); ``dummy_load``: no checkpoint was loaded (a dummy start:
        no scale is missing); ``fnuz``: the platform's FP8 is e4m3fnuz."""
        kv, q = self.refused()
        reads = serves and reads_q
        corrupt = CorruptScales.union(kv, q) if reads and q else kv
        reload = record.resolved is not None
        k, v = record.value("k_scale"), record.value("v_scale")
        if reload and self.partial and (k is None) != (v is None):
            # An update call that names k only (or v only) keeps the other in force
            # (bucketed senders split a layer's k and v across calls).
            k, v = _keep_other(record, k, v, 2.0 if fnuz else 1.0)
        outcome = decide(
            serves=serves,
            reload=reload,
            corrupt=bool(corrupt),
            k=k,
            v=v,
            fnuz=fnuz,
        )
        verdict = self.verdict
        verdict.reload |= reload
        verdict.draft |= record.draft
        verdict.took_scales |= outcome.action is Action.SERVE and (
            record.value("k_scale") is not None or record.value("v_scale") is not None
        )
        record.judged = True
        if q and not reads:
            verdict.unread_q.update(q.renamed(self._on_disk))
        if corrupt and (outcome.action is Action.REFUSE or outcome.refused):
            verdict.refused.update(corrupt.renamed(self._on_disk))
        elif corrupt and outcome.unused_corrupt:
            verdict.unused.update(corrupt.renamed(self._on_disk))
        without = outcome.carried_none or (outcome.missing and not dummy_load)
        listed = verdict.kept_without_scales if outcome.carried_none else verdict.missing
        if declared and without and record.name not in listed:
            listed.append(record.name)
        return outcome

    def take_verdict(self) -> Verdict:
        """The cycle's verdict, for the host to report; the next cycle files a new one
        (and judges every layer again)."""
        verdict, self.verdict = self.verdict, Verdict()
        for record in list(self.records.values()):
            record.judged = False
        return verdict

    def done(self, record: LayerRecord, pool: str, *, prefix: str = "") -> bool:
        """``record`` was processed (its cache dtype ``pool``); True when it was the
        cycle's last, after the INFO line (``prefix``: e.g. for an MTP draft's line)."""
        assert record.resolved is not None and record.source is not None
        self.pending.discard(record.name)
        self._processed[record.name] = (record.source, record.resolved, pool)
        if self.pending:
            return False
        line = describe_loaded_layers(
            [(source, resolved) for source, resolved, _ in self._processed.values()],
            [pool for _, _, pool in self._processed.values()],
        )
        logger.info("%s%s", prefix, line)
        self._processed.clear()
        return True

    def sharing_records(self) -> Iterable[tuple[LayerRecord, ResolvedScales]]:
        """Each layer that reads another layer's cache, with what that layer serves now."""
        for record in list(self.records.values()):
            target = self.records.get(record.target) if record.target else None
            if target is not None and target.resolved is not None:
                yield record, target.resolved


def _keep_other(
    record: LayerRecord, k: tuple[float, ...] | None, v: tuple[float, ...] | None, factor: float
) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    """A reload's lone k (or v) with the other scale in force (as loaded: the platform's
    ``factor`` out); a layer whose cache used no scales, or whose scales came from one
    scale for k and v, duplicates it, as at start-up."""
    current = record.resolved
    if current is None or current.source in (ScaleSource.UNSCALED, ScaleSource.DUPLICATED):
        return k, v
    n = len(k or v or ())
    held = current.k_heads if k is None else current.v_heads
    other = tuple(x / factor for x in (held if len(held) == n else (max(held),) * n))
    return (other, v) if k is None else (k, other)


def serve_target(
    notes: SharedLayers,
    record: LayerRecord,
    target: ResolvedScales | None,
    own: tuple[tuple[float, ...] | None, tuple[float, ...] | None],
    on_disk: Mapping[str, str],
) -> ResolvedScales:
    """What a layer that reads another layer's cache serves: ``target``, the scales that
    layer serves (unscaled until it has served; the cycle's end re-syncs). What the
    checkpoint shipped under the layer's own name (``own``: k, v) and what its loaders
    refused there (named as on disk: ``on_disk``, parameter -> checkpoint name) are unused:
    noted in ``notes``, warned about once at the cycle's end (``sharing.SharedLayers``)."""
    resolved = target or unscaled()
    notes.note_own_scales(record.name, str(record.target), own[0], own[1], resolved)
    if record.corrupt:
        notes.note_unused_corrupt(record.corrupt.renamed(on_disk).as_mapping())
        record.corrupt.clear()
    return resolved


def layer_record(layer: object) -> LayerRecord | None:
    """The record a host's attention layer keeps (None: a layer kvscale never served)."""
    return getattr(layer, "__dict__", {}).get(RECORD_ATTR)


def attach_record(layer: object, record: LayerRecord) -> LayerRecord:
    """Keep ``record`` on ``layer`` for the layer's lifetime (every reload path of a host
    finds the layer object again, whatever it re-creates around it)."""
    setattr(layer, RECORD_ATTR, record)
    return record


def describe_loaded_layers(
    layers: Iterable[tuple[str, ResolvedScales]], pool_dtypes: Iterable[str]
) -> str:
    """One line on what a load cycle gave a set of attention layers: ``layers`` are
    ``(source, resolved)`` pairs (``ScaleSource`` value or ``"shared"``, ``ResolvedScales``),
    ``pool_dtypes`` each layer's KV-cache dtype as the host names it. For the INFO line a
    user reads to know what kvscale did (which scales, which pool)."""
    pairs = list(layers)
    pools = sorted(set(pool_dtypes))
    by_source: dict[str, list[ResolvedScales]] = {}
    for source, resolved in pairs:
        by_source.setdefault(source, []).append(resolved)
    parts = []
    scaled = by_source.get("checkpoint", []) + by_source.get("duplicated", [])
    if scaled:
        per_head = any(r.per_head for r in scaled)
        k = [x for r in scaled for x in r.k_heads]
        v = [x for r in scaled for x in r.v_heads]
        parts.append(
            f"{len(scaled)} with the checkpoint's {'per-head' if per_head else 'per-tensor'} "
            f"scales (k {min(k):.4g}..{max(k):.4g}, v {min(v):.4g}..{max(v):.4g})"
        )
    if by_source.get("duplicated"):
        parts.append(f"{len(by_source['duplicated'])} of them from one kv_scale for k and v")
    if by_source.get("default"):
        parts.append(f"{len(by_source['default'])} without scales (1.0: see the warning)")
    if by_source.get("shared"):
        parts.append(f"{len(by_source['shared'])} reading another layer's cache, with its scales")
    if by_source.get("unscaled"):
        parts.append(
            f"{len(by_source['unscaled'])} with a KV cache that does not use scales "
            "(not FP8, or a scheme kvscale does not serve)"
        )
    return (
        f"kvscale: {len(pairs)} attention layer(s) loaded, KV cache {'/'.join(pools)}: "
        + "; ".join(parts)
        + "."
    )
