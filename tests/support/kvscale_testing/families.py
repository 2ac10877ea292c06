"""Tiny checkpoints of many decoder families, built with transformers' own classes, with
one distinct k/v scale per attention layer stored where the checkpoint's attention module
is (``<HF attention module path>.k_scale``: what llm-compressor writes), for the family
sweep (tests/e2e/test_vllm_families.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

#: Tiny geometry shared by every family (head size 64: vLLM's CPU FP8 cache wants a
#: multiple of 32). Each family adds or overrides what its config needs.
BASE: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclass(frozen=True)
class Family:
    """A decoder family: its transformers config class and what the tiny one changes."""

    name: str
    config: str  # transformers config class
    kind: str  # dense, sliding-window, MoE, hybrid, fused-qkv, NoPE
    overrides: dict[str, Any] = field(default_factory=dict)
    drop: tuple[str, ...] = ()  # BASE keys the config does not take
    per_expert: bool = False  # experts stored one by one (what vLLM's loader reads)


# Gated DeltaNet layers, then full attention (vLLM's CPU Gated DeltaNet wants head size 128).
_LINEAR: dict[str, Any] = dict(
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_num_key_heads=1,
    linear_num_value_heads=2,
    layer_types=["linear_attention", "full_attention"],
)

# GPT-2-style configs name the geometry n_embd / n_layer / n_head / n_positions.
_GPT2_NAMES = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "intermediate_size",
)
_GPT2 = {"n_embd": 128, "n_layer": 2, "n_head": 2, "n_positions": 512}

FAMILIES: tuple[Family, ...] = (
    Family("llama", "LlamaConfig", "dense"),
    Family("mistral", "MistralConfig", "sliding-window", {"sliding_window": 64}),
    Family("qwen2", "Qwen2Config", "dense"),
    Family("qwen3", "Qwen3Config", "dense"),
    Family(
        "qwen3_moe",
        "Qwen3MoeConfig",
        "MoE",
        {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    ),
    Family(
        "gemma2",
        "Gemma2Config",
        "sliding-window",
        {"sliding_window": 64, "tie_word_embeddings": True},
    ),
    Family(
        "gemma3_text",
        "Gemma3TextConfig",
        "sliding-window",
        {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    Family("phi3", "Phi3Config", "fused-qkv", {"pad_token_id": 0}),
    Family("olmo2", "Olmo2Config", "dense"),
    Family("granite", "GraniteConfig", "dense"),
    Family("starcoder2", "Starcoder2Config", "dense", drop=("head_dim",)),
    Family("stablelm", "StableLmConfig", "dense", drop=("head_dim",)),
    Family("cohere", "CohereConfig", "dense"),
    Family("smollm3", "SmolLM3Config", "NoPE", {"no_rope_layers": [1, 0], "pad_token_id": 0}),
    Family(
        "gpt_oss",
        "GptOssConfig",
        "MoE, sliding-window",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
        },
    ),
    Family(
        "falcon_h1",
        "FalconH1Config",
        "hybrid Mamba-2",
        {
            "mamba_d_ssm": 128,
            "mamba_n_heads": 4,
            "mamba_d_head": 32,
            "mamba_d_state": 16,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 32,
        },
    ),
    Family(
        "jamba",
        "JambaConfig",
        "hybrid Mamba, MoE",
        {
            "attn_layer_period": 2,
            "attn_layer_offset": 1,
            "expert_layer_period": 2,
            "expert_layer_offset": 1,
            "num_experts": 2,
            "num_experts_per_tok": 1,
            "mamba_d_state": 16,
            "mamba_d_conv": 4,
            "mamba_expand": 2,
            "use_mamba_kernels": False,
        },
        drop=("head_dim",),
    ),
    Family(
        "gpt_bigcode",
        "GPTBigCodeConfig",
        "fused-qkv (c_attn)",
        {**_GPT2, "multi_query": True},
        drop=_GPT2_NAMES,
    ),
    Family(
        "gptj",
        "GPTJConfig",
        "dense",
        {**_GPT2, "rotary_dim": 32},
        drop=_GPT2_NAMES,
    ),
    Family(
        "qwen3_next",
        "Qwen3NextConfig",
        "hybrid linear attention, MoE",
        {
            **_LINEAR,
            "moe_intermediate_size": 64,
            "shared_expert_intermediate_size": 64,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
        per_expert=True,
    ),
    Family(
        "exaone4",
        "Exaone4Config",
        "sliding-window",
        {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    Family("glm4", "Glm4Config", "dense", {"pad_token_id": 0}),
    Family("olmoe", "OlmoeConfig", "MoE", {"num_experts": 4, "num_experts_per_tok": 2}),
    Family(
        "gpt_neox",
        "GPTNeoXConfig",
        "fused-qkv (query_key_value)",
        {"rotary_pct": 0.5},
        drop=("head_dim", "num_key_value_heads"),
    ),
)

BY_NAME = {family.name: family for family in FAMILIES}
#: The sweep in two test files, so that pytest-xdist runs the halves side by side.
HALVES = (FAMILIES[: len(FAMILIES) // 2], FAMILIES[len(FAMILIES) // 2 :])


def scale_pair(index: int) -> tuple[float, float]:
    """Layer ``index``'s (k, v): distinct per layer, k != v, none 1.0, exact in bf16."""
    return 1.5 + 0.5 * index, 1.75 + 0.5 * index


_INDEX = re.compile(r"(?:^|\.)(\d+)(?:\.|$)")


def layer_number(name: str) -> int:
    """The first integer component of a module path (the decoder layer's index)."""
    match = _INDEX.search(name)
    if match is None:
        raise ValueError(f"no layer index in {name!r}")
    return int(match.group(1))


def attention_modules(model: torch.nn.Module) -> list[str]:
    """Paths of the outermost ``*Attention`` modules (one per attention layer)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Attention") or not name:
            continue
        if any(name.startswith(outer + ".") for outer in found):
            continue
        found.append(name)
    return found


def build_family_checkpoint(out: Path, family: Family) -> Path:
    """The family's tiny checkpoint at ``out`` (built once; ``scales.json`` lists the
    stored scale per layer index)."""
    if (out / "scales.json").exists():
        return out
    import transformers
    from safetensors.torch import save_file

    kwargs = {k: v for k, v in BASE.items() if k not in family.drop}
    kwargs.update(family.overrides)
    config = getattr(transformers, family.config)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if family.per_expert:
        from kvscale_testing.tinymodels import _per_expert

        sd = _per_expert(sd)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)  # tied: stored once, as HF saves it
    stored: dict[int, dict[str, Any]] = {}
    for path in attention_modules(model):
        index = layer_number(path)
        k, v = scale_pair(index)
        sd[f"{path}.k_scale"] = torch.tensor(k, dtype=torch.float32)
        sd[f"{path}.v_scale"] = torch.tensor(v, dtype=torch.float32)
        stored[index] = {"module": path, "k": k, "v": v}
    if not stored:
        raise ValueError(f"{family.name}: no attention module found")
    out.mkdir(parents=True, exist_ok=True)
    # Tied / shared storage is saved once, as safetensors requires.
    save_file({k: v.clone() for k, v in sd.items()}, str(out / "model.safetensors"))
    cfg = config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]
    cfg["quantization_config"] = {
        "config_groups": {},
        "format": "dense",
        "ignore": [],
        "kv_cache_scheme": {
            "num_bits": 8,
            "type": "float",
            "strategy": "tensor",
            "dynamic": False,
            "symmetric": True,
        },
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    _write_tokenizer(out, config.vocab_size)
    (out / "scales.json").write_text(json.dumps(stored, indent=2))
    return out


def stored_scales(ckpt: Path) -> dict[int, dict[str, Any]]:
    return {int(i): s for i, s in json.loads((ckpt / "scales.json").read_text()).items()}


def _write_tokenizer(out: Path, vocab_size: int) -> None:
    """A word-level tokenizer over ``vocab_size`` made-up words (engines need one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2}
    vocab.update({f"w{i}": i for i in range(3, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "model_max_length": 512,
            }
        )
    )


def _index_part(path: str, index: int) -> re.Match[str] | None:
    return re.search(rf"(?:^|\.)({index})(?:\.|$)", path)


def _templated(path: str, index: int) -> str:
    match = _index_part(path, index)
    if match is None:
        return path.replace("{", "{{").replace("}", "}}")
    head, tail = path[: match.start(1)], path[match.end(1) :]
    return head.replace("{", "{{") + "{}" + tail.replace("}", "}}")


def layer_rows(stored: dict[int, dict[str, Any]], engine: dict[str, Any]) -> list[list[str]]:
    """The table rows (``kvscale_plugin/inspection/vllm_layers.py``) a live engine shows:
    for each checkpoint attention module, the engine layer serving its (distinct) scales
    -- its parameter path and its name -- with the layer index generalised."""
    rows: set[tuple[str, str, str]] = set()
    for name, layer in engine.items():
        owners = [i for i, s in stored.items() if (s["k"], s["v"]) == (layer.k, layer.v)]
        if len(owners) != 1 or layer.path is None:
            continue
        index = owners[0]
        module = stored[index]["module"]
        match = _index_part(module, index)
        assert match is not None, module
        pattern = re.escape(module[: match.start(1)]) + r"(\d+)" + re.escape(module[match.end(1) :])
        rows.add((pattern, _templated(layer.path, index), _templated(name, index)))
    return [list(row) for row in sorted(rows)]
