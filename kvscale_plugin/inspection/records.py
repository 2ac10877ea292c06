"""The in-memory report of ``kvscale inspect``: tensors, layer rows, views, problems.

Plain dataclasses filled by ``report.py``, read by ``stock.py``, ``problems.py``,
``render.py`` and ``schema.py`` (which turns them into the JSON output). The
``Literal`` aliases name every value a field can take; ``schema.py`` documents them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvscale_plugin.scheme import SchemeVerdict

Severity = Literal["error", "warning"]
ERROR: Severity = "error"
WARNING: Severity = "warning"

#: How a checkpoint names a scale tensor (``tensors.naming``).
Naming = Literal[
    "self_attn", "k_proj", "qkv_proj", "output_scale", "kv_scale", "host", "zero_point", "other"
]
#: Which host parameter a scale-like tensor feeds.
Kind = Literal["k", "v", "q", "kv", "k_zero_point", "v_zero_point", "q_zero_point"]
#: What an engine (``stock`` / ``kvscale`` summary) or a layer (stock view) ends up doing.
Outcome = Literal[
    "none", "starts", "refuses", "fails", "loads", "default", "broken", "unscaled", "unverified"
]
#: Where kvscale's scales for a layer come from (``scales.ScaleSource``, plus error / none).
Source = Literal["checkpoint", "duplicated", "default", "unscaled", "shared", "error", "none"]


class TensorProblem(NamedTuple):
    """One problem of one tensor; ``head`` names the bad element of a per-head scale."""

    code: str  # a code of problems.CATALOGUE
    detail: str
    head: int | None = None


@dataclass
class ScaleTensor:
    """One scale-like checkpoint tensor and what the host makes of it."""

    name: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    value: float | None
    naming: str  # Naming
    kind: str | None  # Kind
    target: str | None
    layer: str | None
    #: The attention layer a vLLM engine serves it on, as the engine names it, where the
    #: model's translation on that release is measured (``vllm_layers``); else None.
    engine_layer: str | None = None
    problems: list[TensorProblem] = field(default_factory=list)
    #: Every element, when the tensor is small enough to decode (None otherwise).
    values: tuple[float, ...] | None = None
    #: Heads it holds when it has the per-head layout ``[H, 1, 1]`` / ``[H]`` that
    #: an ``attn_head`` scheme expects for this model (None: not a per-head scale).
    heads: int | None = None

    @property
    def bad_value(self) -> bool:
        """Whether kvscale's loader rejects it (core ``scale_problems``)."""
        return any(
            p.code in ("corrupt_value", "malformed_shape", "malformed_dtype") for p in self.problems
        )

    def differs_from(self, other: ScaleTensor) -> bool:
        """Whether the two hold different values (NaN equals NaN here)."""
        if self.values is None or other.values is None:
            return _differs(self.value, other.value)
        return len(self.values) != len(other.values) or any(
            _differs(x, y) for x, y in zip(self.values, other.values, strict=True)
        )


def _differs(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is not b
    return not (a == b or (math.isnan(a) and math.isnan(b)))


@dataclass
class LayerView:
    """Stock or kvscale result for one layer.

    ``k`` / ``v`` are the per-layer numbers (for per-head scales the max over heads:
    what vLLM's ``_k_scale_float`` and one-scale paths use); ``k_heads`` /
    ``v_heads`` hold the per-head values served, when the layer is per head.
    """

    k: float | None
    v: float | None
    outcome: str  # Outcome (stock) or Source (kvscale)
    note: str = ""
    k_heads: tuple[float, ...] | None = None
    v_heads: tuple[float, ...] | None = None


@dataclass
class LayerRow:
    """One attention layer: its scale tensors, both views and its problem codes."""

    layer: str
    index: int | None
    mtp: bool
    k: ScaleTensor | None = None
    v: ScaleTensor | None = None
    q: ScaleTensor | None = None
    # Extra tensors that map to the same parameter as k / v / q (conflicts).
    extra: list[ScaleTensor] = field(default_factory=list)
    known: bool = True  # False: the model has no attention layer with this index
    stock: LayerView = field(default_factory=lambda: LayerView(None, None, "none"))
    kvscale: LayerView = field(default_factory=lambda: LayerView(None, None, "none"))
    problems: list[str] = field(default_factory=list)


@dataclass
class Problem:
    """One entry of the report's problem list (see ``problems.CATALOGUE``)."""

    severity: Severity
    code: str
    message: str
    tensors: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    # tensor -> why, shown under the message in the text output.
    details: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Heads:
    """What a per-head (``attn_head``) layer is checked against."""

    kv: int | None  # KV heads (k/v scales)
    q: int | None  # attention heads (q scales)
    #: quantization_config has ``config_groups``: only then does vLLM 0.32 pass the head
    #: counts to the attn_head scale loader (``weight_utils``' get_quant_config).
    config_groups: bool


@dataclass
class InspectReport:
    """Everything ``kvscale inspect`` found; ``schema.py`` describes its JSON form."""

    model_dir: str
    host: str
    model_type: str | None
    num_hidden_layers: int | None
    attention_layers: list[int] | None
    mtp_layers: int
    num_kv_heads: int | None
    num_attention_heads: int | None
    #: The declared kv_cache_scheme has ``strategy: attn_head`` (one scale per KV head).
    per_head: bool
    sharded: bool
    files: list[dict[str, Any]]
    num_tensors: int
    total_bytes: int
    bytes_read: int
    verdict: SchemeVerdict
    declared_scheme: Any
    quant_method: str | None
    stock_engine: str
    stock_outcome: str
    stock_summary: str
    stock_basis: str
    kvscale_outcome: str
    kvscale_summary: str
    mapping: list[dict[str, Any]]
    problems: list[Problem]
    layers: list[LayerRow]
    tensors: list[ScaleTensor]
    #: The host release reported against (installed, or named with ``--host vllm==X``).
    host_version: str | None = None
    host_note: str = ""
    #: The weight / activation schemes (``config_groups``) and their verdict
    #: (``weights.WeightVerdict``; None: not judged yet).
    weights: Any = None
    #: The KV-cache part of the stock / kvscale verdicts. ``stock_outcome`` /
    #: ``kvscale_outcome`` are the engine's, which a weight verdict can change
    #: (``weights.combine``); without weight schemes they are the same.
    stock_kv_outcome: str = ""
    stock_kv_summary: str = ""
    kvscale_kv_outcome: str = ""
    kvscale_kv_summary: str = ""

    @property
    def exit_status(self) -> int:
        return 1 if any(p.severity == ERROR for p in self.problems) else 0


def tmax(values: tuple[float, ...]) -> float:
    """``torch.max`` semantics: NaN if any element is NaN."""
    return math.nan if any(math.isnan(x) for x in values) else max(values)


def plain(value: Any) -> Any:
    """An enum's value, or the value itself when it is a JSON scalar, else its ``str``."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)
