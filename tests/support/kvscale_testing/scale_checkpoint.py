"""A checkpoint of scales only (config.json with a kv_cache_scheme, per-layer k/v scales),
written without torch: enough for ``kvscale inspect``, not for an engine."""

from __future__ import annotations

import json
from pathlib import Path

from kvscale_plugin.scheme import FP8_KV_SCHEME


def scale_only_checkpoint(
    path: Path, *, k: float = 0.5, v: float = 0.25, strategy: str = "tensor"
) -> Path:
    """``strategy="attn_head"``: per-head scales, ``[2, 1, 1]`` (2 KV heads)."""
    import numpy as np
    from safetensors.numpy import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 64,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "format": "dense",
            "kv_cache_scheme": {**FP8_KV_SCHEME, "strategy": strategy},
        },
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        f"model.layers.{i}.self_attn.{kind}_scale": np.full(
            [2, 1, 1] if strategy == "attn_head" else [1], value, dtype=np.float32
        )
        for i in range(2)
        for kind, value in (("k", k), ("v", v))
    }
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
