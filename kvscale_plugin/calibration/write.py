"""Writing OUT_DIR, a checkpoint compressed-tensors-aware engines understand.

The original weights (hard-linked, or copied across file systems),
``quantization_config.kv_cache_scheme`` added to an existing compressed-tensors config
(weight schemes kept) or a minimal new one written the way llm-compressor writes a
KV-cache-only config, and float32 scale tensors ``<attention module>.k_scale`` /
``.v_scale``. Existing k/v scales of MODEL_DIR are left out. The model directory is
never modified.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from kvscale_plugin.calibration.common import (
    CALIBRATION_RECORD,
    SCALES_SHARD,
    CalibrationError,
    check_scheme,
    sorted_modules,
)
from kvscale_plugin.calibration.maths import SCALE_FLOOR
from kvscale_plugin.fp8 import FP8_E4M3_MAX


def kv_cache_scheme(scheme: str) -> dict[str, Any]:
    """The ``kv_cache_scheme`` llm-compressor writes for a static FP8 KV cache."""
    from kvscale_plugin.scheme import FP8_KV_SCHEME

    check_scheme(scheme)
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


def check_paths(src: Path, dst: Path, force: bool) -> None:
    """Refuse a MODEL_DIR without config.json, an OUT_DIR inside it (or around it), and an
    existing OUT_DIR without ``force``."""
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
    check_paths(src, dst, force)
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
    return {n: out[n] for n in sorted_modules(out)}
