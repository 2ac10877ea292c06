"""The report of ``kvscale inspect`` as its ``--json`` output: the plain records
(``records.InspectReport``) turned into the validated pydantic models of ``schema``
(``output_model``), and the JSON objects ``kvscale inspect --json`` prints
(``report_to_json``, ``error_to_json`` for unusable input)."""

from __future__ import annotations

import math
from typing import Any

from kvscale_plugin import __version__
from kvscale_plugin.inspection.records import InspectReport, LayerView, ScaleTensor, plain
from kvscale_plugin.inspection.schema import (
    SCHEMA_VERSION,
    ErrorInfo,
    HubFetch,
    InspectError,
    InspectOutput,
)
from kvscale_plugin.inspection.weights import WeightVerdict


def _jv(value: float | None) -> float | str | None:
    """JSON-safe value: JSON has no NaN / inf literals."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _jvs(values: tuple[float, ...] | None) -> list[float | str | None] | None:
    return None if values is None else [_jv(x) for x in values]


def _scale(t: ScaleTensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {
        "tensor": t.name,
        "value": _jv(t.value),
        "dtype": t.dtype,
        "shape": list(t.shape),
        "naming": t.naming,
        "heads": t.heads,
        "values": _jvs(t.values),
    }


def _view(view: LayerView, outcome_key: str) -> dict[str, Any]:
    return {
        "k": _jv(view.k),
        "v": _jv(view.v),
        outcome_key: view.outcome,
        "note": view.note,
        "k_heads": _jvs(view.k_heads),
        "v_heads": _jvs(view.v_heads),
    }


def _weights(w: WeightVerdict | None) -> dict[str, Any]:
    if w is None:
        return {"declared": False, "outcome": "none", "summary": "", "platform": None, "groups": []}
    return {
        "declared": w.declared,
        "outcome": w.outcome,
        "summary": w.summary,
        "platform": w.platform,
        "groups": [
            {
                "name": g.name,
                "targets": g.targets,
                "weights": g.weights,
                "input_activations": g.input_activations,
                "output_activations": g.output_activations,
            }
            for g in w.groups
        ],
    }


def output_model(report: InspectReport) -> InspectOutput:
    """The report as the (validated) ``schema_version`` 1 model."""
    v = report.verdict
    return InspectOutput.model_validate(
        {
            "schema_version": SCHEMA_VERSION,
            "tool": "kvscale inspect",
            "kvscale_version": __version__,
            "model_dir": report.model_dir,
            "host": report.host,
            "host_version": report.host_version,
            "host_note": report.host_note,
            "model_type": report.model_type,
            "num_hidden_layers": report.num_hidden_layers,
            "attention_layers": report.attention_layers,
            "mtp_layers": report.mtp_layers,
            "num_kv_heads": report.num_kv_heads,
            "num_attention_heads": report.num_attention_heads,
            "checkpoint": {
                "sharded": report.sharded,
                "num_tensors": report.num_tensors,
                "files": report.files,
                "total_bytes": report.total_bytes,
                "bytes_read": report.bytes_read,
            },
            "scheme": {
                "declared": v.declared,
                "supported": v.supported,
                "reason": v.reason,
                "assumed": {k: plain(x) for k, x in v.assumed.items()},
                "description": v.describe(),
                "kv_cache_scheme": report.declared_scheme,
                "quant_method": report.quant_method,
                "per_head": report.per_head,
            },
            "stock": {
                "engine": report.stock_engine,
                "outcome": report.stock_outcome,
                "summary": report.stock_summary,
                "basis": report.stock_basis,
                "kv_cache_outcome": report.stock_kv_outcome or report.stock_outcome,
                "kv_cache_summary": report.stock_kv_summary or report.stock_summary,
            },
            "kvscale": {
                "outcome": report.kvscale_outcome,
                "summary": report.kvscale_summary,
                "kv_cache_outcome": report.kvscale_kv_outcome or report.kvscale_outcome,
                "kv_cache_summary": report.kvscale_kv_summary or report.kvscale_summary,
            },
            "weights": _weights(report.weights),
            "mapping": report.mapping,
            "problems": [
                {
                    "severity": p.severity,
                    "code": p.code,
                    "message": p.message,
                    "tensors": p.tensors,
                    "layers": p.layers,
                }
                for p in report.problems
            ],
            "layers": [
                {
                    "layer": r.layer,
                    "index": r.index,
                    "mtp": r.mtp,
                    "k": _scale(r.k),
                    "v": _scale(r.v),
                    "q": _scale(r.q),
                    "stock": _view(r.stock, "outcome"),
                    "kvscale": _view(r.kvscale, "source"),
                    "problems": r.problems,
                }
                for r in report.layers
            ],
            "tensors": [
                {
                    "name": t.name,
                    "file": t.file,
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "value": _jv(t.value),
                    "values": _jvs(t.values),
                    "heads": t.heads,
                    "kind": t.kind,
                    "naming": t.naming,
                    "target": t.target,
                    "layer": t.layer,
                    "engine_layer": t.engine_layer,
                    "problems": [
                        {"code": p.code, "detail": p.detail, "head": p.head} for p in t.problems
                    ],
                }
                for t in report.tensors
            ],
            "exit_status": report.exit_status,
        }
    )


def report_to_json(report: InspectReport, hub: dict[str, Any] | None = None) -> dict[str, Any]:
    """The report as the documented ``schema_version`` 1 JSON object (``hub``: a Hub
    checkpoint's ``HubFetch``; the key is absent for a local one)."""
    out = output_model(report)
    if hub is None:
        return out.model_dump(mode="json", exclude={"hub"})
    return out.model_copy(update={"hub": HubFetch.model_validate(hub)}).model_dump(mode="json")


def error_to_json(model_dir: str, host: str, exc: Exception) -> dict[str, Any]:
    """The ``--json`` output on unusable input (exit status 2)."""
    error = ErrorInfo(type=type(exc).__name__, message=str(exc))
    out = InspectError(
        schema_version=SCHEMA_VERSION, model_dir=model_dir, host=host, error=error, exit_status=2
    )
    return out.model_dump(mode="json")
