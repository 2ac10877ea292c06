"""Quality of the FP8 KV cache on vLLM's CPU build: stock vLLM (round-toward-zero write)
vs kvscale (round-to-nearest-even write), at scale 1.0 and with calibrated scales, side by
side in one run.

    python benchmarks/cpu_write_quality.py                  # SmolLM2-135M (converted once)
    python benchmarks/cpu_write_quality.py --model DIR      # your checkpoint
    python benchmarks/cpu_write_quality.py --tiny           # the tiny boosted test model

Metric: teacher-forced logprob of every token of real English text (the held-out split
of kvscale's built-in corpus; Python documentation prose, PSF License) given its prefix,
compared with a bf16-cache run of the same model: mean and max |delta logprob|, and
perplexity. Rows:

    bf16 cache            the reference (no FP8 anywhere)
    stock FP8             vLLM 0.32 on the compressed-tensors checkpoint, FP8 cache, its
                          own CPU cache write (rounds toward zero)
    kvscale FP8           --quantization kvscale: same scales, same attention, the cache
                          written with round-to-nearest-even
    kvscale, vLLM write   kvscale with KVSCALE_CPU_FP8_WRITE=vllm (must equal stock)

for two checkpoints derived from the model: every k/v scale 1.0, and calibrated scales
(amax / 448 from ``kvscale calibrate`` on the corpus' calibration split; a model that
declares its own scales, e.g. an llm-compressor checkpoint, is served with them). The
derived checkpoints are written once under --work-dir (hard links to the weights).

A second table shows the tail, not only the mean: percentiles of |delta logprob|, how
many tokens move by more than 0.5 / 1 / 2 nats, and each engine's worst token with the
other engine's delta at the same position (round-to-nearest can lose more than
truncation on a single token while its whole distribution is thinner).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

from kvscale_plugin.demo.quality import TeacherForced, compare, teacher_forced  # noqa: E402

ENV_VAR = "KVSCALE_CPU_FP8_WRITE"
KV_CACHE_BYTES = 256 * 2**20


# Checkpoints ----------------------------------------------------------------------


def default_model(tiny: bool, work_dir: Path) -> Path:
    """SmolLM2 through ``kvscale_plugin.demo.realmodel`` when available, else the tiny model."""
    if not tiny:
        try:
            from kvscale_plugin.demo.realmodel import smollm2_checkpoint
        except ImportError:
            print("# kvscale_plugin.demo.realmodel not available: using the tiny boosted model")
        else:
            return smollm2_checkpoint(log=lambda m: print(f"# {m}"))
    from kvscale_plugin.demo.tinymodels import TinySpec, build_tiny_checkpoint

    out = work_dir / "models" / "tiny-calibrated"
    if not (out / "config.json").exists():
        build_tiny_checkpoint(out, TinySpec(num_layers=3), cache_dir=work_dir)
    return out


def _kv_scheme(model_dir: Path) -> dict[str, Any] | None:
    cfg = json.loads((model_dir / "config.json").read_text())
    return (cfg.get("quantization_config") or {}).get("kv_cache_scheme")


def _attention_modules(model_dir: Path) -> list[str]:
    cfg = json.loads((model_dir / "config.json").read_text())
    text_cfg = cfg.get("text_config", cfg)
    return [f"model.layers.{i}.self_attn" for i in range(int(text_cfg["num_hidden_layers"]))]


def prepare_variants(model_dir: Path, work_dir: Path) -> dict[str, Path]:
    """``{"calibrated": DIR, "scale 1.0": DIR}`` derived from ``model_dir`` (cached).

    A model that already declares a kv_cache_scheme is used as the calibrated
    variant as it is; otherwise ``kvscale calibrate`` writes one.
    """
    from kvscale_plugin import calibration as cal

    work_dir.mkdir(parents=True, exist_ok=True)
    calibrated = model_dir
    if _kv_scheme(model_dir) is None:
        calibrated = work_dir / "calibrated"
        if not (calibrated / "config.json").exists():
            print(f"# calibrating {model_dir} -> {calibrated} (built-in corpus, calibration split)")
            cal.calibrate(model_dir, calibrated, progress=False)
    ones = work_dir / "scale-1.0"
    if not (ones / "config.json").exists():
        scales = {
            m: (torch.ones(1, dtype=torch.float32), torch.ones(1, dtype=torch.float32))
            for m in _attention_modules(model_dir)
        }
        cal.write_checkpoint(calibrated, ones, scales, "tensor")
    return {
        "scale 1.0": ones,
        "calibrated" if calibrated != model_dir else "checkpoint": calibrated,
    }


def read_scales(model_dir: Path) -> tuple[float, float]:
    """(min, max) over the checkpoint's k and v scale tensors."""
    from safetensors import safe_open

    values: list[float] = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                if name.endswith((".k_scale", ".v_scale")):
                    values.extend(st.get_tensor(name).float().reshape(-1).tolist())
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


# Text and engines -----------------------------------------------------------------


def eval_token_chunks(model_dir: Path, max_tokens: int, chunk: int) -> list[list[int]]:
    """Held-out corpus text, tokenized, cut into chunks of ``chunk`` tokens."""
    from transformers import AutoTokenizer

    from kvscale_plugin.calibration import builtin_corpus

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids: list[int] = []
    for text in builtin_corpus("heldout"):
        ids.extend(tok(text, add_special_tokens=False)["input_ids"])
        if len(ids) >= max_tokens:
            break
    ids = ids[:max_tokens]
    return [ids[i : i + chunk] for i in range(0, len(ids), chunk) if len(ids[i : i + chunk]) > 1]


def run_engine(
    model_dir: Path,
    chunks,
    *,
    quantization: str | None,
    kv_cache_dtype: str,
    write: str,
    max_model_len: int,
) -> TeacherForced:
    from kvscale_plugin.demo.probe import vllm_engine

    os.environ[ENV_VAR] = write
    try:
        with vllm_engine(
            model_dir,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            max_model_len=max_model_len,
            enable_prefix_caching=False,
        ) as llm:
            return teacher_forced(llm, chunks)
    finally:
        os.environ.pop(ENV_VAR, None)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: SmolLM2)")
    p.add_argument("--tiny", action="store_true", help="use the tiny boosted test model")
    p.add_argument("--tokens", type=int, default=3000, help="evaluated tokens (default 3000)")
    p.add_argument("--chunk", type=int, default=1000, help="tokens per teacher-forced prompt")
    p.add_argument(
        "--work-dir",
        type=Path,
        default=None,
        help="derived checkpoints (default ~/.cache/kvscale-plugin/bench-cpu-write)",
    )
    args = p.parse_args(argv)

    base_work = args.work_dir or Path.home() / ".cache" / "kvscale-plugin" / "bench-cpu-write"
    model = args.model.resolve() if args.model else default_model(args.tiny, base_work)
    variants = prepare_variants(model, base_work / model.name)
    import vllm

    chunks = eval_token_chunks(model, args.tokens, args.chunk)
    n_tokens = sum(len(c) - 1 for c in chunks)
    max_len = max(len(c) for c in chunks) + 8
    print(
        f"# {datetime.date.today()}  vLLM {vllm.__version__}  torch {torch.__version__}  "
        f"model {model}"
    )
    print(f"# {n_tokens} teacher-forced tokens of held-out text in {len(chunks)} prompts")
    t0 = time.perf_counter()
    ref = run_engine(
        model,
        chunks,
        quantization=None,
        kv_cache_dtype="bfloat16",
        write="rne",
        max_model_len=max_len,
    )
    ref_ppl = compare(ref, ref).ppl
    rows = []
    tails: list[tuple[str, dict[str, Any]]] = []
    for label, ckpt in variants.items():
        lo, hi = read_scales(ckpt)
        runs = {
            "stock FP8": dict(quantization=None, write="rne"),
            "kvscale FP8": dict(quantization="kvscale", write="rne"),
            "kvscale, vLLM write": dict(quantization="kvscale", write="vllm"),
        }
        res, raw = {}, {}
        for name, kw in runs.items():
            lp = run_engine(ckpt, chunks, kv_cache_dtype="auto", max_model_len=max_len, **kw)
            res[name] = compare(lp, ref)
            raw[name] = lp
        rows.append((label, lo, hi, res))
        tails.append((label, raw))

    print(f"\nbf16-cache reference perplexity {ref_ppl:.3f}\n")
    head = (
        f"{'scales':<11} {'k/v scale range':<19} {'engine':<21} {'mean|dlp|':>10} "
        f"{'max|dlp|':>9} {'ppl':>8}"
    )
    print(head)
    print("-" * len(head))
    for label, lo, hi, res in rows:
        for name, r in res.items():
            print(
                f"{label:<11} {lo:8.4g} - {hi:<8.4g} {name:<21} {r.mean_abs_dlogprob:10.4f} "
                f"{r.max_abs_dlogprob:9.3f} {r.ppl:8.3f}"
            )
    print()
    ok = True
    for label, _, _, res in rows:
        stock = res["stock FP8"].mean_abs_dlogprob
        ours = res["kvscale FP8"].mean_abs_dlogprob
        gain = 1 - ours / stock if stock else float("nan")
        same = res["kvscale, vLLM write"].mean_abs_dlogprob == stock
        ok &= gain >= 0.25
        print(
            f"{label:<11} kvscale vs stock: {100 * gain:5.1f}% lower mean |dlogprob| "
            f"(goal >= 25%); kvscale with vLLM's write == stock: {same}"
        )
    print_tail(tails, ref, chunks, model)
    print(f"# {time.perf_counter() - t0:.0f} s")
    return 0 if ok else 1


# The tail -------------------------------------------------------------------------

THRESHOLDS = (0.5, 1.0, 2.0)
PERCENTILES = (50.0, 90.0, 99.0, 99.9)


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile, linear between closest ranks (numpy's default)."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def tail_stats(run: Any, reference: Any) -> dict[str, Any]:
    """Percentiles of |delta logprob| and counts above ``THRESHOLDS``."""
    diffs = [abs(a - b) for a, b in zip(run.logprobs, reference.logprobs, strict=True)]
    return {
        "percentiles": {q: percentile(diffs, q) for q in PERCENTILES},
        "above": {t: sum(d > t for d in diffs) for t in THRESHOLDS},
        "diffs": diffs,
    }


def print_tail(tails: list[tuple[str, dict[str, Any]]], ref: Any, chunks, model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model))
    targets = [t for c in chunks for t in c[1:]]  # the token each logprob is for
    cols = " ".join(f"{'p' + format(q, 'g'):>7}" for q in PERCENTILES)
    above = " ".join(f"{'>' + format(t, 'g'):>5}" for t in THRESHOLDS)
    head = f"{'scales':<11} {'engine':<21} {cols} {above}   (|dlogprob| vs bf16 cache)"
    print(head)
    print("-" * len(head))
    for label, raw in tails:
        stats = {name: tail_stats(lp, ref) for name, lp in raw.items()}
        for name, s in stats.items():
            p = " ".join(f"{s['percentiles'][q]:7.3f}" for q in PERCENTILES)
            a = " ".join(f"{s['above'][t]:5d}" for t in THRESHOLDS)
            print(f"{label:<11} {name:<21} {p} {a}")
        ours, stock = stats["kvscale FP8"]["diffs"], stats["stock FP8"]["diffs"]
        for name, diffs in (("kvscale FP8", ours), ("stock FP8", stock)):
            i = max(range(len(diffs)), key=diffs.__getitem__)
            print(
                f"{label:<11}   worst token of {name}: #{i} {tok.decode([targets[i]])!r}: "
                f"kvscale {ours[i]:.3f}, stock {stock[i]:.3f}"
            )
    print()


if __name__ == "__main__":
    sys.exit(main())
