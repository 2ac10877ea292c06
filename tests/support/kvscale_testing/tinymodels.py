"""Every tiny checkpoint shape the tests build: the demo's "boosted but compensated"
models (``kvscale_plugin.demo.tinymodels``) in more families (``FAMILIES``,
``MTP_FAMILIES``), with more scale namings (``NAMINGS``), per-head scales, explicit
scales, extra tensors, shards and multi-token-prediction (MTP) layers.

``build_tiny_checkpoint(dir, TinySpec(...))`` composes the demo's build steps; for a
``TinySpec`` the demo also takes (a Llama, per-tensor calibrated scales, one shard) it
writes the same files as the demo's builder.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvscale_plugin.demo import tinymodels as demo
from kvscale_plugin.demo.tinymodels import CORPUS, REFERENCE_TEXT

__all__ = [
    "CORPUS",
    "FAMILIES",
    "MTP_FAMILIES",
    "NAMINGS",
    "REFERENCE_TEXT",
    "TinySpec",
    "build_tiny_checkpoint",
]

#: Where a checkpoint stores its k/v scales, per naming convention ("{i}" = layer).
NAMINGS: dict[str, tuple[str, str | None]] = {
    "self_attn": demo.NAMINGS["self_attn"],
    "k_proj": (
        "model.layers.{i}.self_attn.k_proj.k_scale",
        "model.layers.{i}.self_attn.v_proj.v_scale",
    ),
    "qkv_proj": (
        "model.layers.{i}.self_attn.qkv_proj.k_scale",
        "model.layers.{i}.self_attn.qkv_proj.v_scale",
    ),
    "output_scale": demo.NAMINGS["output_scale"],
    "kv_scale": demo.NAMINGS["kv_scale"],
}

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
#: Families whose checkpoints carry multi-token-prediction (MTP) layers after the main
#: stack (``TinySpec.num_mtp_layers``), named as the real ones name them: MiMo
#: ``model.mtp_layers.N.``, GLM-4-MoE ``model.layers.{num_layers + N}.``, Qwen3-Next and
#: Qwen3.5 ``mtp.layers.N.``. vLLM serves them as speculative-decoding drafts.
MTP_FAMILIES = ("mimo", "glm4_moe", "qwen3_next", "qwen3_5")


@dataclass
class TinySpec(demo.TinySpec):
    """The demo's ``TinySpec`` and the rest. ``scales`` maps layer index -> (k, v); None
    means calibrate.

    ``per_head``: store one k/v scale per KV head (``[num_kv_heads, 1, 1]``, what
    llm-compressor writes for ``strategy: attn_head``); ``scales`` then holds
    per-head sequences. ``head_boost`` multiplies each KV head's K/V by its own
    extra factor (compensated in q/o like ``boost``) so heads need distinct scales.
    """

    family: str = "llama"
    # One NAMINGS key for every layer, or one per layer (cycled) to mix conventions.
    naming: str | Sequence[str] = "self_attn"  # type: ignore[assignment]
    scales: Mapping[int, tuple[float, float]] | None = None
    extra_tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    num_shards: int = 1
    # Write a compressed-tensors quantization_config (with or without a kv_cache_scheme).
    quantization_config: bool = True
    per_head: bool = False
    head_boost: Sequence[float] | None = None
    num_kv_heads: int = 2
    # MTP layers appended after the main stack (``MTP_FAMILIES`` only); ``mtp_scales``
    # maps MTP layer -> (k, v), None: calibrated as if they were further stack layers.
    num_mtp_layers: int = 0
    mtp_scales: Mapping[int, tuple[float, float]] | None = None
    write_mtp_scales: bool = True


def _hf_config(spec: TinySpec, vocab_size: int) -> Any:
    import transformers

    total = spec.num_layers + spec.num_mtp_layers  # MTP layers are built as stack layers
    common = demo._config_kwargs(total, vocab_size, spec.num_kv_heads)
    if spec.family == "llama":
        return transformers.LlamaConfig(**common)
    if spec.family == "qwen2":
        return transformers.Qwen2Config(**common)
    if spec.family == "qwen3":
        return transformers.Qwen3Config(**common)
    if spec.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=128,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    if spec.family == "mixtral":
        return transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
    if spec.family == "mimo":  # MiMo's own config class is Qwen2's plus the MTP count
        return transformers.Qwen2Config(**common)
    if spec.family == "glm4_moe":
        return transformers.Glm4MoeConfig(
            **common,
            partial_rotary_factor=0.5,
            moe_intermediate_size=128,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            use_qk_norm=False,
        )
    if spec.family in ("qwen3_next", "qwen3_5"):
        # Hybrid stacks: linear-attention (Gated DeltaNet) layers, the last main layer and
        # the MTP layers full attention. vLLM's CPU Gated DeltaNet wants head size 128.
        hybrid: dict[str, Any] = dict(
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            layer_types=["linear_attention"] * (spec.num_layers - 1)
            + ["full_attention"] * (1 + spec.num_mtp_layers),
        )
        if spec.family == "qwen3_5":
            return transformers.Qwen3_5TextConfig(**common, **hybrid)
        return transformers.Qwen3NextConfig(
            **common,
            **hybrid,
            moe_intermediate_size=128,
            shared_expert_intermediate_size=128,
            num_experts=4,
            num_experts_per_tok=2,
        )
    known = ", ".join((*FAMILIES, *MTP_FAMILIES))
    raise ValueError(f"unknown family {spec.family!r}; choose one of {known}")


def build_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    spec: TinySpec | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a tiny compressed-tensors checkpoint to ``out_dir`` and return its path.

    Also writes ``kvscale_tiny.json``: the scales that were stored (per layer and per MTP
    layer) and the calibrated ones, to compare what an engine loaded against.
    """
    spec = spec or TinySpec()
    if spec.num_mtp_layers and spec.family not in MTP_FAMILIES:
        raise ValueError(f"MTP layers need one of the families {', '.join(MTP_FAMILIES)}")
    out, tok_dir, tokenizer = demo._start(out_dir, cache_dir)
    config = _hf_config(spec, vocab_size=len(tokenizer))
    model = demo._boosted_model(config, spec.seed, spec.boost)
    if spec.head_boost is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                if hasattr(layer, "self_attn"):
                    _boost_heads(layer.self_attn, config, spec.head_boost)

    if spec.scales is not None:
        scales = dict(spec.scales)
    else:
        calibrated = demo._calibrate(model, tokenizer)
        scales = {
            i: (k, v) if spec.per_head else (max(k), max(v)) for i, (k, v) in calibrated.items()
        }
    sd = demo._state_dict(model)
    if spec.family in ("glm4_moe", "qwen3_next"):
        sd = _per_expert(sd)  # how their checkpoints store experts (and vLLM's MTP loaders)
    if spec.num_mtp_layers:
        sd = _mtp_layout(spec, sd, hidden=config.hidden_size)
    attention = {i for i, layer in enumerate(model.model.layers) if hasattr(layer, "self_attn")}
    namings = [spec.naming] if isinstance(spec.naming, str) else list(spec.naming)
    stored: dict[int, dict[str, float]] = {}
    stored_mtp: dict[int, dict[str, float]] = {}
    if spec.kv_cache_scheme is not None and spec.write_scales:
        for i in sorted(attention & set(range(spec.num_layers))):
            stored[i] = _put_scales(
                sd, NAMINGS[namings[i % len(namings)]], f"model.layers.{i}.", scales[i], spec
            )
    if spec.kv_cache_scheme is not None and spec.write_mtp_scales:
        for m in range(spec.num_mtp_layers):
            index = spec.num_layers + m
            pair = spec.mtp_scales[m] if spec.mtp_scales is not None else scales[index]
            naming = NAMINGS[namings[index % len(namings)]]
            stored_mtp[m] = _put_scales(sd, naming, _mtp_prefix(spec, m), pair, spec)
    for name, tensor in spec.extra_tensors.items():
        sd[name] = tensor
    _save_shards(out, sd, spec.num_shards)

    cfg = demo._config_dict(config, model)
    if spec.num_mtp_layers:
        # The stack as the checkpoint declares it: the MTP layers are counted apart.
        cfg["num_hidden_layers"] = spec.num_layers
        for key in ("layer_types", "mlp_layer_types"):
            if isinstance(cfg.get(key), list):
                cfg[key] = cfg[key][: spec.num_layers]
        count = "mtp_num_hidden_layers" if spec.family == "qwen3_5" else "num_nextn_predict_layers"
        cfg[count] = spec.num_mtp_layers
        if spec.family == "mimo":
            cfg["architectures"] = ["MiMoForCausalLM"]
    if spec.quantization_config:
        cfg["quantization_config"] = demo._quantization_config(spec.kv_cache_scheme)
    record = {
        "naming": spec.naming,
        "family": spec.family,
        "stored_scales": stored,
        "stored_mtp_scales": stored_mtp,
        "calibrated_scales": {i: list(s) for i, s in scales.items()},
    }
    return demo._finish(out, cfg, tok_dir, record)


def _put_scales(
    sd: dict[str, torch.Tensor],
    naming: tuple[str, str | None],
    prefix: str,
    pair: tuple[Any, Any],
    spec: TinySpec,
) -> dict[str, Any]:
    """The demo's ``_put_scales``, also for per-head scales (``spec.per_head``)."""
    if not spec.per_head:
        return demo._put_scales(sd, naming, prefix, pair)
    k_pat, v_pat = (
        pat.replace("model.layers.{i}.", prefix) if pat is not None else None for pat in naming
    )
    k, v = pair
    if v_pat is None:  # legacy single scale: the larger one covers both
        kv = [max(a, b) for a, b in zip(k, v, strict=True)]
        sd[k_pat] = _head_scales(kv)
        return {"k": kv, "v": kv}
    sd[k_pat] = _head_scales(k)
    sd[v_pat] = _head_scales(v)
    return {"k": k, "v": v}


def _head_scales(value: Sequence[float]) -> torch.Tensor:
    # llm-compressor's per-head layout: [num_kv_heads, 1, 1].
    return torch.tensor(list(value), dtype=torch.float32).reshape(-1, 1, 1)


def _mtp_prefix(spec: TinySpec, m: int) -> str:
    """Checkpoint prefix of MTP layer ``m`` in ``spec.family``'s convention."""
    if spec.family == "mimo":
        return f"model.mtp_layers.{m}."
    if spec.family == "glm4_moe":
        return f"model.layers.{spec.num_layers + m}."
    return f"mtp.layers.{m}."  # qwen3_next, qwen3_5


def _mtp_layout(
    spec: TinySpec, sd: dict[str, torch.Tensor], hidden: int
) -> dict[str, torch.Tensor]:
    """Rename the appended stack layers into the family's MTP layers and add the MTP
    modules around them (norms: copies of the final norm; projections: small random)."""
    norm = sd["model.norm.weight"]

    def proj() -> torch.Tensor:
        return (torch.randn(hidden, 2 * hidden) * 0.02).to(torch.bfloat16)

    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        for m in range(spec.num_mtp_layers):
            stack = f"model.layers.{spec.num_layers + m}."
            if name.startswith(stack):
                name = _mtp_prefix(spec, m) + name[len(stack) :]
                break
        out[name] = tensor
    for m in range(spec.num_mtp_layers):
        prefix = _mtp_prefix(spec, m)
        if spec.family == "mimo":
            for piece in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
                out[f"{prefix}{piece}.weight"] = norm.clone()
            out[f"{prefix}input_proj.weight"] = proj()
        elif spec.family == "glm4_moe":
            for piece in ("enorm", "hnorm", "shared_head.norm"):
                out[f"{prefix}{piece}.weight"] = norm.clone()
            out[f"{prefix}eh_proj.weight"] = proj()
    if spec.family in ("qwen3_next", "qwen3_5"):
        for piece in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            out[f"mtp.{piece}.weight"] = norm.clone()
        out["mtp.fc.weight"] = proj()
    return out


def _per_expert(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' fused expert tensors (``mlp.experts.gate_up_proj`` [E, 2I, H],
    ``mlp.experts.down_proj`` [E, H, I]) as per-expert ``mlp.experts.{e}.*.weight``."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in sd.items():
        if name.endswith(".experts.gate_up_proj"):
            base, inter = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = tensor[e, :inter].contiguous()
                out[f"{base}{e}.up_proj.weight"] = tensor[e, inter:].contiguous()
        elif name.endswith(".experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e].contiguous()
        else:
            out[name] = tensor
    return out


def _boost_heads(attn: Any, config: Any, head_boost: Sequence[float]) -> None:
    """Scale KV head h's K and V by head_boost[h]; undo it in the query heads of its
    group (for K) and in o_proj's input columns for those heads (for V)."""
    n_kv, n_q, hd = config.num_key_value_heads, config.num_attention_heads, config.head_dim
    group = n_q // n_kv
    for h, factor in enumerate(head_boost):
        kv_rows = slice(h * hd, (h + 1) * hd)
        q_rows = slice(h * group * hd, (h + 1) * group * hd)
        attn.k_proj.weight[kv_rows].mul_(factor)
        attn.v_proj.weight[kv_rows].mul_(factor)
        attn.q_proj.weight[q_rows].div_(factor)
        attn.o_proj.weight[:, q_rows].div_(factor)
        for proj, rows, f in (
            (attn.k_proj, kv_rows, factor),
            (attn.v_proj, kv_rows, factor),
            (attn.q_proj, q_rows, 1.0 / factor),
        ):
            if getattr(proj, "bias", None) is not None:
                proj.bias[rows].mul_(f)


def _save_shards(out: Path, sd: dict[str, torch.Tensor], num_shards: int) -> None:
    import json

    from safetensors.torch import save_file

    if num_shards <= 1:
        demo._save(out, sd)
        return
    names = list(sd)
    weight_map: dict[str, str] = {}
    per = -(-len(names) // num_shards)
    for s in range(num_shards):
        fname = f"model-{s + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: sd[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, str(out / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    total = sum(t.numel() * t.element_size() for t in sd.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
