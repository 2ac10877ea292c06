"""Observing what the KV cache stores: the model run with transformers.

``KVRecorder`` records, per attention layer and per KV head, the absolute maximum of
exactly what the KV cache stores: the keys after rotary embedding (and after any k-norm,
e.g. Qwen3's), and the values, at the positions the attention mask keeps (padding is
never counted). It wraps the attention function transformers hands each attention layer
(whatever the model's ``attn_implementation``: eager, sdpa, flash, ...) and changes
nothing the forward computes. ``observe`` (``kvscale calibrate``) and
``trainer.record_kv_scales`` (a trainer's own forward pass) both record through it.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import torch

from kvscale_plugin.calibration.common import CalibrationError

#: The attention implementation ``load_model`` asks transformers for (the recording
#: wraps whichever one a model uses).
ATTN_IMPLEMENTATION = "sdpa"

#: Module name components that wrappers insert (FSDP1, activation checkpointing,
#: ``torch.compile``): left out of the names scales are filed under.
_WRAPPER_COMPONENTS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def module_names(model: torch.nn.Module) -> dict[int, str]:
    """``id(module)`` -> its name in ``model`` as a checkpoint names it (wrapper
    components such as ``_checkpoint_wrapped_module`` left out)."""
    return {
        id(m): ".".join(p for p in n.split(".") if p not in _WRAPPER_COMPONENTS)
        for n, m in model.named_modules()
    }


def _real_positions(mask: Any, key: torch.Tensor) -> torch.Tensor | None:
    """``[batch, kv_len]`` bool: the key positions some query attends to (None: all).

    ``mask`` is what the attention function receives: None (causal, no padding), a 4-D
    bool mask (sdpa), a 4-D additive float mask (eager), or flash attention's 2-D
    padding mask."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise CalibrationError(
            f"the attention mask is a {type(mask).__name__}, which kvscale cannot read "
            "(padding could not be left out): load the model with attn_implementation "
            "'sdpa', 'eager' or 'flash_attention_2'"
        )
    if mask.dim() == 2:
        valid = mask.bool()
    elif mask.dim() == 4:
        kept = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min
        valid = kept.any(dim=2).any(dim=1)
    else:
        raise CalibrationError(f"an attention mask of shape {tuple(mask.shape)}: not 2-D or 4-D")
    if valid.shape[-1] != key.shape[2]:
        raise CalibrationError(
            f"the attention mask covers {valid.shape[-1]} key positions, the keys "
            f"{key.shape[2]}: run the forward without a KV cache (use_cache=False)"
        )
    return valid.expand(key.shape[0], -1)


def _masked_amax(x: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """Per KV head abs max of ``x`` ``[batch, kv_heads, seq, head_dim]`` at ``valid``."""
    # [batch, kv_heads, seq]: abs max per position, NaN kept (on CPU several times faster
    # than torch.aminmax, which reads x once but does not vectorize this reduction).
    a = x.detach().abs().amax(dim=-1)
    if valid is not None:
        # masked_fill, not indexing: no device sync; NaN at padding is dropped too.
        a = a.masked_fill(~valid[:, None, :], 0)
    return a.amax(dim=(0, 2)).float()


class KVRecorder:
    """Running per-head abs maxima of the keys and values each attention layer of
    ``model`` receives, while the context is entered (the only recording code path).

    ``k`` / ``v``: attention module name -> float32 ``[num_kv_heads]`` maxima, on the
    model's device; ``tokens``: name -> real positions recorded (a tensor). Subclasses
    record more by extending ``record``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        if not hasattr(getattr(model, "config", None), "_attn_implementation"):
            raise CalibrationError(
                f"{type(model).__name__} is not a transformers model (no "
                "config._attn_implementation): kvscale records K/V through transformers' "
                "attention interface; pass the transformers model itself (a DDP-wrapped "
                "one's .module)"
            )
        self.module_names = module_names(model)
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, torch.Tensor | int] = {}
        self._mask: Any = None
        self._valid: torch.Tensor | None = None

    def record(
        self,
        module: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> None:
        """Fold in one attention call: ``key`` / ``value`` ``[batch, kv_heads, seq,
        head_dim]``, ``valid`` ``[batch, seq]`` bool (None: every position)."""
        name = self.module_names[id(module)]
        k, v = _masked_amax(key, valid), _masked_amax(value, valid)
        n = key.shape[0] * key.shape[2] if valid is None else valid.sum()
        if name in self.k:
            k, v = torch.maximum(self.k[name], k), torch.maximum(self.v[name], v)
            n = self.tokens[name] + n
        self.k[name], self.v[name], self.tokens[name] = k, v, n

    def _see(self, module: torch.nn.Module, key: Any, value: Any, mask: Any) -> None:
        if id(module) not in self.module_names:
            return  # another model's attention
        if mask is not self._mask:  # layers share one mask per forward: derived once
            self._mask, self._valid = mask, _real_positions(mask, key)
        self.record(module, key, value, self._valid)

    def __enter__(self) -> KVRecorder:
        _activate(self)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        _deactivate(self)
        self._mask = self._valid = None

    def check_recorded(self, purpose: str) -> None:
        """Raise unless layers were recorded, with real positions and finite maxima."""
        if not self.k:
            raise CalibrationError(
                "no attention layer reported its keys/values: run the model's forward "
                "inside the recording context; if it did run, this model's attention does "
                "not call transformers' attention interface (custom or remote-code "
                f"attention) and kvscale cannot {purpose}"
            )
        empty = [n for n, t in self.tokens.items() if int(t) == 0]
        if empty:
            raise CalibrationError(
                f"every position was padding (attention_mask all 0) in {', '.join(empty)}: "
                f"no real token recorded; cannot {purpose}"
            )
        bad = [
            n
            for n in self.k
            if not (torch.isfinite(self.k[n]).all() and torch.isfinite(self.v[n]).all())
        ]
        if bad:
            raise CalibrationError(
                f"non-finite keys/values (NaN or inf) in {', '.join(sorted(bad))}: the model "
                f"overflows in its dtype on this text; cannot {purpose}"
            )


_ACTIVE: list[KVRecorder] = []
_LOCK = threading.Lock()
_ORIGINAL_GET_INTERFACE: Callable[..., Callable[..., Any]] | None = None


@functools.cache
def _recording(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an attention function), telling the active recorders what it receives."""

    @functools.wraps(fn)
    def attention(
        module: torch.nn.Module, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
    ) -> Any:
        # transformers calls the attention function with the keys *after* rotary
        # embedding (and after a k-norm where the model has one), and with the values, in
        # the [batch, kv_heads, seq, head_dim] layout before any repeat for GQA: exactly
        # what a KV cache stores. Hooks on k_proj / v_proj outputs would see keys *before*
        # rotary (rotary mixes pairs of elements, so the maxima differ, by up to sqrt(2))
        # and before any k-norm (Qwen3 normalizes K per head).
        mask = args[0] if args else kwargs.get("attention_mask")
        for recorder in tuple(_ACTIVE):
            recorder._see(module, key, value, mask)
        return fn(module, query, key, value, *args, **kwargs)

    return attention


def _get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
    original = _ORIGINAL_GET_INTERFACE or _stock_get_interface()
    return _recording(original(self, attn_implementation, default))


def _stock_get_interface() -> Callable[..., Any]:
    from transformers.modeling_utils import AttentionInterface

    return AttentionInterface.get_interface


def _activate(recorder: KVRecorder) -> None:
    # Every transformers attention layer asks ``AttentionInterface.get_interface`` for its
    # attention function on each forward (``eager`` included, as the default): wrapped
    # while a recorder is active, the stock method otherwise.
    global _ORIGINAL_GET_INTERFACE
    from transformers.modeling_utils import AttentionInterface

    with _LOCK:
        if not _ACTIVE:
            _ORIGINAL_GET_INTERFACE = AttentionInterface.get_interface
            AttentionInterface.get_interface = _get_interface  # type: ignore[method-assign]
        _ACTIVE.append(recorder)


def _deactivate(recorder: KVRecorder) -> None:
    global _ORIGINAL_GET_INTERFACE
    from transformers.modeling_utils import AttentionInterface

    with _LOCK:
        _ACTIVE.remove(recorder)
        if not _ACTIVE and _ORIGINAL_GET_INTERFACE is not None:
            AttentionInterface.get_interface = _ORIGINAL_GET_INTERFACE  # type: ignore[method-assign]
            _ORIGINAL_GET_INTERFACE = None


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
    """(model, tokenizer), with ``ATTN_IMPLEMENTATION``, in eval mode.

    ``dtype="auto"``: the dtype of the stored weights (see ``weights_dtype``).
    """
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

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
    observer: KVRecorder | None = None,
    purpose: str = "calibrate",
) -> Observed:
    """Run ``texts`` one at a time (no padding, no KV cache) and record K/V abs maxima.

    ``observer``: a recorder of this model that records more (``check``'s saturation
    counts); ``purpose`` names the command in progress and errors."""
    from tqdm import tqdm

    observer = observer if observer is not None else KVRecorder(model)
    device = next(model.parameters()).device
    per_sample: list[tuple[int, float]] = []
    t_all = time.perf_counter()
    with observer:
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
    observer.check_recorded(purpose)
    return Observed(
        k_amax={n: t.cpu() for n, t in observer.k.items()},
        v_amax={n: t.cpu() for n, t in observer.v.items()},
        num_samples=len(per_sample),
        num_tokens=sum(t for t, _ in per_sample),
        seconds=time.perf_counter() - t_all,
        per_sample=per_sample,
    )
