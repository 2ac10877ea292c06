"""Observing what the KV cache stores: the model run with transformers.

Runs the model on calibration text and records, per attention layer and per KV head,
the absolute maximum of exactly what the KV cache stores: the keys after rotary
embedding (and after any k-norm, e.g. Qwen3's), and the values. An attention function
registered with transformers (``ATTN_IMPLEMENTATION``) sees them and then runs ``sdpa``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from kvscale_plugin.calibration.common import CalibrationError

#: Name of the observing attention function registered with transformers.
ATTN_IMPLEMENTATION = "kvscale_kv_observer"


class _Observer:
    """Running per-head abs maxima of the keys and values each attention layer receives."""

    def __init__(self, module_names: Mapping[int, str]) -> None:
        self.module_names = module_names
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def record(self, module: torch.nn.Module, key: torch.Tensor, value: torch.Tensor) -> None:
        name = self.module_names.get(id(module))
        if name is None:
            raise CalibrationError(
                f"an attention module of type {type(module).__name__} is not a named "
                "submodule of the model; cannot name its scales"
            )
        # [batch, num_kv_heads, seq, head_dim] -> per KV head
        k = key.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        v = value.detach().abs().amax(dim=(0, 2, 3)).float().cpu()
        self.k[name] = k if name not in self.k else torch.maximum(self.k[name], k)
        self.v[name] = v if name not in self.v else torch.maximum(self.v[name], v)


_ACTIVE: list[_Observer] = []


def _observing_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    # transformers calls the attention function with the keys *after* rotary embedding
    # (and after a k-norm where the model has one), and with the values, in the
    # [batch, kv_heads, seq, head_dim] layout before any repeat for GQA: exactly what a
    # KV cache stores. Hooks on k_proj / v_proj outputs would see keys *before* rotary
    # (rotary mixes pairs of elements, so the maxima differ, by up to sqrt(2)) and before
    # any k-norm (Qwen3 normalizes K per head: the projection's maxima are unrelated to
    # the cached ones).
    if _ACTIVE:
        _ACTIVE[-1].record(module, key, value)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, _observing_attention)
    # The same masks as "sdpa" (causal, sliding window, ...).
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


@dataclass
class Observed:
    """Per attention module (``model.layers.N.self_attn``): per-KV-head abs maxima."""

    k_amax: dict[str, torch.Tensor]
    v_amax: dict[str, torch.Tensor]
    num_samples: int
    num_tokens: int
    seconds: float
    #: (tokens, seconds) per sample, in order.
    per_sample: list[tuple[int, float]] = field(default_factory=list)


def _load_config_for_calibration(model_dir: Path) -> Any:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    qc = getattr(config, "quantization_config", None)
    if isinstance(qc, Mapping) and qc.get("quant_method") == "compressed-tensors":
        if not qc.get("config_groups"):
            # KV-cache-only config: the weights are plain. Loading it without the config
            # keeps compressed-tensors from attaching its own KV quantization to attention.
            del config.quantization_config
        else:
            # Weight-quantized: keep the weight schemes, drop the KV part for calibration
            # (we observe the unquantized K/V the cache receives).
            config.quantization_config = {**qc, "kv_cache_scheme": None}
    return config


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def weights_dtype(model_dir: str | os.PathLike[str]) -> torch.dtype:
    """The dtype most of the stored floating-point weights have (from safetensors headers).

    ``auto`` calibrates in this dtype: K and V are then computed the way an engine
    serving the stored weights computes them. (``config.json`` is not trusted for this:
    exporters sometimes record the dtype the model was built in, not the one stored.)
    """
    from kvscale_plugin.checkpoint import checkpoint_files, read_safetensors_header

    counts: dict[str, int] = {}
    for f in checkpoint_files(model_dir)[0]:
        for info in read_safetensors_header(f)[0].values():
            if info.dtype in _DTYPES:
                counts[info.dtype] = counts.get(info.dtype, 0) + info.numel
    return _DTYPES[max(counts, key=counts.__getitem__)] if counts else torch.bfloat16


def load_model(
    model_dir: str | os.PathLike[str], device: str = "cpu", dtype: str | torch.dtype = "auto"
) -> tuple[Any, Any]:
    """(model, tokenizer) loaded with the observing attention function.

    ``dtype="auto"``: the dtype of the stored weights (see ``weights_dtype``).
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _register_attention()
    model_dir = Path(model_dir)
    if dtype == "auto":
        dtype = weights_dtype(model_dir)
    elif isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    config = _load_config_for_calibration(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # old scale tensors are "unexpected keys"
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir),
            config=config,
            dtype=dtype,
            attn_implementation=ATTN_IMPLEMENTATION,
        )
    finally:
        transformers.logging.set_verbosity(verbosity)
    model.to(device)
    model.eval()
    return model, tokenizer


def observe(
    model: Any,
    tokenizer: Any,
    texts: Sequence[str],
    *,
    max_len: int = 512,
    progress: bool = True,
    stream: TextIO | None = None,
    observer: _Observer | None = None,
    purpose: str = "calibrate",
) -> Observed:
    """Run ``texts`` one at a time (no padding, no KV cache) and record K/V abs maxima.

    ``observer``: one that records more (``check``'s saturation counts), built on this
    model's ``named_modules``; ``purpose`` names the command in progress and errors."""
    from tqdm import tqdm

    names = {id(m): n for n, m in model.named_modules()}
    observer = observer if observer is not None else _Observer(names)
    device = next(model.parameters()).device
    per_sample: list[tuple[int, float]] = []
    t_all = time.perf_counter()
    _ACTIVE.append(observer)
    try:
        bar = tqdm(
            texts,
            desc=f"{purpose.rstrip('e')}ing",
            unit="sample",
            disable=not progress,
            file=stream or sys.stderr,
        )
        for text in bar:
            ids = tokenizer(text, return_tensors="pt", truncation=True, max_length=max_len)[
                "input_ids"
            ].to(device)
            if ids.shape[1] == 0:
                continue
            t0 = time.perf_counter()
            with torch.inference_mode():
                model(input_ids=ids, use_cache=False)
            per_sample.append((int(ids.shape[1]), time.perf_counter() - t0))
    finally:
        _ACTIVE.remove(observer)
    if not observer.k:
        raise CalibrationError(
            "no attention layer reported its keys/values: this model's attention does not "
            "call transformers' attention interface (not supported by kvscale calibrate)"
        )
    bad = [
        n
        for n in observer.k
        if not (torch.isfinite(observer.k[n]).all() and torch.isfinite(observer.v[n]).all())
    ]
    if bad:
        raise CalibrationError(
            f"non-finite keys/values (NaN or inf) in {', '.join(sorted(bad))}: the model "
            f"overflows in its dtype on this text; cannot {purpose}"
        )
    return Observed(
        k_amax=observer.k,
        v_amax=observer.v,
        num_samples=len(per_sample),
        num_tokens=sum(t for t, _ in per_sample),
        seconds=time.perf_counter() - t_all,
        per_sample=per_sample,
    )
