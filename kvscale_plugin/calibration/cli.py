"""``kvscale calibrate`` on the command line: its arguments, the run and the summary.

Imports no torch (``kvscale --help`` builds this parser): the model run is imported
when the command runs.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from kvscale_plugin.calibration.common import (
    DTYPE_CHOICES,
    SCHEMES,
    CalibrationError,
    sorted_modules,
)
from kvscale_plugin.calibration.corpus import read_samples
from kvscale_plugin.fp8 import FP8_E4M3_MAX

if TYPE_CHECKING:
    import torch

    from kvscale_plugin.calibration.observer import Observed

#: The subcommand's ``--help`` description.
DESCRIPTION = (
    "Run MODEL_DIR with transformers on calibration text, record per "
    "attention layer (and per KV head for --scheme attn_head) the abs max of the keys "
    "after rotary embedding and of the values -- exactly what the KV cache stores -- and "
    "write OUT_DIR: MODEL_DIR's weights (hard-linked or copied), a compressed-tensors "
    f"kv_cache_scheme and self_attn.k_scale / v_scale = amax / {FP8_E4M3_MAX:g}. MODEL_DIR "
    "is never modified. Exit status: 0 written, 2 unusable input or existing OUT_DIR."
)


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
    for name in sorted_modules(scales):
        k, v = scales[name]
        lines.append(
            f"{name:<32}{float(obs.k_amax[name].max()):>10.4g}"
            f"{float(obs.v_amax[name].max()):>10.4g}  {fmt(k):<20}{fmt(v):<20}"
        )
    k_all = [float(obs.k_amax[n].max()) for n in scales]
    v_all = [float(obs.v_amax[n].max()) for n in scales]
    lines.append(
        f"K amax {min(k_all):.4g}..{max(k_all):.4g}, "
        f"V amax {min(v_all):.4g}..{max(v_all):.4g} over "
        f"{len(scales)} layers (FP8 e4m3 max is {FP8_E4M3_MAX:g}; scheme {scheme})."
    )
    return "\n".join(lines)


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
        from kvscale_plugin.calibration.pipeline import calibrate

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
