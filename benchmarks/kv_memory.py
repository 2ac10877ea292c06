"""KV-cache capacity: tokens that fit in the same KV memory, bf16 vs FP8, stock vs kvscale.

For a per-tensor (``strategy: tensor``) and a per-head (``strategy: attn_head``)
compressed-tensors checkpoint of the same tiny model, builds in-process vLLM engines
with one fixed ``kv_cache_memory_bytes`` and prints how many tokens the KV pool
holds for: a bf16 cache, stock vLLM under ``--kv-cache-dtype auto``, and
``--quantization kvscale`` under ``auto``. Goal: kvscale = stock = 2.0x bf16 for both
checkpoints (before per-head support, kvscale served attn_head checkpoints with a
bf16 pool: 1.0x).

    python benchmarks/kv_memory.py [--kv-bytes 67108864]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
# kvscale_testing: the tests' helpers (tests/support), not part of the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-bytes", type=int, default=64 * 2**20)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvscale-kvmem-"))
    os.environ.setdefault("VLLM_CACHE_ROOT", str(tmp / "vllm-cache"))

    from kvscale_testing.engines import attention_layers
    from kvscale_testing.probe import vllm_engine
    from kvscale_testing.tinymodels import TinySpec, build_tiny_checkpoint

    from kvscale_plugin.scheme import FP8_KV_SCHEME

    checkpoints = {
        "tensor": build_tiny_checkpoint(tmp / "tensor", TinySpec(num_layers=2), cache_dir=tmp),
        "attn_head": build_tiny_checkpoint(
            tmp / "attn_head",
            TinySpec(
                num_layers=2,
                per_head=True,
                kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "attn_head"},
            ),
            cache_dir=tmp,
        ),
    }
    engines = {
        "bf16 cache": (None, "bfloat16"),
        "stock auto": (None, "auto"),
        "kvscale auto": ("kvscale", "auto"),
    }
    rows = []
    for scheme, ckpt in checkpoints.items():
        tokens: dict[str, int] = {}
        for label, (quantization, dtype) in engines.items():
            with vllm_engine(
                ckpt,
                quantization=quantization,
                kv_cache_dtype=dtype,
                kv_cache_memory_bytes=args.kv_bytes,
            ) as llm:
                cache = llm.llm_engine.vllm_config.cache_config
                tokens[label] = int(cache.num_gpu_blocks) * int(cache.block_size)
                layer = next(iter(attention_layers(llm).values()))
                pool = layer.kv_cache[0] if isinstance(layer.kv_cache, list) else layer.kv_cache
                tokens[label + " dtype"] = str(pool.dtype).replace("torch.", "")
            rows.append(
                (
                    scheme,
                    label,
                    tokens[label],
                    tokens[label + " dtype"],
                    tokens[label] / tokens["bf16 cache"],
                )
            )
    print(f"\nKV pool capacity with kv_cache_memory_bytes={args.kv_bytes:,}")
    print(f"{'scheme':<10} {'engine':<14} {'tokens':>9} {'pool dtype':>11} {'x bf16':>7}")
    for scheme, label, n, dtype, ratio in rows:
        print(f"{scheme:<10} {label:<14} {n:>9,} {dtype:>11} {ratio:>7.2f}")


if __name__ == "__main__":
    main()
