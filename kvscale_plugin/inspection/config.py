"""Reading a model's ``config.json``: layers, attention layers, MTP layers, heads, quantization.

Multimodal configs keep the language model's fields under ``text_config``; hybrid
models (Qwen3-Next/3.5, ...) list ``layer_types``, and only attention layers hold a
KV cache; DeepSeek-style MTP layers follow the last layer (``model.layers.{n}..``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

#: A layer index in a module path (``model.layers.3``, ``model.mtp_layers.0``, ``h.3``).
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|mtp_layers|h|blocks)\.(?P<idx>\d+)(?=\.|$)")
MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers")


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config: ``text_config`` when it has the layer count, else all."""
    tc = config.get("text_config")
    return tc if isinstance(tc, Mapping) and "num_hidden_layers" in tc else config


def quant_config(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """``quantization_config`` (or ``compression_config``), top level or in ``text_config``."""
    for cfg in (config, config.get("text_config")):
        if isinstance(cfg, Mapping):
            for key in ("quantization_config", "compression_config"):
                qc = cfg.get(key)
                if isinstance(qc, Mapping):
                    return qc
    return None


def layer_count(tc: Mapping[str, Any]) -> int | None:
    """``num_hidden_layers``; None when absent or absurd (unknown)."""
    n = tc.get("num_hidden_layers")
    return n if isinstance(n, int) and 0 <= n <= 100_000 else None


def mtp_count(tc: Mapping[str, Any]) -> int:
    """MTP / draft layers the config declares (0 if none)."""
    return next((int(tc[f]) for f in MTP_COUNT_FIELDS if isinstance(tc.get(f), int)), 0)


def attention_layers(tc: Mapping[str, Any], n: int | None) -> list[int] | None:
    """Indices of the layers that hold a KV cache (None: layer count unknown)."""
    if not isinstance(n, int):
        return None
    types = tc.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        # Hybrid models (Qwen3-Next/3.5, ...): linear-attention layers have no KV cache.
        return [
            i
            for i, t in enumerate(types)
            if isinstance(t, str) and "attention" in t and "linear" not in t
        ]
    return list(range(n))


#: More heads than any model has: such a count is treated as unknown, not allocated.
MAX_HEADS = 100_000


def _int_field(cfg: Mapping[str, Any], key: str) -> int | None:
    value = cfg.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _plausible(n: int | None) -> int | None:
    return n if n is not None and n <= MAX_HEADS else None


def head_counts(config: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(KV heads, attention heads) of the language model, as the hosts read them:
    ``num_key_value_heads``, else ``num_attention_heads`` (no GQA); ``text_config``
    first for multimodal configs. An absurd count (> ``MAX_HEADS``) is unknown (None)."""
    tc = config.get("text_config")
    for cfg in (tc, config):
        if not isinstance(cfg, Mapping):
            continue
        heads = _int_field(cfg, "num_attention_heads")
        kv = _int_field(cfg, "num_key_value_heads")
        if heads is not None or kv is not None:
            return _plausible(kv if kv is not None else heads), _plausible(heads)
    return None, None


def layer_of(
    module: str, n: int | None, mtp: int, attn_layers: list[int] | None
) -> tuple[int | None, bool, bool]:
    """(index, is MTP, known to the model as an attention layer) for a module path."""
    # The innermost index wins (e.g. "model.language_model.layers.3").
    matches = list(LAYER_INDEX.finditer(module))
    idx = int(matches[-1]["idx"]) if matches else None
    is_mtp = any(part.startswith("mtp") for part in module.split("."))
    if idx is None or is_mtp or n is None:
        return idx, is_mtp, True
    if idx >= n:
        # DeepSeek-style MTP: model.layers.{n}..{n + k - 1}.
        if idx < n + mtp:
            return idx, True, True
        return idx, False, False
    # Hybrid models: a linear-attention layer has no KV cache to scale.
    return idx, False, attn_layers is None or idx in attn_layers


def template(name: str) -> str:
    """``name`` with its layer index as ``{i}`` (``model.layers.{i}.self_attn.k_scale``)."""
    return LAYER_INDEX.sub(lambda m: m.group(0).replace(m["idx"], "{i}"), name)
