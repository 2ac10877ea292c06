"""Speed of kvscale's round-to-nearest-even FP8 cache write on vLLM's CPU build, side by
side with vLLM's own write, in one run.

    python benchmarks/cpu_write_speed.py                  # SmolLM2-135M, calibrated copy
    python benchmarks/cpu_write_speed.py --model DIR      # a checkpoint with a kv_cache_scheme
    python benchmarks/cpu_write_speed.py --smoke          # tiny model, few repetitions (CI)

1. The write alone: one layer's ``do_kv_cache_update`` work for N tokens (bf16 K/V as
   column slices of a fused qkv tensor, the model's KV heads and head size, the engine's
   block size, random slots): vLLM's ``cpu_attn_reshape_and_cache`` vs kvscale's
   compiled write (``cpu_native``, the default) and its plain-torch write
   (``write_planned`` + a ``plan_write`` per step); median microseconds per call, per
   token, and per decode step of the whole model (x number of layers), plus the share
   of bytes that differ from the torch contract
   ``(x.float() / s).clamp(-448, 448).to(float8_e4m3fn)``.
2. Engines, alternated round by round on the same checkpoint (FP8 cache, prefix caching
   off so every prefill is computed): stock vLLM vs ``--quantization kvscale``. Inside
   each kvscale engine the write is also switched back and forth between kvscale's and
   vLLM's (``KVSCALE_CPU_FP8_WRITE``), which isolates the write from everything else.
   ``--torch-write`` adds kvscale's plain-torch write to that rotation.
   Prefill tokens/s: P prompts of L random tokens, one output token. Decode tokens/s:
   B sequences, (T - 1) generated tokens each, the prefill of the same prompts timed
   separately and subtracted.
Numbers on a shared machine are noisy: compare ratios within one run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# kvscale_testing: the tests' helpers (tests/support), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
from cpu_write_quality import default_model, prepare_variants  # noqa: E402

ENV_VAR = "KVSCALE_CPU_FP8_WRITE"
KV_CACHE_BYTES = 256 * 2**20
DEFAULT_CPU_BLOCK_SIZE = 128  # what vLLM 0.32's CPU engines pick when not told (printed below)


def median_us(fn: Callable[[], None], reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


# 1. the write alone -----------------------------------------------------------------


def write_alone(
    num_heads: int,
    head_size: int,
    block_size: int,
    num_layers: int,
    sizes: Sequence[int],
    reps: int,
) -> dict[int, float]:
    """Prints the table; returns tokens -> extra microseconds per model step
    (layers x (kvscale's compiled write - vLLM's op); negative: faster)."""
    from vllm import _custom_ops as ops

    from kvscale_plugin.kernels import cpu_native
    from kvscale_plugin.kernels.cpu_cache_write import cache_target, plan_write, write_planned

    native = cpu_native.load()
    if native is None:
        print(f"# compiled write unavailable: {cpu_native.failure()}")

    g = torch.Generator().manual_seed(0)
    num_blocks = max(sizes) // block_size + 64
    cache = torch.zeros(num_blocks, num_heads, block_size, 2 * head_size, dtype=torch.uint8)
    key_cache, value_cache = cache.view(num_blocks, num_heads, 2 * block_size, -1).chunk(2, 2)
    target = cache_target(cache)
    native_target = cpu_native.native_target(cache)
    k_scale, v_scale = 0.0351, 0.0127  # SmolLM2-like calibrated scales
    print(
        f"\n## 1. the write alone: {num_heads} KV heads x head size {head_size}, block "
        f"{block_size}, bf16 in; per decode step = x {num_layers} layers (+ the torch "
        f"write's plan, once per step); torch threads {torch.get_num_threads()}"
    )
    head = (
        f"{'tokens':>6} {'write':<20} {'us/call':>9} {'ns/token':>9} {'us/step':>9} "
        f"{'x vLLM':>7} {'bytes != contract':>18}"
    )
    print(head)
    print("-" * len(head))
    extra: dict[int, float] = {}
    for n in sizes:
        width = num_heads * head_size
        qkv = (torch.randn(n, 5 * width, generator=g) * 8).to(torch.bfloat16)
        key = qkv[:, 3 * width : 4 * width].view(n, num_heads, head_size)
        value = qkv[:, 4 * width :].view(n, num_heads, head_size)
        slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
        plan = plan_write(slots, target.geometry)

        def theirs(key=key, value=value, slots=slots) -> None:
            ops.cpu_attn_reshape_and_cache(
                key,
                value,
                key_cache,
                value_cache,
                slots,
                "vec",
                k_scale=k_scale,
                v_scale=v_scale,
                kv_cache_dtype="fp8",
            )

        def ours(key=key, value=value, plan=plan) -> None:
            write_planned(key, value, target.flat, plan, k_scale, v_scale)

        def compiled(key=key, value=value, slots=slots) -> None:
            cpu_native.write_native(native, key, value, native_target, slots, k_scale, v_scale)

        def planning(slots=slots) -> None:
            plan_write(slots, target.geometry)

        r = reps if n <= 64 else max(20, reps // 10)
        # min of 3 medians each; vLLM's op and kvscale's writes alternate 3 times
        fns = {"vLLM": theirs, "torch": ours, "plan": planning}
        if native is not None:
            fns["C"] = compiled
        best: dict[str, float] = {}
        for _ in range(3):
            for name, fn in fns.items():
                t = median_us(fn, r)
                best[name] = min(best.get(name, t), t)
        plan_us = best["plan"]
        rows = [
            ("vLLM (truncate)", "vLLM"),
            ("kvscale C (RNE)", "C"),
            ("kvscale torch (RNE)", "torch"),
        ]
        for name, key_ in rows:
            if key_ not in fns:
                continue
            fn = fns[key_]
            cache.zero_()
            fn()
            wrong = _bytes_off_contract(cache, key, value, slots, k_scale, v_scale)
            us = best[key_]
            step = us * num_layers + (plan_us if key_ == "torch" else 0.0)
            print(
                f"{n:6d} {name:<20} {us:9.1f} {1e3 * us / n:9.0f} "
                f"{step if n <= 64 else float('nan'):9.0f} "
                f"{us / best['vLLM']:7.2f} {100 * wrong:17.2f}%"
            )
        print(f"{n:6d} {'torch plan (1/step)':<20} {plan_us:9.1f} {1e3 * plan_us / n:9.0f}")
        if native is not None:
            extra[n] = (best["C"] - best["vLLM"]) * num_layers
        else:
            extra[n] = (best["torch"] - best["vLLM"]) * num_layers + plan_us
    return extra


def _bytes_off_contract(cache, key, value, slots, k_scale, v_scale) -> float:
    from kvscale_plugin.kernels.cpu_cache_write import cpu_fp8_cache_read

    k_bytes, v_bytes = cpu_fp8_cache_read(cache, slots)
    wrong = 0
    for stored, x, s in ((k_bytes, key, k_scale), (v_bytes, value, v_scale)):
        want = (x.float() / torch.tensor(s)).clamp(-448, 448).to(torch.float8_e4m3fn)
        wrong += int((stored != want.view(torch.uint8)).sum())
    return wrong / (2 * key.numel())


# 2. engines -----------------------------------------------------------------------


def _prompts(rng: torch.Generator, count: int, length: int, vocab: int) -> list[dict]:
    ids = torch.randint(100, vocab - 100, (count, length), generator=rng)
    return [{"prompt_token_ids": row.tolist()} for row in ids]


def _timed_generate(llm: Any, prompts: list[dict], max_tokens: int) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - t0


def _set_write(llm: Any, mode: str) -> None:
    """Switch kvscale layers between kvscale's write and vLLM's (decided per layer on
    its next write)."""
    from kvscale_testing.engines import attention_layers

    os.environ[ENV_VAR] = mode
    for layer in attention_layers(llm).values():
        layer.impl.__dict__.pop("_kvscale_cpu_write_route", None)


def measure(llm: Any, rng: torch.Generator, vocab: int, cfg: argparse.Namespace) -> dict:
    prefill_prompts = _prompts(rng, cfg.prefill_prompts, cfg.prefill_len, vocab)
    t = _timed_generate(llm, prefill_prompts, 1)
    out = {"prefill": cfg.prefill_prompts * cfg.prefill_len / t}
    for batch in cfg.decode_batch:
        prompts = _prompts(rng, batch, cfg.decode_prompt_len, vocab)
        t_prefill = _timed_generate(llm, prompts, 1)
        prompts = _prompts(rng, batch, cfg.decode_prompt_len, vocab)  # no reuse of anything
        t_all = _timed_generate(llm, prompts, cfg.decode_tokens)
        out[f"decode b={batch}"] = batch * (cfg.decode_tokens - 1) / max(t_all - t_prefill, 1e-9)
    return out


def call_times(
    llm: Any, rng: torch.Generator, vocab: int, cfg: argparse.Namespace
) -> dict[str, float]:
    """Inside a kvscale engine: median microseconds of one layer's
    ``do_kv_cache_update`` during decode and (per token) during prefill, kvscale's
    write vs vLLM's (the same timer around both; what part 1 measures warm, here with
    the engine's caches cold)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    installed = CPUAttentionBackendImpl.__dict__["do_kv_cache_update"]
    calls: list[tuple[int, float]] = []

    def timed(self: Any, layer: Any, key: Any, value: Any, kv_cache: Any, slots: Any) -> None:
        t0 = time.perf_counter()
        installed(self, layer, key, value, kv_cache, slots)
        calls.append((slots.shape[0], time.perf_counter() - t0))

    out: dict[str, float] = {}
    CPUAttentionBackendImpl.do_kv_cache_update = timed
    try:
        for mode in ("rne", "vllm"):
            _set_write(llm, mode)
            for batch in cfg.decode_batch:
                calls.clear()
                prompts = _prompts(rng, batch, cfg.decode_prompt_len, vocab)
                _timed_generate(llm, prompts, cfg.decode_tokens)
                times = [t for n, t in calls if n == batch]
                out[f"{mode} b={batch}"] = 1e6 * statistics.median(times)
            calls.clear()
            _timed_generate(llm, _prompts(rng, cfg.prefill_prompts, cfg.prefill_len, vocab), 1)
            big = [t / n for n, t in calls if n >= 64]
            out[f"{mode} prefill/token"] = 1e6 * statistics.median(big) if big else float("nan")
    finally:
        CPUAttentionBackendImpl.do_kv_cache_update = installed
        _set_write(llm, "rne")
    return out


def _record(samples: dict[str, list[dict]], label: str, result: dict) -> None:
    samples[label].append(result)
    print(f"#   {label:<20} " + "  ".join(f"{k} {v:.1f}" for k, v in result.items()), flush=True)


def engines(
    model: Path, cfg: argparse.Namespace, extra_us: dict[int, float], num_layers: int
) -> None:
    from kvscale_testing.engines import attention_layers

    from kvscale_plugin.demo.probe import vllm_engine

    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    rng = torch.Generator().manual_seed(1)
    samples: dict[str, list[dict]] = {"stock": [], "kvscale": [], "kvscale, vLLM write": []}
    modes = ["rne", "vllm"]
    labels = {"rne": "kvscale", "vllm": "kvscale, vLLM write", "rne-torch": "kvscale, torch write"}
    if cfg.torch_write:
        modes.append("rne-torch")
        samples["kvscale, torch write"] = []
    call_samples: list[dict[str, float]] = []
    kw = dict(
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        max_model_len=cfg.max_model_len,
        enable_prefix_caching=False,
        block_size=cfg.block_size,
    )
    for rnd in range(cfg.rounds):
        order = ["stock", "kvscale"] if rnd % 2 == 0 else ["kvscale", "stock"]
        for engine in order:
            os.environ.pop(ENV_VAR, None)
            quant = "kvscale" if engine == "kvscale" else None
            with vllm_engine(model, quantization=quant, **kw) as llm:
                _timed_generate(llm, _prompts(rng, 2, 64, vocab), 4)  # warm-up
                if rnd == 0:
                    layer = next(iter(attention_layers(llm).values()))
                    cache = (
                        layer.kv_cache[0] if isinstance(layer.kv_cache, list) else (layer.kv_cache)
                    )
                    print(
                        f"# {engine}: cache {tuple(cache.shape)} {cache.dtype}, "
                        f"isa {getattr(layer, 'isa', None)}",
                        flush=True,
                    )
                if engine == "stock":
                    for _ in range(cfg.reps):
                        _record(samples, "stock", measure(llm, rng, vocab, cfg))
                    continue
                for rep in range(cfg.reps):
                    for mode in modes if rep % 2 == 0 else modes[::-1]:
                        _set_write(llm, mode)
                        _record(samples, labels[mode], measure(llm, rng, vocab, cfg))
                _set_write(llm, "rne")
                calls = call_times(llm, rng, vocab, cfg)
                call_samples.append(calls)
                print(
                    "#   in-engine us per layer call: "
                    + "  ".join(f"{k} {v:.1f}" for k, v in calls.items()),
                    flush=True,
                )
            os.environ.pop(ENV_VAR, None)
        print(f"# round {rnd + 1}/{cfg.rounds} done", flush=True)

    metrics = list(samples["stock"][0])
    med = {
        e: {m: statistics.median(s[m] for s in runs) for m in metrics}
        for e, runs in samples.items()
    }
    print(
        f"\n## 2. engines: median tokens/s over {cfg.rounds} rounds x {cfg.reps} reps "
        f"(prefill {cfg.prefill_prompts} x {cfg.prefill_len} tokens; decode "
        f"{cfg.decode_tokens - 1} tokens after {cfg.decode_prompt_len}-token prompts)"
    )
    head = f"{'engine':<22}" + "".join(f"{m:>14}" for m in metrics)
    print(head)
    print("-" * len(head))
    for e in samples:
        print(f"{e:<22}" + "".join(f"{med[e][m]:14.1f}" for m in metrics))
    print(
        f"{'kvscale / stock':<22}"
        + "".join(f"{med['kvscale'][m] / med['stock'][m]:14.3f}" for m in metrics)
    )
    print(
        f"{'kvscale / vLLM write':<22}"
        + "".join(f"{med['kvscale'][m] / med['kvscale, vLLM write'][m]:14.3f}" for m in metrics)
    )
    # Per round: kvscale's median over stock's median of the same round (drift between
    # rounds cancels); then the median and the worst of those ratios.
    per_round = {m: [] for m in metrics}
    for rnd in range(cfg.rounds):
        k_runs = samples["kvscale"][rnd * cfg.reps : (rnd + 1) * cfg.reps]
        s_runs = samples["stock"][rnd * cfg.reps : (rnd + 1) * cfg.reps]
        for m in metrics:
            per_round[m].append(
                statistics.median(r[m] for r in k_runs) / statistics.median(r[m] for r in s_runs)
            )
    print(
        f"{'per-round ratio, med':<22}"
        + "".join(f"{statistics.median(per_round[m]):14.3f}" for m in metrics)
    )
    print(f"{'per-round ratio, min':<22}" + "".join(f"{min(per_round[m]):14.3f}" for m in metrics))
    if call_samples:
        print(
            "\nin-engine write per layer call (median over rounds of each round's median "
            "during decode, us):"
        )
        for batch in cfg.decode_batch:
            ours = statistics.median(c[f"rne b={batch}"] for c in call_samples)
            theirs = statistics.median(c[f"vllm b={batch}"] for c in call_samples)
            print(
                f"  decode b={batch}: kvscale's write {ours:.1f}, vLLM's write {theirs:.1f} "
                f"({ours - theirs:+.1f} us x {num_layers} layers = "
                f"{(ours - theirs) * num_layers / 1e3:+.2f} ms per step)"
            )
        ours = statistics.median(c["rne prefill/token"] for c in call_samples)
        theirs = statistics.median(c["vllm prefill/token"] for c in call_samples)
        print(
            f"  prefill, per token: kvscale's write {ours:.3f}, vLLM's write {theirs:.3f} "
            f"({ours - theirs:+.3f} us x {num_layers} layers x "
            f"{cfg.prefill_prompts * cfg.prefill_len} tokens = "
            f"{(ours - theirs) * num_layers * cfg.prefill_prompts * cfg.prefill_len / 1e3:+.1f}"
            " ms per prefill)"
        )
    worst = min(med["kvscale"][m] / med["stock"][m] for m in metrics)
    print(f"\nworst kvscale / stock ratio: {worst:.3f} (goal >= 0.95)")
    spread = {
        e: (min(s["decode b=1"] for s in runs), max(s["decode b=1"] for s in runs))
        for e, runs in samples.items()
        if "decode b=1" in runs[0]
    }
    for e, (lo, hi) in spread.items():
        print(f"# spread of decode b=1 samples, {e}: {lo:.1f} .. {hi:.1f} tokens/s")
    if "decode b=1" in metrics and 1 in extra_us:
        # The write's added cost per decode step, from part 1, against the fastest
        # stock decode step this run observed (the least disturbed one).
        step_ms = 1e3 / max(s["decode b=1"] for s in samples["stock"])
        added_ms = extra_us[1] / 1e3
        print(
            f"estimated decode b=1 ratio from the write's cost: fastest stock step "
            f"{step_ms:.1f} ms, {added_ms:+.3f} ms ({num_layers} layers' writes, part 1) -> "
            f"{step_ms / (step_ms + added_ms):.3f}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="checkpoint dir (default: SmolLM2, calibrated copy)",
    )
    p.add_argument("--tiny", action="store_true", help="use the tiny boosted test model")
    p.add_argument("--smoke", action="store_true", help="tiny model, few repetitions")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="measurements per engine and round")
    p.add_argument("--prefill-prompts", type=int, default=4)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--decode-prompt-len", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=65)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument(
        "--block-size",
        type=int,
        default=None,
        help=f"engine block size (default: vLLM's; {DEFAULT_CPU_BLOCK_SIZE} "
        "for the write-alone part)",
    )
    p.add_argument("--write-reps", type=int, default=300)
    p.add_argument(
        "--torch-write",
        action="store_true",
        help="also time kvscale's plain-torch write inside the kvscale engines",
    )
    p.add_argument("--skip-engines", action="store_true")
    p.add_argument("--work-dir", type=Path, default=None)
    cfg = p.parse_args(argv)
    if cfg.smoke:
        cfg.tiny, cfg.rounds, cfg.reps, cfg.write_reps = True, 1, 1, 30
        cfg.prefill_prompts, cfg.prefill_len, cfg.decode_batch, cfg.decode_tokens = 2, 64, [2], 9

    work = cfg.work_dir or Path.home() / ".cache" / "kvscale-plugin" / "bench-cpu-write"
    if cfg.model is not None:
        model = cfg.model.resolve()
        if "kv_cache_scheme" not in (
            json.loads((model / "config.json").read_text()).get("quantization_config") or {}
        ):
            model = prepare_variants(model, work / model.name)["calibrated"]
    else:
        base = default_model(cfg.tiny, work)
        model = prepare_variants(base, work / base.name)["calibrated"]
    import vllm

    conf = json.loads((model / "config.json").read_text())
    conf = conf.get("text_config", conf)
    heads = conf["num_key_value_heads"]
    head_size = conf.get("head_dim") or conf["hidden_size"] // conf["num_attention_heads"]
    layers = conf["num_hidden_layers"]
    print(
        f"# {datetime.date.today()}  vLLM {vllm.__version__}  torch {torch.__version__}  "
        f"{os.cpu_count()} CPUs  model {model}"
    )
    block_size = cfg.block_size or DEFAULT_CPU_BLOCK_SIZE
    sizes = [1, 8, 64, 512, 2048] if not cfg.smoke else [1, 64]
    extra = write_alone(heads, head_size, block_size, layers, sizes, cfg.write_reps)
    if not cfg.skip_engines:
        engines(model, cfg, extra, layers)
    return 0


if __name__ == "__main__":
    sys.exit(main())
