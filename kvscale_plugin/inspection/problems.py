"""The catalogue of problems ``kvscale inspect`` reports, and their collection.

An ``error`` changes what is served (exit status 1); a ``warning`` does not.
``CATALOGUE`` is the list of codes; the JSON schema (``schema.py``) documents it.
"""

from __future__ import annotations

import json
from typing import Literal

from kvscale_plugin.inspection.records import (
    ERROR,
    WARNING,
    Heads,
    LayerRow,
    Problem,
    ScaleTensor,
    Severity,
    plain,
)
from kvscale_plugin.scheme import SchemeVerdict

ProblemCode = Literal[
    "corrupt_value",
    "malformed_shape",
    "malformed_dtype",
    "unmapped",
    "missing_scales",
    "only_one_of_kv",
    "conflicting_scales",
    "unsupported_scheme_with_scales",
    "unsupported_scheme",
    "scales_without_scheme",
    "legacy_kv_scale",
    "duplicate_scales",
    "nonzero_zero_point",
    "assumed_defaults",
    "unknown_head_count",
    "unknown_layer_count",
    "unsupported_weight_scheme",
    "reads_shared_kv",
]

#: code -> (severity, what it means). Tensor-level codes (in ``tensors[].problems``):
#: corrupt_value, malformed_shape, malformed_dtype, unmapped, nonzero_zero_point; layer
#: rows carry their tensors' codes plus missing_scales, only_one_of_kv, conflicting_scales.
CATALOGUE: dict[str, tuple[Severity, str]] = {
    "corrupt_value": (
        ERROR,
        "a scale (per head: any element) is 0, negative, NaN or inf; the detail names the "
        "head (k_scale[head 1])",
    ),
    "malformed_shape": (
        ERROR,
        "a scale's shape is not what the scheme asks for: a scalar for strategy 'tensor'; "
        "[H, 1, 1] or [H] for 'attn_head', H = the model's KV heads (attention heads for q); "
        "a scalar under 'attn_head' is one too, as in kvscale's loaders",
    ),
    "malformed_dtype": (ERROR, "a scale is not a float dtype (F32, BF16, F16, F64)"),
    "unmapped": (
        ERROR,
        "a scale-like tensor that no name-mapping rule maps, or that maps to a layer the "
        "model does not have",
    ),
    "missing_scales": (
        ERROR,
        "a supported scheme, but an attention layer has no k/v scale tensors",
    ),
    "reads_shared_kv": (
        WARNING,
        "a layer reads another layer's KV cache (num_kv_shared_layers: Gemma-3n, Gemma-4): "
        "it must serve that layer's k/v scales; stock vLLM serves 1.0 (or the scales "
        "shipped under its own name)",
    ),
    "only_one_of_kv": (
        ERROR,
        "a layer has only one of k_scale / v_scale (and is not a legacy kv_scale)",
    ),
    "conflicting_scales": (
        ERROR,
        "two tensors map to one scale parameter with different values",
    ),
    "unsupported_scheme_with_scales": (
        ERROR,
        "the kv_cache_scheme is not supported and the checkpoint has scale tensors",
    ),
    "unsupported_scheme": (
        WARNING,
        "the kv_cache_scheme is not supported (no scale tensors): an unscaled cache",
    ),
    "scales_without_scheme": (
        WARNING,
        "scale tensors but no kv_cache_scheme in config.json: they are not used",
    ),
    "legacy_kv_scale": (
        WARNING,
        "the deprecated single kv_scale (kvscale uses it for k and v; stock vLLM keeps v at 1)",
    ),
    "duplicate_scales": (
        WARNING,
        "a tensor repeats another tensor's scale parameter with the same value",
    ),
    "nonzero_zero_point": (
        WARNING,
        "a non-zero zero point: ignored, the FP8 cache is symmetric",
    ),
    "assumed_defaults": (
        WARNING,
        "the kv_cache_scheme omits fields; compressed-tensors defaults are assumed",
    ),
    "unknown_head_count": (
        WARNING,
        "an attn_head scheme but config.json has no head count: per-head lengths unchecked",
    ),
    "unsupported_weight_scheme": (
        ERROR,
        "the quantization_config's weight / activation schemes (config_groups) stop the "
        "installed host's start-up on its platform (measured: static FP8 input activations "
        "on vLLM's CPU build), with or without kvscale",
    ),
    "unknown_layer_count": (
        WARNING,
        "config.json has no num_hidden_layers: missing layers and unknown indices unchecked",
    ),
}


def collect_problems(
    tensors: list[ScaleTensor],
    layers: list[LayerRow],
    verdict: SchemeVerdict,
    n: int | None,
    attn_layers: list[int] | None,
    heads: Heads | None,
) -> list[Problem]:
    """The report's problem list, errors first (each code once, naming its tensors)."""
    problems: list[Problem] = []

    def add(
        code: str,
        message: str,
        tensors: list[str] | None = None,
        layers: list[str] | None = None,
        details: dict[str, str] | None = None,
    ) -> None:
        severity = CATALOGUE[code][0]
        problems.append(
            Problem(severity, code, message, tensors or [], layers or [], details or {})
        )

    def per_tensor(code: str, headline: str) -> None:
        hit = [t for t in tensors if any(p.code == code for p in t.problems)]
        if hit:
            # Keys as the core's errors name them: "<tensor>" or "<tensor>[head i]".
            details = {
                t.name + (f"[head {p.head}]" if p.head is not None else ""): p.detail
                for t in hit
                for p in t.problems
                if p.code == code
            }
            add(
                code,
                headline.format(n=len(hit)),
                tensors=sorted(t.name for t in hit),
                layers=sorted({t.layer for t in hit if t.layer}),
                details=details,
            )

    per_tensor(
        "corrupt_value",
        "{n} scale tensor(s) hold a value that cannot be served (0, negative, NaN, inf); "
        "with a supported scheme kvscale stops at start-up naming them, stock engines "
        "serve a broken cache. "
        "Re-calibrate the checkpoint (llm-compressor) or fix these tensors.",
    )
    per_tensor(
        "malformed_shape",
        "{n} scale tensor(s) do not have the shape the kv_cache_scheme asks for (one "
        "scalar for strategy 'tensor'; [H, 1, 1] or [H] for 'attn_head', H = the "
        "model's KV heads, attention heads for q); with a supported scheme kvscale "
        "stops at start-up naming them. Re-export the scales to match the scheme.",
    )
    per_tensor(
        "malformed_dtype",
        "{n} scale tensor(s) are not float (F32/BF16/F16); hosts cast them silently. "
        "Re-export the scales as float32.",
    )
    per_tensor(
        "unmapped",
        "{n} scale-like tensor(s) map to no attention layer of the model and would be "
        "dropped (or rejected) by the loader. Rename them, or install a name-mapping "
        "rule package (entry-point group 'kvscale_plugin').",
    )

    def per_layer(code: str, message: str) -> None:
        hit = [r for r in layers if code in r.problems]
        if hit:
            names = [t.name for r in hit for t in (r.k, r.v, r.q, *r.extra) if t is not None]
            add(
                code,
                message.format(n=len(hit), total=len(attn_layers or [])),
                tensors=sorted(names),
                layers=[r.layer for r in hit],
            )

    per_layer(
        "missing_scales",
        "the checkpoint declares a supported kv_cache_scheme but {n} of {total} attention "
        "layer(s) have no k/v scale tensors: they use 1.0 (kvscale warns once; stock "
        "engines say nothing), which clips K/V beyond +-448. Calibrate the KV cache with "
        "llm-compressor, or serve with --kv-cache-dtype bfloat16.",
    )
    per_layer(
        "reads_shared_kv",
        "{n} attention layer(s) read another layer's KV cache (num_kv_shared_layers): that "
        "cache was written with the other layer's k/v scales. Stock vLLM 0.32 reads it with "
        "1.0 (or whatever the checkpoint ships under the reading layer's name), which is "
        "quietly wrong with an FP8 cache; kvscale serves the target's scales. Calibration "
        "writes no scales for these layers: they are not missing.",
    )
    per_layer(
        "only_one_of_kv",
        "{n} layer(s) have only one of k_scale / v_scale (and no legacy kv_scale): "
        "kvscale uses it for both, stock vLLM keeps 1.0 for the other. Export both.",
    )
    per_layer(
        "conflicting_scales",
        "{n} layer(s) have several tensors with different values for one scale "
        "parameter; which one wins depends on load order. Keep one naming.",
    )

    scale_tensors = [t for t in tensors if t.kind in ("k", "v", "kv", "q")]
    if verdict.declared and not verdict.supported and scale_tensors:
        add(
            "unsupported_scheme_with_scales",
            f"kv_cache_scheme is not supported ({verdict.reason}) but the checkpoint has "
            f"{len(scale_tensors)} scale tensor(s): kvscale serves an unscaled cache and "
            "ignores them (stock vLLM refuses to start or applies them). Re-export with a "
            "static symmetric per-tensor FP8 scheme.",
            tensors=sorted(t.name for t in scale_tensors),
        )
    if verdict.declared and not verdict.supported and not scale_tensors:
        add(
            "unsupported_scheme",
            f"kv_cache_scheme is not supported ({verdict.reason}): kvscale serves an "
            "unscaled cache with one warning; stock vLLM 0.32 may refuse to start.",
        )
    if not verdict.declared and scale_tensors:
        add(
            "scales_without_scheme",
            f"{len(scale_tensors)} scale tensor(s) but no kv_cache_scheme in config.json: "
            "they are not used. Declare the scheme if they were calibrated for an FP8 cache.",
            tensors=sorted(t.name for t in scale_tensors),
        )
    legacy = sorted(t.name for t in tensors if t.naming == "kv_scale")
    if legacy:
        add(
            "legacy_kv_scale",
            f"{len(legacy)} tensor(s) use the deprecated single 'kv_scale': kvscale uses it for "
            "k and v; stock vLLM 0.32 keeps v_scale at 1.0. Re-export with separate "
            "k_scale/v_scale.",
            tensors=legacy,
        )
    same = [
        e.name
        for r in layers
        for e in r.extra
        if (first := getattr(r, e.kind or "q")) is not None and not first.differs_from(e)
    ]
    if same:
        add(
            "duplicate_scales",
            f"{len(same)} tensor(s) repeat another tensor's scale parameter with the same value.",
            tensors=sorted(same),
        )
    per_tensor(
        "nonzero_zero_point",
        "{n} zero-point tensor(s) are non-zero; the FP8 cache is symmetric, so they are ignored.",
    )
    if verdict.assumed:
        fields = ", ".join(f"{k}={json.dumps(plain(v))}" for k, v in verdict.assumed.items())
        add(
            "assumed_defaults",
            f"kv_cache_scheme omits {', '.join(verdict.assumed)}; compressed-tensors defaults "
            f"assumed ({fields}). Stock vLLM 0.32 reads the raw dict and refuses a missing "
            "strategy or symmetric.",
        )
    if heads is not None and heads.kv is None:
        add(
            "unknown_head_count",
            "the kv_cache_scheme is per head (attn_head) but config.json has no "
            "num_key_value_heads / num_attention_heads: per-head scale lengths cannot be "
            "checked (each tensor's own first dimension is taken as its head count).",
        )
    if verdict.declared and n is None:
        add(
            "unknown_layer_count",
            "config.json has no num_hidden_layers (nor text_config.num_hidden_layers): "
            "missing layers and unknown layer indices cannot be checked.",
        )
    problems.sort(key=lambda p: p.severity != ERROR)
    return problems
