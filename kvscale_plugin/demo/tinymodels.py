"""Tiny compressed-tensors checkpoints built locally (no downloads): what ``kvscale demo``
runs on by default.

The model is "boosted but compensated": ``k_proj`` / ``v_proj`` are multiplied
by ``boost`` and ``q_proj`` / ``o_proj`` divided by it, so the bf16 outputs are
unchanged while K/V values reach ~1,000 -- beyond FP8 e4m3's 448. An FP8 cache
then stays close to the bf16 reference only when the calibrated scales are used.

The demo's variants are small Llamas with per-tensor scales under one of ``NAMINGS``
(``build_tiny_checkpoint(dir, TinySpec(...))``). The tests build every other checkpoint
shape kvscale loads (more families, MTP layers, per-head scales, shards) from the steps
here (tests/support/kvscale_testing/tinymodels.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvscale_plugin.scheme import FP8_KV_SCHEME

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "FP8 key value caches halve the memory of long context serving.",
    "Calibrated scales keep every attention layer inside the representable range.",
    "A tiny model is enough to tell a right scale from a wrong one.",
    "Paged attention stores keys and values in fixed size blocks.",
    "Numbers like 448, 1000 and 0.5 appear in quantization papers.",
]
#: The fixed text whose teacher-forced logprobs compare engines.
REFERENCE_TEXT = (
    "Calibrated scales keep every attention layer inside the representable range, "
    "and the quick brown fox jumps over the lazy dog while paged attention stores "
    "keys and values in fixed size blocks."
)

#: Where a checkpoint stores its k/v scales, per naming convention ("{i}" = layer).
NAMINGS: dict[str, tuple[str, str | None]] = {
    "self_attn": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    "output_scale": (
        "model.layers.{i}.self_attn.k_proj.output_scale",
        "model.layers.{i}.self_attn.v_proj.output_scale",
    ),
    "kv_scale": ("model.layers.{i}.self_attn.kv_scale", None),
}


@dataclass
class TinySpec:
    """What to build: a Llama of ``num_layers`` layers, its calibrated per-layer scales
    stored under ``naming`` (a ``NAMINGS`` key) unless ``write_scales`` is off, and a
    compressed-tensors config declaring ``kv_cache_scheme``."""

    num_layers: int = 2
    seed: int = 0
    boost: float = 1000.0
    kv_cache_scheme: Mapping[str, Any] | None = field(default_factory=lambda: dict(FP8_KV_SCHEME))
    naming: str = "self_attn"
    write_scales: bool = True


def _tokenizer_files(cache_dir: Path) -> Path:
    """Train (once, cached) a small byte-level BPE tokenizer on CORPUS."""
    tok_dir = cache_dir / "tokenizer"
    if (tok_dir / "tokenizer.json").exists():
        return tok_dir
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    tmp = tok_dir.with_name(f"tokenizer.tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": 2048,
            }
        )
    )
    try:
        tmp.rename(tok_dir)
    except OSError:  # another process won the race
        pass
    return tok_dir


def _config_kwargs(num_layers: int, vocab_size: int, num_kv_heads: int = 2) -> dict[str, Any]:
    """What every tiny model's transformers config shares."""
    return dict(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=num_kv_heads,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        rms_norm_eps=1e-6,
    )


def build_tiny_checkpoint(
    out_dir: str | os.PathLike[str],
    spec: TinySpec | None = None,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Write a tiny compressed-tensors checkpoint to ``out_dir`` and return its path.

    Also writes ``kvscale_tiny.json``: the scales that were stored (per layer) and the
    calibrated ones, to compare what an engine loaded against; the demo takes its
    presence as "this checkpoint is built".
    """
    import transformers

    spec = spec or TinySpec()
    out, tok_dir, tokenizer = _start(out_dir, cache_dir)
    config = transformers.LlamaConfig(**_config_kwargs(spec.num_layers, len(tokenizer)))
    model = _boosted_model(config, spec.seed, spec.boost)
    scales = {i: (max(k), max(v)) for i, (k, v) in _calibrate(model, tokenizer).items()}
    sd = _state_dict(model)
    stored: dict[int, dict[str, float]] = {}
    if spec.kv_cache_scheme is not None and spec.write_scales:
        for i in range(spec.num_layers):
            stored[i] = _put_scales(sd, NAMINGS[spec.naming], f"model.layers.{i}.", scales[i])
    _save(out, sd)
    cfg = _config_dict(config, model)
    cfg["quantization_config"] = _quantization_config(spec.kv_cache_scheme)
    record = {
        "naming": spec.naming,
        "family": "llama",
        "stored_scales": stored,
        "stored_mtp_scales": {},
        "calibrated_scales": {i: list(s) for i, s in scales.items()},
    }
    return _finish(out, cfg, tok_dir, record)


def _start(
    out_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None
) -> tuple[Path, Path, Any]:
    """The output folder (created), the cached tokenizer's folder, the tokenizer."""
    import transformers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_dir = _tokenizer_files(Path(cache_dir) if cache_dir else out.parent)
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tok_dir / "tokenizer.json"))
    return out, tok_dir, tokenizer


def _boosted_model(config: Any, seed: int, boost: float) -> Any:
    """The randomly initialised model, its K/V boosted by ``boost`` (compensated in q/o)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        # Random init is small; make the network non-trivial and boost K/V.
        for layer in model.model.layers:
            attn = getattr(layer, "self_attn", None)
            if attn is None:
                continue  # a linear-attention layer: no KV cache
            attn.k_proj.weight.mul_(boost)
            attn.v_proj.weight.mul_(boost)
            attn.q_proj.weight.div_(boost)
            attn.o_proj.weight.div_(boost)
            for proj in (attn.k_proj, attn.v_proj, attn.q_proj):
                if getattr(proj, "bias", None) is not None:
                    scale = boost if proj is not attn.q_proj else 1.0 / boost
                    proj.bias.mul_(scale)
    return model


def _state_dict(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def _put_scales(
    sd: dict[str, torch.Tensor],
    naming: tuple[str, str | None],
    prefix: str,
    pair: tuple[float, float],
) -> dict[str, float]:
    """Store one layer's per-tensor k/v scales under ``naming`` (a ``NAMINGS`` entry)
    with its ``model.layers.{i}.`` replaced by ``prefix``; return what was stored."""
    k_pat, v_pat = (
        pat.replace("model.layers.{i}.", prefix) if pat is not None else None for pat in naming
    )
    k, v = pair
    if v_pat is None:  # legacy single scale: the larger one covers both
        kv = max(k, v)
        sd[k_pat] = torch.tensor([kv], dtype=torch.float32)
        return {"k": kv, "v": kv}
    sd[k_pat] = torch.tensor([k], dtype=torch.float32)
    sd[v_pat] = torch.tensor([v], dtype=torch.float32)
    return {"k": k, "v": v}


def _config_dict(config: Any, model: Any) -> dict[str, Any]:
    cfg = config.to_dict()
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]
    return cfg


def _quantization_config(kv_cache_scheme: Mapping[str, Any] | None) -> dict[str, Any]:
    """A compressed-tensors ``quantization_config`` (with or without a kv_cache_scheme)."""
    return {
        "config_groups": {},
        "format": "dense",
        "global_compression_ratio": None,
        "ignore": [],
        "kv_cache_scheme": dict(kv_cache_scheme) if kv_cache_scheme is not None else None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    }


def _finish(out: Path, cfg: dict[str, Any], tok_dir: Path, record: dict[str, Any]) -> Path:
    """Write ``config.json``, the tokenizer's files and ``kvscale_tiny.json``."""
    (out / "config.json").write_text(json.dumps(cfg, indent=2, default=str))
    for f in tok_dir.iterdir():
        (out / f.name).write_bytes(f.read_bytes())
    (out / "kvscale_tiny.json").write_text(json.dumps(record, indent=2))
    return out


def _save(out: Path, sd: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})


def _calibrate(model: Any, tokenizer: Any) -> dict[int, tuple[list[float], list[float]]]:
    """Per-KV-head amax/448 of K (after RoPE) and V over the corpus, per attention layer
    (a per-tensor scale is the max over the heads)."""
    n_kv = model.config.num_key_value_heads
    amax: dict[int, list[torch.Tensor]] = {}
    hooks = []

    def make_hook(i: int, kind: int) -> Any:
        def hook(_m: Any, _inp: Any, output: torch.Tensor) -> None:
            heads = output.detach().abs().reshape(-1, n_kv, output.shape[-1] // n_kv)
            per = heads.amax(dim=(0, 2))
            cur = amax.setdefault(i, [torch.zeros(n_kv), torch.zeros(n_kv)])
            cur[kind] = torch.maximum(cur[kind], per)

        return hook

    for i, layer in enumerate(model.model.layers):
        if not hasattr(layer, "self_attn"):
            continue  # a linear-attention layer: no KV cache
        hooks.append(layer.self_attn.k_proj.register_forward_hook(make_hook(i, 0)))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(make_hook(i, 1)))
    with torch.no_grad():
        for text in [*CORPUS, REFERENCE_TEXT]:
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            model(ids)
    for h in hooks:
        h.remove()

    # RoPE rotates pairs of K elements: allow sqrt(2) headroom on K.
    def scale(t: torch.Tensor, headroom: float) -> list[float]:
        return [round(float(x) * headroom / 448.0, 6) for x in t]

    return {i: (scale(k, 1.4142), scale(v, 1.0)) for i, (k, v) in amax.items()}
