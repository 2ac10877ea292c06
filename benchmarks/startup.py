"""Engine start-up time: `--quantization kvscale` vs stock vLLM on the same checkpoint.

Builds in-process vLLM engines alternately (stock, kvscale, stock, ...) on one tiny
compressed-tensors checkpoint and prints the median start-up time of each and their
ratio, measured in this one run. Goal: ratio <= 1.05.

    python benchmarks/startup.py [--rounds 4] [--layers 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    args = parser.parse_args()

    from kvscale_plugin.demo.probe import shutdown
    from kvscale_plugin.demo.tinymodels import TinySpec, build_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="kvscale-startup-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    ckpt = build_tiny_checkpoint(tmp / "model", TinySpec(num_layers=args.layers))

    from vllm import LLM

    from kvscale_plugin.demo.probe import KV_CACHE_BYTES

    def start(quantization: str | None) -> float:
        t0 = time.perf_counter()
        llm = LLM(
            model=str(ckpt),
            quantization=quantization,
            enforce_eager=True,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            block_size=32,
            dtype="bfloat16",
            max_model_len=512,
        )
        elapsed = time.perf_counter() - t0
        shutdown(llm)
        return elapsed

    start(None)  # warm-up: vLLM inspects a new architecture once and caches it
    times: dict[str, list[float]] = {"stock": [], "kvscale": []}
    for _ in range(args.rounds):
        times["stock"].append(start(None))
        times["kvscale"].append(start("kvscale"))

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"checkpoint: tiny llama, {args.layers} layers, FP8 KV scheme; rounds: {args.rounds}")
    print(f"{'engine':<10}{'median s':>10}{'min s':>10}{'max s':>10}")
    for name, vals in times.items():
        print(f"{name:<10}{med[name]:>10.3f}{min(vals):>10.3f}{max(vals):>10.3f}")
    print(f"ratio kvscale/stock (median): {med['kvscale'] / med['stock']:.3f}  (goal <= 1.05)")


if __name__ == "__main__":
    main()
