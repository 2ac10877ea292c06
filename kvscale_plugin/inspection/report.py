"""Building the ``kvscale inspect`` report from ``config.json`` and the checkpoint's tensors.

Through the same core the host adapters use: the scheme verdict
(``scheme.judge_kv_cache_scheme``), the name-mapping hooks (``names.map_scale_name``:
pluggy, third-party rules included) and the scale rules (``scales.scale_problems``,
``resolve_kv_scales``). Per-head scales (``strategy: attn_head``) are checked against
the head counts of ``config.json``; kvscale's view holds every head (``k_heads`` /
``v_heads``) and, as ``k`` / ``v``, the per-layer max that one-scale paths use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvscale_plugin.checkpoint import Checkpoint, TensorInfo, open_checkpoint
from kvscale_plugin.inspection import config as cfg
from kvscale_plugin.inspection.hostversion import parse_host
from kvscale_plugin.inspection.problems import collect_problems
from kvscale_plugin.inspection.records import (
    ERROR,
    Heads,
    InspectReport,
    LayerRow,
    LayerView,
    Problem,
    ScaleTensor,
    TensorProblem,
)
from kvscale_plugin.inspection.stock import judge_stock, stock_summary
from kvscale_plugin.inspection.tensors import (
    SCALE_LIKE,
    TARGET,
    decode,
    naming,
    zero_point_value,
)
from kvscale_plugin.inspection.vllm_layers import checkpoint_modules, served_on_any
from kvscale_plugin.inspection.weights import WeightVerdict, combine, judge_weights
from kvscale_plugin.names import map_scale_name
from kvscale_plugin.scales import ScaleSource, resolve_kv_scales
from kvscale_plugin.scheme import SchemeVerdict, judge_kv_cache_scheme
from kvscale_plugin.sharing import kv_sharing_targets


@dataclass(frozen=True)
class _Model:
    """What ``config.json`` says about the layers that hold a KV cache."""

    model_type: str | None
    n: int | None  # num_hidden_layers (None: unknown)
    mtp: int
    attn_layers: list[int] | None
    kv_heads: int | None
    q_heads: int | None
    #: ``architectures[0]`` and the vLLM release reported against: which translation of
    #: the model's names applies (``vllm_layers``).
    architecture: str | None = None
    vllm_release: str | None = None


def inspect_checkpoint(
    model_dir: str | Path,
    host: str = "vllm",
    before_read: Callable[[TensorInfo], None] | None = None,
) -> InspectReport:
    """Inspect ``model_dir`` for ``host`` (``vllm``, ``vllm==0.31.0``, ``sglang``, ...:
    the installed release unless one is named). Raises ``CheckpointError`` on unusable
    input. ``before_read``: called with each tensor before it is decoded (``inspection.hub``
    fetches its bytes then)."""
    release = parse_host(host)
    with open_checkpoint(model_dir, before_read=before_read) as ckpt:
        # Where kvscale refuses a corrupt q scale: where attention may read it (vLLM on a
        # GPU platform, or a release named without its platform); never on SGLang (no
        # q scale parameter) or vLLM's CPU build (its attention never reads one).
        q_read = release.host == "vllm" and release.platform != "cpu"
        report = _inspect(ckpt, release.host, q_read=q_read, version=release.version)
        qc = cfg.quant_config(ckpt.config)
    report.host_version = release.version
    report.host_note = release.note
    report.stock_engine = release.engine
    _judge_weights(report, judge_weights(qc, release.host, release.version, release.platform))
    return report


def _judge_weights(report: InspectReport, weights: WeightVerdict) -> None:
    """Keep the KV-cache verdicts apart, and let the weight verdict decide the engine's:
    a start is never predicted for weight schemes inspect does not judge."""
    report.weights = weights
    report.stock_kv_outcome, report.stock_kv_summary = report.stock_outcome, report.stock_summary
    report.kvscale_kv_outcome = report.kvscale_outcome
    report.kvscale_kv_summary = report.kvscale_summary
    report.stock_outcome, report.stock_summary = combine(
        report.stock_outcome, report.stock_summary, weights
    )
    report.kvscale_outcome, report.kvscale_summary = combine(
        report.kvscale_outcome, report.kvscale_summary, weights
    )
    if weights.outcome == "unsupported":
        report.problems.insert(
            0,
            Problem(
                ERROR,
                "unsupported_weight_scheme",
                f"{weights.reason}: start-up stops while the weights are processed, stock "
                "and kvscale alike (measured). The KV-cache verdicts below are what the "
                "cache would do on a platform that serves these weights.",
            ),
        )


def _inspect(
    ckpt: Checkpoint, host: str, *, q_read: bool = True, version: str | None = None
) -> InspectReport:
    config = ckpt.config
    archs = config.get("architectures")
    tc = cfg.text_config(config)
    n = cfg.layer_count(tc)
    kv_heads, q_heads = cfg.head_counts(config)
    model = _Model(
        model_type=config.get("model_type") if isinstance(config.get("model_type"), str) else None,
        n=n,
        mtp=cfg.mtp_count(tc),
        attn_layers=cfg.attention_layers(tc, n),
        kv_heads=kv_heads,
        q_heads=q_heads,
        architecture=archs[0]
        if isinstance(archs, list) and archs and isinstance(archs[0], str)
        else None,
        vllm_release=version.split("+")[0] if host == "vllm" and version else None,
    )
    qc = cfg.quant_config(config)
    scheme = qc.get("kv_cache_scheme") if qc is not None else None
    quant_method = qc.get("quant_method") if qc is not None else None
    verdict = judge_kv_cache_scheme(scheme)
    per_head = _declares_attn_head(verdict, scheme)
    heads = (
        Heads(kv_heads, q_heads, config_groups=qc is not None and "config_groups" in qc)
        if per_head
        else None
    )

    tensors, rows, mapping = _scale_tensors(ckpt, host, model, heads)

    # A supported scheme: every attention layer needs its k/v scales.
    if verdict.supported and model.attn_layers is not None:
        present = {r.index for r in rows.values() if r.known and not r.mtp and (r.k or r.v)}
        template = _row_template(rows.values())
        for i in model.attn_layers:
            if i not in present:
                layer = template.format(i=i)
                rows.setdefault(layer, LayerRow(layer=layer, index=i, mtp=False))

    layers = list(rows.values())
    _judge_rows(layers, verdict, heads)
    judge_stock(layers, verdict, scheme, host, model.model_type, heads)
    _judge_sharing(layers, kv_sharing_targets(tc), verdict)
    problems = collect_problems(tensors, layers, verdict, n, model.attn_layers, heads)

    stock_engine, stock_outcome, stock_text, stock_basis = stock_summary(
        host, verdict, scheme, layers, heads
    )
    kv_outcome, kv_summary = _kvscale_summary(
        verdict, layers, tensors, qc, heads, host, q_read=q_read
    )

    layers.sort(
        key=lambda r: (not r.problems, r.mtp, r.index if r.index is not None else 1 << 30, r.layer)
    )
    files = [
        {"name": p.name, "tensors": ckpt.tensors_per_file.get(p, 0), "bytes": p.stat().st_size}
        for p in ckpt.files
    ]
    return InspectReport(
        model_dir=str(ckpt.model_dir),
        host=host,
        model_type=model.model_type,
        num_hidden_layers=n,
        attention_layers=model.attn_layers,
        mtp_layers=model.mtp,
        num_kv_heads=kv_heads,
        num_attention_heads=q_heads,
        per_head=per_head,
        sharded=ckpt.sharded,
        files=files,
        num_tensors=len(ckpt.tensors),
        total_bytes=sum(f["bytes"] for f in files),
        bytes_read=ckpt.bytes_read,
        verdict=verdict,
        declared_scheme=scheme,
        quant_method=quant_method if isinstance(quant_method, str) else None,
        stock_engine=stock_engine,
        stock_outcome=stock_outcome,
        stock_summary=stock_text,
        stock_basis=stock_basis,
        kvscale_outcome=kv_outcome,
        kvscale_summary=kv_summary,
        mapping=[
            {"pattern": pat, "target": tgt, "count": c}
            for (pat, tgt), c in sorted(mapping.items(), key=lambda x: x[0][0])
        ],
        problems=problems,
        layers=layers,
        tensors=sorted(tensors, key=lambda t: (not t.problems, t.name)),
    )


def _scale_tensors(
    ckpt: Checkpoint, host: str, model: _Model, heads: Heads | None
) -> tuple[list[ScaleTensor], dict[str, LayerRow], Counter[tuple[str, str | None]]]:
    """Every scale-like tensor (decoded, with its problems), the layer rows they fill, and
    the name mapping (checkpoint pattern -> host pattern: count). Weights are never read."""
    tensors: list[ScaleTensor] = []
    rows: dict[str, LayerRow] = {}
    mapping: Counter[tuple[str, str | None]] = Counter()

    for name, info in ckpt.tensors.items():
        target = map_scale_name(name, host, model.model_type)
        if target is None and not SCALE_LIKE.search(name):
            continue  # a weight, never read
        served = None
        if host == "vllm":
            # The architecture's own translation, as measured on that release's engine.
            modules = checkpoint_modules(name, target)
            served = served_on_any(model.vllm_release, model.architecture, modules)
            if served is not None:
                target = f"{served.parameter}.{_target_kind(name, target)}"
        how = naming(name)
        mapping[(cfg.template(name), cfg.template(target) if target else None)] += 1
        match = TARGET.match(target) if target else None
        kind = match["kind"] if match else None
        is_zero_point = match is not None and match["what"] == "zero_point"
        st = ScaleTensor(
            name=name,
            file=info.file.name,
            dtype=info.dtype,
            shape=info.shape,
            value=None,
            naming=how,
            kind=None,
            target=target,
            layer=None,
            engine_layer=served.layer if served is not None else None,
        )
        tensors.append(st)
        if is_zero_point:
            st.kind = f"{kind}_zero_point"
            st.value, nonzero = zero_point_value(ckpt, info)
            if nonzero:
                st.problems.append(
                    TensorProblem(
                        "nonzero_zero_point", "non-zero zero point: ignored (symmetric cache)"
                    )
                )
        else:
            st.kind = "kv" if how == "kv_scale" else kind
            expected = None
            if heads is not None:
                # k/v (and legacy kv): one per KV head; q: one per attention head. Head
                # count unknown: the tensor's own first dimension (the shape is not checked).
                expected = model.q_heads if kind == "q" else model.kv_heads
                if expected is None:
                    expected = info.shape[0] if info.shape else None
            st.value, st.values, st.problems = decode(ckpt, info, expected)
            if expected is not None and not any(p.code == "malformed_shape" for p in st.problems):
                st.heads = expected
        if match is None:
            why = (
                "no name-mapping rule (built-in or installed) maps it to a host parameter"
                if target is None
                else f"maps to '{target}', which is not an attention scale parameter"
            )
            st.problems.append(TensorProblem("unmapped", why))
            continue
        module = match["module"]
        layer = module[: -len(".attn")] if module.endswith(".attn") else module
        st.layer = layer
        if is_zero_point:
            continue
        row = rows.get(layer)
        if row is None:
            idx, is_mtp, known = cfg.layer_of(module, model.n, model.mtp, model.attn_layers)
            row = rows[layer] = LayerRow(layer=layer, index=idx, mtp=is_mtp, known=known)
        slot = kind if kind in ("k", "v", "q") else "q"
        if getattr(row, slot) is None:
            setattr(row, slot, st)
        else:
            row.extra.append(st)
            st.kind = slot

    # Layers the model does not have.
    for row in rows.values():
        if not row.known:
            why = (
                f"layer index {row.index} >= num_hidden_layers {model.n} and the config "
                "declares no MTP layer there"
                if model.n is not None and row.index is not None and row.index >= model.n
                else f"layer {row.index} is not an attention layer (config layer_types)"
            )
            for t in (row.k, row.v, row.q, *row.extra):
                if t is not None:
                    t.problems.append(TensorProblem("unmapped", why))

    # Head count unknown: each tensor's length was taken as it is, so k and v may disagree.
    if heads is not None and heads.kv is None:
        for row in rows.values():
            k, v = row.k, row.v
            if k is not None and v is not None and k.heads and v.heads and k.heads != v.heads:
                v.problems.append(
                    TensorProblem(
                        "malformed_shape",
                        f"{v.heads} value(s) but {k.name} has {k.heads} (one per KV head each)",
                    )
                )
                v.heads = None
    return tensors, rows, mapping


def _target_kind(name: str, mapped: str | None) -> str:
    """The scale parameter a scale tensor feeds (``k_scale``, ``v_zero_point``, ...)."""
    if mapped is not None:
        return mapped.rsplit(".", 1)[1]
    last = name.rsplit(".", 1)[-1]
    if last == "kv_scale":
        return "k_scale"  # legacy: loaded as k, duplicated to v
    if last.startswith("output_"):  # <k|v>_proj.output_scale
        return f"{name.rsplit('.', 2)[-2][0]}_{last[len('output_') :]}"
    return last


def _declares_attn_head(verdict: SchemeVerdict, scheme: Any) -> bool:
    """The scheme asks for one scale per KV head (``strategy: attn_head``), supported or not."""
    if verdict.per_head:
        return True
    strategy = getattr(verdict.args, "strategy", None) if verdict.args is not None else None
    if strategy is None and isinstance(scheme, Mapping):
        strategy = scheme.get("strategy")
    return str(getattr(strategy, "value", strategy)) == "attn_head"


def _row_template(rows: Iterable[LayerRow]) -> str:
    for row in rows:
        if not row.mtp and row.index is not None and row.known:
            return cfg.template(row.layer)
    return "model.layers.{i}.self_attn"


def _judge_rows(layers: list[LayerRow], verdict: SchemeVerdict, heads: Heads | None) -> None:
    """Each row's problem codes and kvscale's view (the adapters' path)."""
    for row in layers:
        slots = [t for t in (row.k, row.v, row.q, *row.extra) if t is not None]
        row.problems = sorted({p.code for t in slots for p in t.problems})
        if verdict.supported and row.known and not row.mtp:
            if row.k is None and row.v is None:
                row.problems.append("missing_scales")
            elif (row.k is None or row.v is None) and not (
                row.k is not None and row.k.naming == "kv_scale"
            ):
                row.problems.append("only_one_of_kv")
        if _conflicts(row):
            row.problems.append("conflicting_scales")

        # kvscale: the adapters' path (scales.resolve_kv_scales on what was loaded).
        if not verdict.declared:
            row.kvscale = LayerView(None, None, "none", "no scheme: no scale parameters")
        elif not verdict.supported:
            row.kvscale = LayerView(
                1.0,
                1.0,
                ScaleSource.UNSCALED.value,
                "unsupported scheme: checkpoint scales ignored",
            )
        elif not row.known:
            row.kvscale = LayerView(None, None, "none", "no such attention layer in the model")
        elif any(t.bad_value for t in slots):
            row.kvscale = LayerView(
                None, None, "error", "start-up stops with CorruptScaleError naming this tensor"
            )
        else:
            resolved = resolve_kv_scales(_loaded(row.k, heads), _loaded(row.v, heads))
            note = {
                ScaleSource.DUPLICATED: "one scale used for k and v",
                ScaleSource.DEFAULT: "no scales: 1.0, one warning",
            }.get(resolved.source, "")
            if "conflicting_scales" in row.problems:
                note = "; ".join(filter(None, [note, "value depends on load order"]))
            show_heads = heads is not None and resolved.source is not ScaleSource.DEFAULT
            row.kvscale = LayerView(
                resolved.k,
                resolved.v,
                resolved.source.value,
                note,
                resolved.k_heads if show_heads else None,
                resolved.v_heads if show_heads else None,
            )


def _judge_sharing(
    layers: list[LayerRow], shares: Mapping[int, int], verdict: SchemeVerdict
) -> None:
    """Layers that read another layer's cache (``sharing.kv_sharing_targets``): never
    "missing"; kvscale serves the target's scales; stock reads with its own (1.0)."""
    rows = {r.index: r for r in layers if not r.mtp and r.known and r.index is not None}
    for index, target_index in shares.items():
        row, target = rows.get(index), rows.get(target_index)
        if row is None or target is None or not verdict.supported:
            continue
        row.problems = [p for p in row.problems if p != "missing_scales"] + ["reads_shared_kv"]
        own = "; its own scales are not used (one warning)" if row.k or row.v else ""
        theirs = target.kvscale
        row.kvscale = LayerView(
            theirs.k,
            theirs.v,
            "shared",
            f"reads {target.layer}'s cache: its scales{own}",
            theirs.k_heads,
            theirs.v_heads,
        )
        if (row.stock.k, row.stock.v) != (target.stock.k, target.stock.v):
            note = f"reads {target.layer}'s cache: wrong scale"
            row.stock = replace(row.stock, note="; ".join(filter(None, [row.stock.note, note])))


def _loaded(t: ScaleTensor | None, heads: Heads | None) -> float | tuple[float, ...] | None:
    """What kvscale's loader hands ``resolve_kv_scales``: None (not loaded), a scalar, or
    the per-head values."""
    if t is None:
        return None
    if heads is not None and t.values is not None:
        return t.values
    return t.value


def _conflicts(row: LayerRow) -> bool:
    for extra in row.extra:
        first = getattr(row, extra.kind or "q")
        if first is not None and first.differs_from(extra):
            return True
    return False


def _kvscale_summary(
    verdict: SchemeVerdict,
    layers: list[LayerRow],
    tensors: list[ScaleTensor],
    qc: Mapping[str, Any] | None,
    heads: Heads | None,
    host: str,
    *,
    q_read: bool = True,
) -> tuple[str, str]:
    if qc is None:
        return "none", (
            "no quantization_config: --quantization kvscale stops with a clear error "
            "(it needs a compressed-tensors checkpoint); serve without it"
        )
    if not verdict.declared:
        return "none", "no kv_cache_scheme: nothing changes (no scale parameters)"
    if not verdict.supported:
        return "unscaled", f"starts with an unscaled cache and one warning: {verdict.reason}"
    # Only tensors that reach a layer's loader can stop the start-up.
    served = {r.layer for r in layers if r.known}
    bad = [t for t in tensors if t.bad_value and t.layer in served]
    # A q scale no attention reads is warned about, not refused (kvscale's loaders).
    unread_q = [t for t in bad if t.kind == "q"] if not q_read else []
    if len(bad) > len(unread_q):
        count = len(bad) - len(unread_q)
        return "refuses", f"refuses to start: CorruptScaleError naming {count} tensor(s)"
    ignored = (
        f"; {len(unread_q)} corrupt q_scale tensor(s) ignored with one warning (no attention "
        "here reads q scales)"
        if unread_q
        else ""
    )
    sources = Counter(r.kvscale.outcome for r in layers if r.known)
    parts = ", ".join(f"{c} layer(s) {s}" for s, c in sorted(sources.items()))
    cache = "FP8 e4m3 cache"
    if heads is not None:
        count = f" ({heads.kv})" if heads.kv is not None else ""
        if host == "vllm":
            cache += (
                f", scales per KV head{count}; one-scale paths (CPU attention, Triton "
                "cache write) use the per-layer max"
            )
        else:
            cache += f", scales per KV head{count}: per head or per-layer max on SGLang unverified"
    return "starts", (f"starts: {cache}; {parts}" if parts else f"starts: {cache}") + ignored
