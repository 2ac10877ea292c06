"""``kvscale calibrate`` on the command line: its arguments, the run and the summary.

Imports no torch (``kvscale --help`` builds this parser): the model run is imported
when the command runs.
"""

from __future__ import annotations

import json
import math
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

    from kvscale_plugin.calibration.check import CheckResult, KindResult
    from kvscale_plugin.calibration.observer import Observed

#: The subcommand's ``--help`` description.
DESCRIPTION = (
    "Run MODEL_DIR with transformers on calibration text, record per "
    "attention layer (and per KV head for --scheme attn_head) the abs max of the keys "
    "after rotary embedding and of the values -- exactly what the KV cache stores -- and "
    "write OUT_DIR: MODEL_DIR's weights (hard-linked or copied), a compressed-tensors "
    f"kv_cache_scheme and self_attn.k_scale / v_scale = amax / {FP8_E4M3_MAX:g}. MODEL_DIR "
    "is never modified. Exit status: 0 written, 2 unusable input or existing OUT_DIR. "
    "With --check instead of --out: write nothing, run MODEL_DIR on the text and report per "
    "layer (and per KV head) how its own k/v scales fit it: amax, amax / 448, the scale, "
    "their ratio and the fraction of K and V elements that saturate the FP8 cache. Exit "
    "status with --check: 0 nothing saturates, 1 something saturates, 2 unusable input "
    "(no k/v scales, scales kvscale refuses)."
)


def add_arguments(parser: Any) -> None:
    parser.add_argument("model_dir", help="checkpoint directory (config.json + safetensors)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        metavar="OUT_DIR",
        help="new checkpoint directory (required without --check)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="write nothing: report how the checkpoint's own k/v scales fit the text (per "
        "layer and KV head: amax, amax/448, scale, ratio, saturated fraction); exit status "
        "0 nothing saturates, 1 something saturates, 2 unusable input",
    )
    parser.add_argument("--json", action="store_true", help="with --check: machine-readable output")
    parser.add_argument(
        "--scheme",
        choices=SCHEMES,
        default="tensor",
        help="one scale per layer (tensor, default) or per KV head (attn_head); --check "
        "uses the checkpoint's own",
    )
    parser.add_argument(
        "--samples",
        "--data",
        type=Path,
        action="append",
        default=None,
        metavar="FILE",
        help='calibration text: a .jsonl ("text" per line) or a text file; repeat for more '
        "files (default: the built-in English corpus)",
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


def _texts(samples: list[Path] | Path | None, max_len: int) -> tuple[list[str] | None, str]:
    """The texts of ``--samples`` / ``--data`` files (None: the built-in corpus) and a
    description of where they come from."""
    if samples is None:
        return None, "built-in corpus (calibration split)"
    files = [samples] if isinstance(samples, Path) else list(samples)
    texts = [t for f in files for t in read_samples(f, max_len)]
    return texts, ", ".join(str(f) for f in files)


def run(args: Any, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=out, flush=True)

    check = bool(getattr(args, "check", False))
    try:
        if args.max_len < 1 or args.num_samples < 0:
            raise CalibrationError("--max-len must be >= 1 and --num-samples >= 0")
        if check and args.out is not None:
            raise CalibrationError(
                "--check writes nothing: drop --out (or drop --check to write OUT_DIR)"
            )
        if not check and args.out is None:
            raise CalibrationError("--out OUT_DIR is required (or --check to write nothing)")
        if not check and getattr(args, "json", False):
            raise CalibrationError("--json is an option of --check")
        texts, source = _texts(args.samples, args.max_len)
    except CalibrationError as exc:
        prefix = "kvscale calibrate --check" if check else "kvscale calibrate"
        print(f"{prefix}: {exc}", file=sys.stderr)
        return 2
    if check:
        return run_check(args, texts, source, out)
    try:
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


def render_check(result: CheckResult) -> str:
    """``--check`` as text: a row per layer (and per KV head for per-head scales), then
    the summary, the command that writes fitting scales, and the exit status."""
    from kvscale_plugin.calibration.check import ratio_of, summary_line

    def g(x: float) -> str:
        return "inf" if math.isinf(x) else f"{x:.4g}"

    def cells(r: KindResult, h: int | None) -> str:
        if h is None:
            a, s, ratio, frac = r.layer_amax, r.layer_scale, r.ratio, r.fraction
        else:
            a, s = r.amax[h], r.scale[h]
            ratio = ratio_of(s, a)
            frac = r.saturated[h] / r.elements if r.elements else 0.0
        return f"{g(a):>10}{g(a / FP8_E4M3_MAX):>10}{g(s):>10}{g(ratio):>8}{frac:>9.3%}"

    head = (
        f"{'layer':<34}{'':>2}{'K amax':>10}{'/448':>10}{'k_scale':>10}{'ratio':>8}{'K sat':>9}"
        f"{'V amax':>10}{'/448':>10}{'v_scale':>10}{'ratio':>8}{'V sat':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in result.layers:
        note = "" if r.source == "checkpoint" else f" [{r.source}]"
        mark = "!" if r.clips else ""
        lines.append(f"{(r.layer + note):<34}{mark:>2}{cells(r.k, None)}{cells(r.v, None)}")
        if r.k.per_head:
            for h in range(len(r.k.amax)):
                hm = "!" if r.k.saturated[h] or r.v.saturated[h] else ""
                lines.append(f"{f'  head {h}':<34}{hm:>2}{cells(r.k, h)}{cells(r.v, h)}")
    lines += [
        "",
        f"ratio = checkpoint scale / (amax / {FP8_E4M3_MAX:g}), the smallest over heads (< 1: "
        f"the scale is too small for this text); sat = elements with |x / scale| > "
        f"{FP8_E4M3_MAX:g} (beyond one float32 step), clamped by the FP8 cache write",
        f"{result.num_samples} samples ({result.samples}), {result.num_tokens} tokens, "
        f"{result.dtype}, {result.seconds:.1f} s; scheme {result.scheme}",
    ]
    if result.unscaled_layers:
        lines.append(f"not checked (no scales): {', '.join(result.unscaled_layers)}")
    if result.inspect_problems:
        lines.append(
            f"kvscale inspect reports {len(result.inspect_problems)} problem(s): run "
            f"kvscale inspect {result.model_dir}"
        )
    lines.append(summary_line(result))
    if result.clipping:
        lines.append(f"scales that fit this text: {result.fix_command()} (--check writes nothing)")
    lines.append(f"exit status {result.exit_status}")
    return "\n".join(lines) + "\n"


def run_check(args: Any, texts: list[str] | None, source: str, out: TextIO) -> int:
    """``kvscale calibrate --check``: print the report (text or ``--json``), return 0
    (nothing saturates), 1 (something saturates) or 2 (unusable input)."""
    from kvscale_plugin.calibration.check import check, error_json, to_json

    as_json = bool(getattr(args, "json", False))
    log_to = sys.stderr if as_json else out
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=log_to, flush=True)

    try:
        result = check(
            args.model_dir,
            texts=texts,
            samples_source=source,
            sample_files=[str(f) for f in args.samples or ()],
            num_samples=args.num_samples,
            max_len=args.max_len,
            device=args.device,
            dtype=args.dtype,
            log=log,
        )
    except CalibrationError as exc:
        print(f"kvscale calibrate --check: {exc}", file=sys.stderr)
        if as_json:
            print(json.dumps(error_json(str(args.model_dir), exc), indent=2), file=out)
        return 2
    if as_json:
        print(json.dumps(to_json(result), indent=2), file=out)
    else:
        print("", file=out)
        out.write(render_check(result))
    return result.exit_status
