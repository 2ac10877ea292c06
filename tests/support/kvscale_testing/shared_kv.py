"""Tiny Gemma-4 / Gemma-3n text checkpoints whose last layers read an earlier layer's KV
cache (``num_kv_shared_layers=2``: layers 2 and 3 read layers 0 and 1), with a
compressed-tensors FP8 ``kv_cache_scheme`` and per-layer scales for the layers that write
the cache -- as a calibration tool writes them -- plus, on request, scales under the
sharing layers' own names."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import torch

from kvscale_plugin.demo.tinymodels import _tokenizer_files
from kvscale_plugin.scheme import FP8_KV_SCHEME

#: layer -> the layer whose cache it reads, in vLLM's names.
SHARING = {
    "model.layers.2.self_attn.attn": "model.layers.0.self_attn.attn",
    "model.layers.3.self_attn.attn": "model.layers.1.self_attn.attn",
}
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def _config(family: str, vocab_size: int, kv_heads: int, one_head_dim: bool = False) -> object:
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2 * kv_heads,
        num_key_value_heads=kv_heads,
        head_dim=64,
        num_kv_shared_layers=2,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=1,
        layer_types=LAYER_TYPES,
        sliding_window=64,
    )
    if family == "gemma4":
        # one_head_dim: full-attention layers' head_dim (global_head_dim, 512 by default)
        # equal to the sliding ones' -- SGLang 0.5.23 reads config.head_dim, which
        # transformers refuses to answer for a Gemma-4 text config whose layers differ.
        extra = {"global_head_dim": common["head_dim"]} if one_head_dim else {}
        return transformers.Gemma4TextConfig(**common, **extra)
    if family == "gemma3n":
        return transformers.Gemma3nTextConfig(
            **common,
            vocab_size_per_layer_input=vocab_size,
            hidden_size_per_layer_input=16,
            activation_sparsity_pattern=[0.0] * 4,
            altup_num_inputs=2,
            laurel_rank=8,
        )
    raise ValueError(family)


def build_shared_kv_checkpoint(
    out: Path,
    *,
    family: str = "gemma4",
    scales: Mapping[int, tuple[float, float]] | str | None = None,
    own_scales: Mapping[int, tuple[float, float]] | None = None,
    cache_dir: Path | None = None,
    boost: float = 1.0,
    per_head: bool = False,
    one_head_dim: bool = False,
) -> Path:
    """``scales``: writing layer -> (k, v) (default: distinct values for layers 0 and 1;
    ``"calibrate"``: amax / 448 of what each writing layer caches, over the reference
    text, with a 1.5x margin); ``own_scales``: sharing layer -> (k, v) stored under its own
    name. ``boost`` multiplies the writing layers' ``k_norm`` weights (keys after the norm:
    Gemma normalizes K and V per head, V without a weight) so that scale 1.0 clips K, and
    divides every layer's ``q_norm`` weights by it (attention scores unchanged).
    ``per_head``: two KV heads, ``strategy: attn_head``, scales ``[2, 1, 1]`` (head 1 at
    twice head 0's value)."""
    import transformers
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer_files(cache_dir or out.parent)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    config = _config(family, len(tok), 2 if per_head else 1, one_head_dim)
    torch.manual_seed(0)
    cls = {"gemma4": "Gemma4ForCausalLM", "gemma3n": "Gemma3nForCausalLM"}[family]
    model = getattr(transformers, cls)(config).eval()
    if boost != 1.0:
        with torch.no_grad():
            for i, layer in enumerate(model.model.layers):
                if i < 2:
                    layer.self_attn.k_norm.weight.mul_(boost)
                layer.self_attn.q_norm.weight.div_(boost)  # q.k as before: sharers too
    if scales == "calibrate":
        scales = _calibrate(model, tok)
    # Tied embeddings: no lm_head tensor (vLLM's Gemma-3n loader has no such parameter).
    sd = {
        k: v.to(torch.bfloat16).contiguous()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    scales = dict(scales or {0: (0.5, 0.25), 1: (1.5, 1.25)})
    for i, (k, v) in {**scales, **dict(own_scales or {})}.items():
        for name, value in (("k_scale", k), ("v_scale", v)):
            tensor = torch.tensor([value, 2 * value] if per_head else [value])
            shape = (2, 1, 1) if per_head else (1,)
            sd[f"model.layers.{i}.self_attn.{name}"] = tensor.float().reshape(shape)
    save_file(sd, str(out / "model.safetensors"))
    cfg = config.to_dict()
    cfg["architectures"] = [cls]
    cfg["torch_dtype"] = "bfloat16"
    cfg["quantization_config"] = {
        "config_groups": {},
        "format": "dense",
        "ignore": [],
        "kv_cache_scheme": {**FP8_KV_SCHEME, "strategy": "attn_head" if per_head else "tensor"},
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    for f in tok_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "shared_kv.json").write_text(json.dumps({"scales": scales}))
    return out


def stored_scales(model_dir: Path) -> dict[int, tuple[float, float]]:
    """The writing layers' (k, v) ``build_shared_kv_checkpoint`` stored."""
    raw = json.loads((model_dir / "shared_kv.json").read_text())["scales"]
    return {int(i): (float(k), float(v)) for i, (k, v) in raw.items()}


def _calibrate(model: torch.nn.Module, tok: object) -> dict[int, tuple[float, float]]:
    """amax / 448 (x1.5: rotary embedding may grow an element by up to sqrt 2) of the
    normalized K and V each writing layer caches, over the reference text."""
    from kvscale_plugin.demo.tinymodels import REFERENCE_TEXT

    amax: dict[tuple[int, str], float] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers[:2]):
        for kind in ("k_norm", "v_norm"):

            def hook(_m, _inp, out, key=(i, kind)):  # noqa: ANN001, ANN202
                amax[key] = max(amax.get(key, 0.0), float(out.detach().abs().max()))

            hooks.append(getattr(layer.self_attn, kind).register_forward_hook(hook))
    with torch.no_grad():
        model(torch.tensor([tok(REFERENCE_TEXT)["input_ids"]]))
    for h in hooks:
        h.remove()
    return {i: (amax[i, "k_norm"] * 1.5 / 448, amax[i, "v_norm"] * 1.5 / 448) for i in range(2)}


#: The Gemma-4 assistant drafter's layers -> the target layers vLLM's proposer wires them to
#: (the last non-sharing target layer of the same type: sliding, full).
ASSISTANT_SHARING = {
    "draft_model.layers.0.self_attn.attn": "model.layers.0.self_attn.attn",
    "draft_model.layers.1.self_attn.attn": "model.layers.1.self_attn.attn",
}


def build_gemma4_assistant(out: Path, target: Path) -> Path:
    """A tiny bf16 Gemma-4 assistant drafter (``Gemma4AssistantForCausalLM``: Q-only layers
    over the target's cache, no ``quantization_config``) for ``target``
    (``build_shared_kv_checkpoint(family="gemma4")``), with its tokenizer."""
    import transformers

    cfg = json.loads((target / "config.json").read_text())
    text = transformers.Gemma4TextConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        num_kv_shared_layers=2,
        max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=64,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        enable_moe_block=False,
        use_double_wide_mlp=False,
    )
    config = transformers.Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=128, num_centroids=16, centroid_intermediate_top_k=4
    )
    torch.manual_seed(1)
    transformers.Gemma4AssistantForCausalLM(config).eval().save_pretrained(out)
    for f in target.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out
