"""``calibrate``: observe K/V on calibration text and write OUT_DIR, in one call."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from kvscale_plugin.calibration.common import CalibrationError, check_scheme
from kvscale_plugin.calibration.corpus import pick_texts
from kvscale_plugin.calibration.maths import reads_other_cache, scales_from_observed
from kvscale_plugin.calibration.observer import Observed, load_model, observe
from kvscale_plugin.calibration.write import check_paths, write_checkpoint


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
    check_scheme(scheme, CalibrationError)
    src, dst = Path(model_dir).resolve(), Path(out_dir).resolve()
    check_paths(src, dst, force)  # before the (slow) model run
    texts = pick_texts(texts, num_samples, "calibrate")
    model, tokenizer = load_model(src, device, dtype)
    if log:
        log(f"loaded {src} on {device} in {next(model.parameters()).dtype}")
    if log:
        log(f"{len(texts)} samples from {samples_source}, up to {max_len} tokens each")
    obs = observe(model, tokenizer, texts, max_len=max_len, progress=progress)
    scales = scales_from_observed(obs, scheme)
    shared = reads_other_cache(json.loads((src / "config.json").read_text()), scales)
    for name in shared:
        del scales[name]  # they serve their target's scales: never a second, other one
    if log and shared:
        log(f"no scales for {len(shared)} layer(s) that read another layer's KV cache")
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
