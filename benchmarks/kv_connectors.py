"""What kvscale's KV connectors and its prefix-cache reset cost on a hit, beside stock.

In one run, on one tiny Llama (FP8 KV scheme; vLLM's FP8 cache where this CPU runs one,
else bf16), in-process vLLM engines, rounds alternated:

* connector hit: the same 300-token prompt served from vLLM's ``ExampleConnector`` disk
  store (prefix caching off, so every hit is the connector's), on a stock engine with
  vLLM's connector, a ``-q kvscale`` engine with vLLM's connector, and a ``-q kvscale``
  engine with kvscale's (store keyed by the scale state);
* prefix-cache hit: the same prompt from the prefix cache, stock vs ``-q kvscale`` (its
  scheduler step wrapped: the pending-reset check);
* a scales-only ``collective_rpc`` update with kvscale's connector vs vLLM's (kvscale's
  asks the workers for the scale state afterwards).

Median seconds per request (per update) over ``--requests`` after a warm-up, per arm.

    python benchmarks/kv_connectors.py [--rounds 3] [--requests 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

CONNECTORS = "kvscale_plugin.hosts.vllm.connectors"


def _push(worker):  # runs in the worker
    import torch

    tensors = [
        (f"model.layers.{i}.self_attn.{kind}", torch.tensor(0.05))
        for i in range(2)
        for kind in ("k_scale", "v_scale")
    ]
    return len(worker.model_runner.model.load_weights(tensors))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20)
    args = parser.parse_args()

    from kvscale_plugin.demo.probe import KV_CACHE_BYTES, shutdown
    from kvscale_plugin.demo.tinymodels import TinySpec, build_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="kvscale-connectors-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))
    ckpt = build_tiny_checkpoint(tmp / "model", TinySpec(num_layers=2))
    from kvscale_plugin.hosts.vllm.platform_cache import cpu_cannot_run_fp8_cache

    fp8 = not cpu_cannot_run_fp8_cache()
    kv_dtype = "auto" if fp8 else "bfloat16"

    from vllm import LLM, SamplingParams

    prompt = [(7 * i) % 200 + 2 for i in range(300)]
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def engine(quantization, connector_module, prefix_caching, store):
        kv_transfer = None
        if connector_module is not False:
            kv_transfer = {
                "kv_connector": "ExampleConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(store)},
            }
            if connector_module:
                kv_transfer["kv_connector_module_path"] = connector_module
        return LLM(
            model=str(ckpt),
            quantization=quantization,
            kv_cache_dtype=kv_dtype,
            enforce_eager=True,
            kv_cache_memory_bytes=KV_CACHE_BYTES,
            block_size=32,
            dtype="bfloat16",
            max_model_len=512,
            enable_prefix_caching=prefix_caching,
            kv_transfer_config=kv_transfer,
        )

    def per_request(llm) -> float:
        llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)  # stores / caches
        times = []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
            times.append(time.perf_counter() - t0)
            assert out.num_cached_tokens >= 256, "not a hit: the benchmark measures nothing"
        return statistics.median(times)

    def per_update(llm) -> float:
        times = []
        for _ in range(max(3, args.requests // 4)):
            t0 = time.perf_counter()
            llm.collective_rpc(_push)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    arms = {
        "connector hit: stock engine, vLLM's ExampleConnector": (None, None, False),
        "connector hit: -q kvscale, vLLM's ExampleConnector": ("kvscale", None, False),
        "connector hit: -q kvscale, kvscale's ExampleConnector": ("kvscale", CONNECTORS, False),
        "prefix-cache hit: stock engine": (None, False, True),
        "prefix-cache hit: -q kvscale": ("kvscale", False, True),
    }
    updates = {
        "scales-only collective_rpc: vLLM's ExampleConnector": None,
        "scales-only collective_rpc: kvscale's ExampleConnector": CONNECTORS,
    }
    got: dict[str, list[float]] = {name: [] for name in [*arms, *updates]}
    for round_ in range(args.rounds):
        for name, (quantization, module, prefix) in arms.items():
            llm = engine(quantization, module, prefix, tmp / f"store-{round_}-{len(got[name])}")
            try:
                got[name].append(per_request(llm))
            finally:
                shutdown(llm)
        for name, module in updates.items():
            llm = engine("kvscale", module, False, tmp / f"store-u{round_}")
            try:
                got[name].append(per_update(llm))
            finally:
                shutdown(llm)

    print(
        f"tiny Llama (2 layers), {kv_dtype} KV cache ({'FP8' if fp8 else 'bf16: no FP8 here'}), "
        f"300-token prompt, max_tokens=1; {args.rounds} rounds x {args.requests} requests"
    )
    print(f"{'arm':<58}{'median ms':>10}{'min ms':>9}{'max ms':>9}")
    med = {}
    for name, vals in got.items():
        med[name] = statistics.median(vals)
        print(f"{name:<58}{med[name] * 1e3:>10.2f}{min(vals) * 1e3:>9.2f}{max(vals) * 1e3:>9.2f}")
    names = list(got)
    print(
        f"kvscale's connector / vLLM's on a -q kvscale engine: {med[names[2]] / med[names[1]]:.3f}"
    )
    print(f"-q kvscale / stock, prefix-cache hit: {med[names[4]] / med[names[3]]:.3f}")
    print(f"update with kvscale's connector / vLLM's: {med[names[6]] / med[names[5]]:.3f}")


if __name__ == "__main__":
    main()
