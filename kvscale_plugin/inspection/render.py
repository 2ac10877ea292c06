"""Text output of ``kvscale inspect``: summary, problems (errors first), a table a layer per row.

A per-head scale shows as ``min–max (H heads)``.
"""

from __future__ import annotations

import math

from kvscale_plugin.inspection.records import ERROR, InspectReport, LayerView, ScaleTensor, tmax
from kvscale_plugin.inspection.tensors import FLOAT_DTYPES

_MAX_DETAILS = 8


def render_text(report: InspectReport) -> str:
    """Human output: summary, problems (errors first), then a table with a layer per row."""
    v = report.verdict
    out: list[str] = []
    n_scales = sum(1 for t in report.tensors if t.kind)
    files = f"{len(report.files)} file{'s' if len(report.files) != 1 else ''}"
    layers = report.num_hidden_layers if report.num_hidden_layers is not None else "?"
    kv_heads = report.num_kv_heads if report.num_kv_heads is not None else "?"
    heads = f"{kv_heads} KV heads, " if report.per_head else ""
    out.append(
        f"kvscale inspect {report.model_dir}\n"
        f"  host {report.host}, model_type {report.model_type or '?'}, {layers} layers, "
        f"{heads}{files}{' (sharded)' if report.sharded else ''}, {report.num_tensors} tensors, "
        f"{n_scales} scale tensors; read {report.bytes_read:,} of {report.total_bytes:,} bytes"
    )
    if report.host_note:
        out.append(f"  release  {report.host_note}")
    out.append(f"  scheme   {v.describe()}")
    if report.weights is not None and report.weights.declared:
        out.append(f"  weights  {report.weights.summary}")
    out.append(f"  stock    {report.stock_engine}: {report.stock_summary}")
    out.append(f"  kvscale  {report.kvscale_summary}")
    if report.mapping:
        out.append("  names")
        for m in report.mapping:
            out.append(f"    {m['pattern']} -> {m['target'] or 'UNMAPPED'} ({m['count']})")

    errors = sum(p.severity == ERROR for p in report.problems)
    warnings = len(report.problems) - errors
    out.append("")
    if report.problems:
        out.append(f"PROBLEMS: {errors} error(s), {warnings} warning(s)")
        for p in report.problems:
            out.append(f"  {p.severity.upper():<7} {p.code}: {p.message}")
            shown = list(p.details.items())[:_MAX_DETAILS]
            for name, why in shown:
                out.append(f"            {name}: {why}")
            if len(p.details) > len(shown):
                out.append(f"            ... and {len(p.details) - len(shown)} more")
            if not p.details and p.layers:
                head = ", ".join(p.layers[:_MAX_DETAILS])
                more = len(p.layers) - min(len(p.layers), _MAX_DETAILS)
                out.append(f"            layers: {head}{f', ... and {more} more' if more else ''}")
    else:
        out.append("PROBLEMS: none")

    if report.layers:
        out.append("")
        out.append(_table(report))
    else:
        out.append("")
        out.append("no KV scale tensors and no attention layer to report")
    out.append("")
    out.append(f"exit status {report.exit_status}")
    return "\n".join(out) + "\n"


def _span(values: tuple[float, ...]) -> str:
    """``min–max`` of per-head values (NaN shows as the max, as ``torch.max`` gives it)."""
    finite = [x for x in values if not math.isnan(x)]
    low = min(finite) if finite else math.nan
    high = tmax(values)
    return _fmt(low) if low == high else f"{_fmt(low)}–{_fmt(high)}"


def _cell(t: ScaleTensor | None) -> str:
    if t is None:
        return "-"
    if t.heads is not None and t.values is not None and t.value is None:
        text = f"{_span(t.values)} ({t.heads} heads)"
    elif t.value is not None:
        text = _fmt(t.value)
    else:
        text = f"shape{list(t.shape)}"
    if t.dtype not in FLOAT_DTYPES:
        text += f" {t.dtype}"
    return f"{text} [{t.naming}]"


def _view(view: LayerView) -> str:
    if view.k is None:
        values = ""
    elif view.k_heads is not None and view.v_heads is not None:
        values = f"k={_span(view.k_heads)} v={_span(view.v_heads)} "
    else:
        values = f"k={_fmt(view.k)} v={_fmt(view.v)} "
    note = f" ({view.note})" if view.note else ""
    return f"{values}{view.outcome}{note}"


def _table(report: InspectReport) -> str:
    header = [
        "",
        "layer",
        "k_scale",
        "v_scale",
        f"stock {report.stock_engine}",
        "kvscale",
        "problems",
    ]
    rows = [
        [
            "!" if r.problems else "",
            r.layer + (" (mtp)" if r.mtp else ""),
            _cell(r.k),
            _cell(r.v),
            _view(r.stock),
            _view(r.kvscale),
            ",".join(r.problems) or "-",
        ]
        for r in report.layers
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    lines = []
    for row in [header, *rows]:
        cells = [row[i].ljust(widths[i]) for i in range(len(widths))] + [row[-1]]
        lines.append(" ".join(cells).rstrip())
    return "\n".join(lines)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"
