"""Cost of ``record_kv_scales`` around a trainer's forward pass, side by side with the
same forward without it, in one run.

    python benchmarks/trainer_scales.py                  # tiny Llama (built in a temp dir)
    python benchmarks/trainer_scales.py --model DIR      # e.g. build/real-model/SmolLM2-...
    python benchmarks/trainer_scales.py --backward       # forward + backward (training step)
    python benchmarks/trainer_scales.py --in-force       # with the drift monitor (issue #54)

The batch is what an old-log-prob pass sees: B sequences of random tokens padded to L
(lengths drawn between L/2 and L, left padding, ``attention_mask`` and ``position_ids``
as trainers pass them). Plain and recorded forwards alternate round by round; the medians
are compared (overhead = recorded / plain - 1, target at most 5%). Where the machine is
shared that ratio is noisier than 5%, so the recording's own work is also timed alone:
one forward's attention calls (keys, values, masks) captured, then replayed through the
recorder (``KVRecorder._see``: the mask read and the per-layer reductions), as a share
of the plain step. ``scales()``, called once per step after the forwards, is timed too.
With ``--in-force`` the recorded forwards also run the drift monitor
(``record_kv_scales(model, in_force=...)``: the clipped elements counted against scales
half the batch's own, so that some clip) and ``drift()`` is timed instead of ``scales()``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvscale_plugin.calibration import (  # noqa: E402
    KVRecorder,
    KVScaleRecorder,
    record_kv_scales,
    weights_dtype,
)


def load(model_dir: Path, dtype: str, attn: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # plain weights, as a trainer holds them
    torch_dtype = weights_dtype(model_dir) if dtype == "auto" else getattr(torch, dtype)
    return AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=torch_dtype, attn_implementation=attn
    )


def batch(vocab: int, b: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(seq // 2, seq + 1, (b,), generator=g)
    mask = (torch.arange(seq)[None] >= (seq - lengths)[:, None]).long()  # left padding
    ids = torch.randint(0, vocab, (b, seq), generator=g) * mask
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
    }


class _Capture(KVRecorder):
    """Keeps what each attention call of the model received, records nothing."""

    def __init__(self, model: Any) -> None:
        super().__init__(model)
        self.calls: list[tuple[Any, torch.Tensor, torch.Tensor, Any]] = []

    def _see(self, module: Any, key: Any, value: Any, mask: Any) -> None:
        if id(module) in self.module_names:
            self.calls.append((module, key.detach(), value.detach(), mask))


def replay_seconds(
    model: Any, inputs: dict[str, torch.Tensor], reps: int, in_force: Any = None
) -> float:
    """Median seconds the recorder spends on one forward's attention calls."""
    with _Capture(model) as cap, torch.no_grad():
        model(**inputs, use_cache=False)
    times = []
    for _ in range(reps):
        rec = KVRecorder(model) if in_force is None else KVScaleRecorder(model, in_force=in_force)
        t0 = time.perf_counter()
        for call in cap.calls:
            rec._see(*call)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="checkpoint dir (default: tiny)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=10, help="rounds (one plain + one recorded each)")
    p.add_argument("--dtype", default="auto", help="auto (stored weights' dtype), float32, ...")
    p.add_argument("--attn", default="sdpa", help="attn_implementation (sdpa, eager, ...)")
    p.add_argument("--backward", action="store_true", help="time forward + backward")
    p.add_argument("--in-force", action="store_true", help="with the drift monitor")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from kvscale_plugin.demo.tinymodels import TinySpec, build_tiny_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="kvscale-bench-")
        model_dir = build_tiny_checkpoint(
            Path(tmp.name) / "tiny",
            TinySpec(num_layers=4, write_scales=False),
            cache_dir=Path(tmp.name),
        )
    model = load(model_dir, args.dtype, args.attn)
    model.train(args.backward)
    inputs = batch(model.config.vocab_size, args.batch, args.seq)
    real = int(inputs["attention_mask"].sum())
    in_force = None
    if args.in_force:
        with record_kv_scales(model) as rec, torch.no_grad():
            model(**inputs, use_cache=False)
        in_force = {n: t * 0.5 for n, t in rec.scales("tensor").items()}

    def step(recorded: bool) -> float:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with (
            record_kv_scales(model, in_force=in_force) if recorded else nullcontext(),
            torch.set_grad_enabled(args.backward),
        ):
            logits = model(**inputs, use_cache=False).logits
            if args.backward:
                logits.float().logsumexp(-1).mean().backward()
        return time.perf_counter() - t0

    for recorded in (False, True):  # warm-up
        step(recorded)
    times: dict[bool, list[float]] = {False: [], True: []}
    for r in range(args.reps):
        for recorded in (False, True) if r % 2 == 0 else (True, False):
            times[recorded].append(step(recorded))

    with record_kv_scales(model, in_force=in_force) as rec, torch.no_grad():
        model(**inputs, use_cache=False)

    def once(fn: Callable[[], object]) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    work_s = replay_seconds(model, inputs, 3 * args.reps, in_force)
    per_step = (lambda: rec.drift()) if args.in_force else (lambda: rec.scales("attn_head"))
    scales_s = statistics.median(once(per_step) for _ in range(5))
    plain, recorded = (statistics.median(times[k]) for k in (False, True))
    paired = statistics.median(r / p for p, r in zip(times[False], times[True], strict=True))
    best_plain, best_recorded = (min(times[k]) for k in (False, True))
    dtype = next(model.parameters()).dtype
    what = "forward + backward" if args.backward else "forward (no grad)"
    print(
        f"model: {args.model or 'tiny Llama (4 layers, hidden 256)'}  dtype {dtype}  "
        f"attn {args.attn}  threads {torch.get_num_threads()}"
        + ("  drift monitor on (in_force)" if args.in_force else "")
    )
    print(
        f"batch: {args.batch} x {args.seq} (left-padded, {real} real tokens); {what}; "
        f"median of {args.reps} alternating rounds"
    )
    print(f"{'':<28}{'plain':>12}{'recorded':>12}{'overhead':>10}")
    print(
        f"{'ms per step (median)':<28}{plain * 1e3:>12.2f}{recorded * 1e3:>12.2f}"
        f"{(recorded / plain - 1) * 100:>9.1f}%"
    )
    print(
        f"{'ms per step (best round)':<28}{best_plain * 1e3:>12.2f}{best_recorded * 1e3:>12.2f}"
        f"{(best_recorded / best_plain - 1) * 100:>9.1f}%"
    )
    print(f"{'median of per-round ratios':<52}{(paired - 1) * 100:>9.1f}%")
    print(
        f"recording work alone (replayed): {work_s * 1e3:.2f} ms per step = "
        f"{work_s / plain * 100:.1f}% of the plain step (median)"
    )
    if args.in_force:
        print(f"drift() once per step: {scales_s * 1e3:.2f} ms ({rec.drift().verdict})")
    else:
        print(f"scales() once per step: {scales_s * 1e3:.2f} ms ({len(rec.scales())} tensors)")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
