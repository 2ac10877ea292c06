"""``kvscale calibrate``: FP8 KV-cache scales for a checkpoint that has none.

Runs the model with transformers on calibration text and records, per attention layer
(and per KV head for ``--scheme attn_head``), the absolute maximum of exactly what the
KV cache stores: the keys after rotary embedding (and after any k-norm, e.g. Qwen3's),
and the values. The scale is ``amax / 448`` (448 = the largest FP8 e4m3 value), so the
largest observed element maps to the edge of the FP8 range; a scale is never below
``SCALE_FLOOR`` (a layer whose K or V is all zeros would otherwise get 0, which engines
reject as corrupt).

The result is a new checkpoint directory that compressed-tensors-aware engines
understand: the original weights (hard-linked, or copied across file systems),
``quantization_config.kv_cache_scheme`` added to an existing compressed-tensors config
(weight schemes kept) or a minimal new one written the way llm-compressor writes a
KV-cache-only config, and float32 scale tensors ``<attention module>.k_scale`` /
``.v_scale`` (shape ``[1]`` for ``tensor``, ``[num_kv_heads, 1, 1]`` for ``attn_head``).
The model directory is never modified.

Calibration text: a built-in corpus of English prose (``data/calibration_corpus.jsonl``:
prose of the Python documentation, PSF License; see ``calibration_corpus.LICENSE.txt``
next to it), or ``--samples FILE``: a ``.jsonl`` file (one JSON object with a ``"text"``
field, or a JSON string, per line) or a plain text file (split at blank lines; consecutive
paragraphs are packed into samples of about ``--max-len`` tokens).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

#: Largest finite FP8 e4m3 value: a scale of amax / 448 maps amax to the edge of the range.
FP8_E4M3_MAX = 448.0
#: Smallest scale ever written. A dead layer (K or V all zeros) would get amax / 448 = 0,
#: which every engine rejects (division by zero -> NaN cache). This is the value that
#: compressed-tensors' own ``calculate_qparams`` puts in place of a zero float32 scale
#: (``torch.finfo(torch.float32).eps``, ~1.19e-7).
SCALE_FLOOR = float(torch.finfo(torch.float32).eps)
SCHEMES = ("tensor", "attn_head")
#: Name of the observing attention function registered with transformers.
ATTN_IMPLEMENTATION = "kvscale_kv_observer"
DATA_DIR = Path(__file__).parent / "data"
CORPUS_FILE = DATA_DIR / "calibration_corpus.jsonl"
#: Written into OUT_DIR: how the scales were obtained (samples, tokens, per-layer maxima).
CALIBRATION_RECORD = "kvscale_calibration.json"
#: Shard that receives the scale tensors of a sharded checkpoint.
SCALES_SHARD = "model-kvscale-kv-scales.safetensors"


class CalibrationError(Exception):
    """Unusable input or output (the message says what to do); the CLI exits with 2."""


# --------------------------------------------------------------------------- samples


def builtin_corpus(split: str = "calibration") -> list[str]:
    """Texts of the built-in corpus: ``"calibration"``, ``"heldout"`` or ``"all"``."""
    if split not in ("calibration", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    texts = []
    with open(CORPUS_FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if split == "all" or row["split"] == split:
                texts.append(row["text"])
    return texts


def read_samples(path: str | os.PathLike[str], max_len: int = 512) -> list[str]:
    """Calibration texts from a ``.jsonl`` file or a plain text file (see module doc)."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{p}: cannot read samples: {exc}") from exc
    texts: list[str] = []
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{p}:{n}: not valid JSON ({exc})") from exc
            text = row.get("text") if isinstance(row, dict) else row
            if not isinstance(text, str):
                raise CalibrationError(
                    f'{p}:{n}: expected a JSON string or an object with a "text" string'
                )
            if text.strip():
                texts.append(text)
    else:
        # ~4 characters per token for English: pack paragraphs up to about max_len tokens.
        budget = 4 * max_len
        current: list[str] = []
        for para in re.split(r"\n\s*\n", raw):
            para = " ".join(para.split())
            if not para:
                continue
            current.append(para)
            if sum(len(x) + 1 for x in current) >= budget:
                texts.append("\n\n".join(current))
                current = []
        if current:
            texts.append("\n\n".join(current))
    if not texts:
        raise CalibrationError(f"{p}: no calibration text found")
    return texts


# --------------------------------------------------------------------------- observing


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
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")


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
) -> Observed:
    """Run ``texts`` one at a time (no padding, no KV cache) and record K/V abs maxima."""
    from tqdm import tqdm

    names = {id(m): n for n, m in model.named_modules()}
    observer = _Observer(names)
    device = next(model.parameters()).device
    per_sample: list[tuple[int, float]] = []
    t_all = time.perf_counter()
    _ACTIVE.append(observer)
    try:
        bar = tqdm(
            texts,
            desc="calibrating",
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
            "overflows in its dtype on this text; cannot calibrate"
        )
    return Observed(
        k_amax=observer.k,
        v_amax=observer.v,
        num_samples=len(per_sample),
        num_tokens=sum(t for t, _ in per_sample),
        seconds=time.perf_counter() - t_all,
        per_sample=per_sample,
    )


# --------------------------------------------------------------------------- scales


def scale_from_amax(amax: torch.Tensor, scheme: str) -> torch.Tensor:
    """float32 scale tensor: ``[1]`` (max over heads) for ``tensor``, ``[H, 1, 1]`` per head."""
    amax = amax.detach().float().reshape(-1)
    if scheme == "tensor":
        return (amax.max() / FP8_E4M3_MAX).clamp(min=SCALE_FLOOR).reshape(1)
    if scheme == "attn_head":
        return (amax / FP8_E4M3_MAX).clamp(min=SCALE_FLOOR).reshape(-1, 1, 1)
    raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def scales_from_observed(
    obs: Observed, scheme: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """attention module name -> (k_scale, v_scale) tensors."""
    return {
        name: (scale_from_amax(obs.k_amax[name], scheme), scale_from_amax(obs.v_amax[name], scheme))
        for name in _sorted_modules(obs.k_amax)
    }


def _layer_number(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else -1


def _sorted_modules(names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda n: (_layer_number(n), n))


def kv_cache_scheme(scheme: str) -> dict[str, Any]:
    """The ``kv_cache_scheme`` llm-compressor writes for a static FP8 KV cache."""
    from kvscale_plugin.scheme import FP8_KV_SCHEME

    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    return {**FP8_KV_SCHEME, "strategy": scheme}


def quantization_config_with_kv(config: Mapping[str, Any], scheme: str) -> dict[str, Any]:
    """``quantization_config`` for OUT_DIR: the existing compressed-tensors one with the
    KV scheme set (weight schemes kept), or a minimal KV-cache-only one."""
    qc = config.get("quantization_config")
    if qc is None:
        return {
            "config_groups": {},
            "format": "dense",
            "global_compression_ratio": None,
            "ignore": [],
            "kv_cache_scheme": kv_cache_scheme(scheme),
            "quant_method": "compressed-tensors",
            "quantization_status": "compressed",
        }
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "compressed-tensors":
        method = qc.get("quant_method") if isinstance(qc, Mapping) else type(qc).__name__
        raise CalibrationError(
            f"the checkpoint's quantization_config is '{method}', not compressed-tensors: "
            "a kv_cache_scheme can only be added to a compressed-tensors config (or to a "
            "checkpoint without quantization_config)"
        )
    return {**qc, "kv_cache_scheme": kv_cache_scheme(scheme)}


# --------------------------------------------------------------------------- writing


def _is_old_kv_scale(name: str) -> bool:
    """A tensor the engines would load as a k/v cache scale or zero point (dropped from
    OUT_DIR so that the new scales are the only ones). q scales are kept."""
    from kvscale_plugin.names import map_scale_name

    target = map_scale_name(name, "vllm")
    return bool(target and re.search(r"\.attn\.[kv]_(?:scale|zero_point)$", target))


def _link_or_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)  # follows symlinks (Hugging Face cache snapshots)
    except OSError:
        shutil.copy2(src, dst)


def _check_paths(src: Path, dst: Path, force: bool) -> None:
    if not (src / "config.json").is_file():
        raise CalibrationError(f"{src}: not a checkpoint directory (no config.json)")
    if dst == src or src.is_relative_to(dst) or dst.is_relative_to(src):
        raise CalibrationError(
            f"--out {dst} must be a directory outside {src} (the model directory is never modified)"
        )
    if dst.exists() and not force:
        raise CalibrationError(f"{dst} already exists; pass --force to replace it")
    if dst.exists() and not dst.is_dir():
        raise CalibrationError(f"{dst} exists and is not a directory")


def _default_scale_name(module: str, kind: str) -> str:
    return f"{module}.{kind}_scale"


def write_checkpoint(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scheme: str,
    *,
    force: bool = False,
    record: Mapping[str, Any] | None = None,
    scale_name: Callable[[str, str], str] = _default_scale_name,
) -> Path:
    """Write OUT_DIR = MODEL_DIR's files + KV scheme + scale tensors (see module doc).

    ``scales`` maps attention module names (``model.layers.N.self_attn``) to float32
    (k_scale, v_scale) tensors, stored as ``scale_name(module, "k" | "v")`` (default
    ``<module>.k_scale``). Existing k/v scale tensors of MODEL_DIR (any naming the
    engines load) are left out of OUT_DIR. Built in a temporary sibling directory and
    renamed into place, so an interrupted run leaves no half-written OUT_DIR.
    """
    from safetensors import safe_open
    from safetensors.torch import save_file

    from kvscale_plugin.checkpoint import (
        CONFIG_NAME,
        INDEX_NAME,
        CheckpointError,
        checkpoint_files,
        read_config,
        read_safetensors_header,
    )

    src, dst = Path(model_dir).resolve(), Path(out_dir).resolve()
    _check_paths(src, dst, force)
    for name, (k, v) in scales.items():
        for kind, t in (("k", k), ("v", v)):
            if t.dtype != torch.float32 or not torch.isfinite(t).all() or not (t > 0).all():
                raise CalibrationError(f"{name}.{kind}_scale: not a positive finite float32")
    try:
        config = read_config(src)
        files, sharded = checkpoint_files(src)
    except CheckpointError as exc:
        raise CalibrationError(str(exc)) from exc
    new_qc = quantization_config_with_kv(config, scheme)
    new_tensors = {
        scale_name(name, kind): t.contiguous()
        for name, (k, v) in scales.items()
        for kind, t in (("k", k), ("v", v))
    }
    has_index = (src / INDEX_NAME).is_file()
    weight_files = {f.resolve() for f in files}

    tmp = dst.parent / f".{dst.name}.kvscale-tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        dropped: dict[str, int] = {}  # old scale tensor -> bytes
        for path in sorted(src.rglob("*")):
            rel = path.relative_to(src)
            if path.is_dir() or rel.as_posix() in (CONFIG_NAME, INDEX_NAME, CALIBRATION_RECORD):
                continue
            target = tmp / rel
            if path.resolve() not in weight_files:
                _link_or_copy(path, target)
                continue
            header, _ = read_safetensors_header(path)
            old = [n for n in header if _is_old_kv_scale(n)]
            single = not sharded and not has_index
            if not old and not single:
                _link_or_copy(path, target)  # weights untouched: a link, no copy
                continue
            # Rewritten: without old KV scales, and (single-file) with the new ones.
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {"format": "pt"}
                tensors = {n: f.get_tensor(n) for n in f.keys() if n not in old}
            for n in old:
                dropped[n] = header[n].nbytes
            if single:
                tensors.update(new_tensors)
            save_file(tensors, str(target), metadata=meta)
            shutil.copymode(path, target)
        if sharded or has_index:
            save_file(new_tensors, str(tmp / SCALES_SHARD), metadata={"format": "pt"})
            index = (
                json.loads((src / INDEX_NAME).read_text())
                if has_index
                else {
                    "metadata": {},
                    "weight_map": {n: f.name for f in files for n in read_safetensors_header(f)[0]},
                }
            )
            wm = {n: f for n, f in index["weight_map"].items() if n not in dropped}
            wm.update(dict.fromkeys(new_tensors, SCALES_SHARD))
            meta = dict(index.get("metadata") or {})
            if isinstance(meta.get("total_size"), int):
                meta["total_size"] += sum(
                    t.numel() * t.element_size() for t in new_tensors.values()
                ) - sum(dropped.values())
            (tmp / INDEX_NAME).write_text(
                json.dumps({**index, "metadata": meta, "weight_map": wm}, indent=2) + "\n"
            )
        new_config = {**config, "quantization_config": new_qc}
        (tmp / CONFIG_NAME).write_text(json.dumps(new_config, indent=2) + "\n")
        (tmp / CALIBRATION_RECORD).write_text(
            json.dumps(
                {
                    **(record or {}),
                    "scheme": scheme,
                    "dropped_tensors": sorted(dropped),
                    "scale_floor": SCALE_FLOOR,
                    "fp8_max": FP8_E4M3_MAX,
                },
                indent=2,
            )
            + "\n"
        )
        if dst.exists():
            shutil.rmtree(dst)  # --force (checked above); hard links only lose a name
        tmp.rename(dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def read_scales(model_dir: str | os.PathLike[str]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The ``<module>.k_scale`` / ``.v_scale`` tensors of a checkpoint, per module."""
    from kvscale_plugin.checkpoint import open_checkpoint

    ckpt = open_checkpoint(model_dir)
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, info in ckpt.tensors.items():
        if name.endswith(".k_scale") and (v := ckpt.tensors.get(name[:-7] + "v_scale")):
            out[name[: -len(".k_scale")]] = (
                ckpt.read_tensor(info).clone(),
                ckpt.read_tensor(v).clone(),
            )
    return {n: out[n] for n in _sorted_modules(out)}


# --------------------------------------------------------------------------- report


def render_summary(
    obs: Observed, scales: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scheme: str
) -> str:
    """Per-layer table: K/V abs maxima and the scales written (per-head: min..max)."""

    def fmt(t: torch.Tensor) -> str:
        t = t.reshape(-1)
        if t.numel() == 1:
            return f"{float(t[0]):.4g}"
        return f"{float(t.min()):.4g}..{float(t.max()):.4g}"

    head = f"{'layer':<32}{'K amax':>10}{'V amax':>10}  {'k_scale':<20}{'v_scale':<20}"
    lines = [head, "-" * len(head)]
    for name in _sorted_modules(scales):
        k, v = scales[name]
        lines.append(
            f"{name:<32}{float(obs.k_amax[name].max()):>10.4g}"
            f"{float(obs.v_amax[name].max()):>10.4g}  {fmt(k):<20}{fmt(v):<20}"
        )
    k_all = torch.stack([obs.k_amax[n].max() for n in scales])
    v_all = torch.stack([obs.v_amax[n].max() for n in scales])
    lines.append(
        f"K amax {float(k_all.min()):.4g}..{float(k_all.max()):.4g}, "
        f"V amax {float(v_all.min()):.4g}..{float(v_all.max()):.4g} over "
        f"{len(scales)} layers (FP8 e4m3 max is {FP8_E4M3_MAX:g}; scheme {scheme})."
    )
    return "\n".join(lines)


@dataclass
class CalibrationResult:
    out_dir: Path
    observed: Observed
    scales: dict[str, tuple[torch.Tensor, torch.Tensor]]


def calibrate(
    model_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    scheme: str = "tensor",
    texts: Sequence[str] | None = None,
    samples_source: str = "built-in corpus (calibration split)",
    num_samples: int | None = 32,
    max_len: int = 512,
    device: str = "cpu",
    dtype: str = "auto",
    force: bool = False,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> CalibrationResult:
    """Observe K/V on ``texts`` (default: the built-in corpus) and write OUT_DIR."""
    if scheme not in SCHEMES:
        raise CalibrationError(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")
    src, dst = Path(model_dir).resolve(), Path(out_dir).resolve()
    _check_paths(src, dst, force)  # before the (slow) model run
    if texts is None:
        texts = builtin_corpus("calibration")
    texts = list(texts)[:num_samples] if num_samples else list(texts)
    if not texts:
        raise CalibrationError("no calibration samples")
    model, tokenizer = load_model(src, device, dtype)
    if log:
        log(f"loaded {src} on {device} in {next(model.parameters()).dtype}")
    if log:
        log(f"{len(texts)} samples from {samples_source}, up to {max_len} tokens each")
    obs = observe(model, tokenizer, texts, max_len=max_len, progress=progress)
    scales = scales_from_observed(obs, scheme)
    record = {
        "samples": samples_source,
        "num_samples": obs.num_samples,
        "num_tokens": obs.num_tokens,
        "max_len": max_len,
        "seconds": round(obs.seconds, 3),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "k_amax": {n: obs.k_amax[n].tolist() for n in scales},
        "v_amax": {n: obs.v_amax[n].tolist() for n in scales},
    }
    del model
    out = write_checkpoint(src, dst, scales, scheme, force=force, record=record)
    return CalibrationResult(out, obs, scales)


def add_arguments(parser: Any) -> None:
    parser.add_argument("model_dir", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, type=Path, help="new checkpoint directory")
    parser.add_argument(
        "--scheme",
        choices=SCHEMES,
        default="tensor",
        help="one scale per layer (tensor, default) or per KV head (attn_head)",
    )
    parser.add_argument(
        "--samples",
        type=Path,
        default=None,
        help='calibration text: .jsonl ("text" per line) or a text file '
        "(default: the built-in English corpus)",
    )
    parser.add_argument(
        "--num-samples", type=int, default=32, help="use at most N samples (default 32; 0 = all)"
    )
    parser.add_argument(
        "--max-len", type=int, default=512, help="truncate each sample to L tokens (default 512)"
    )
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--dtype",
        choices=DTYPE_CHOICES,
        default="auto",
        help="compute dtype (default auto: the dtype of the stored weights; "
        "use the dtype you serve with)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing --out")


def run(args: Any, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=out, flush=True)

    try:
        if args.max_len < 1 or args.num_samples < 0:
            raise CalibrationError("--max-len must be >= 1 and --num-samples >= 0")
        if args.samples is not None:
            texts: list[str] | None = read_samples(args.samples, args.max_len)
            source = str(args.samples)
        else:
            texts, source = None, "built-in corpus (calibration split)"
        result = calibrate(
            args.model_dir,
            args.out,
            scheme=args.scheme,
            texts=texts,
            samples_source=source,
            num_samples=args.num_samples,
            max_len=args.max_len,
            device=args.device,
            dtype=args.dtype,
            force=args.force,
            log=log,
        )
    except CalibrationError as exc:
        print(f"kvscale calibrate: {exc}", file=sys.stderr)
        return 2
    obs = result.observed
    print("", file=out)
    print(render_summary(obs, result.scales, args.scheme), file=out)
    per = obs.seconds / max(obs.num_samples, 1)
    print(
        f"\n{obs.num_samples} samples, {obs.num_tokens} tokens, {obs.seconds:.1f} s "
        f"({per:.2f} s per sample)",
        file=out,
    )
    from kvscale_plugin.inspection import inspect_checkpoint

    report = inspect_checkpoint(result.out_dir)
    verdict = "clean" if report.exit_status == 0 else "PROBLEMS (run kvscale inspect)"
    print(f"wrote {result.out_dir} (kvscale inspect: {verdict})", file=out)
    log("done")
    return 0
