"""FP8 KV-cache write: kvscale's fused kernel against vLLM's kernels and the
torch reference, side by side in one run.

    python benchmarks/cache_write.py            # decode 1-64 and prefill 512-16,384 tokens
    python benchmarks/cache_write.py --smoke    # three sizes, few repetitions (CI)
    python benchmarks/cache_write.py --cuda-graph   # time kernels as CUDA-graph replays

Inputs are what vLLM passes to ``do_kv_cache_update``: key/value are column
slices of a fused qkv tensor (bf16), the cache is one layer's
``[num_blocks, num_kv_heads, block_size, 2*head_size]`` uint8 tensor in vLLM's
default NHD memory layout, transposed and split into K and V. Decode sizes put
every token in a different sequence (a random block and offset); prefill sizes
fill consecutive slots of randomly ordered blocks.

Bytes moved per token and head: read 2 x head_size x input bytes, write
2 x head_size. GB/s counts those bytes only; "% peak" divides by the device's
memory bandwidth (table below, or --peak-gbps). "x CUDA base" is the CUDA
baseline's time over this row's time (above 1: faster): vLLM's CUDA
``reshape_and_cache_flash`` where a vLLM GPU build is importable, else the same design
re-implemented in benchmarks/cuda_baseline.py (CuPy/NVRTC; labelled so). Where vLLM is
not installed, ``--vllm-triton-copy`` runs vLLM's Triton cache write from a copy made
by benchmarks/vendor_vllm_triton.py.
"bytes != ref" is the share of cache bytes that differ from the torch
reference (NaN compared as a class). Without a GPU only the reference runs.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

DECODE_TOKENS = [1, 2, 4, 8, 16, 32, 64]
PREFILL_TOKENS = [512, 1024, 2048, 4096, 8192, 16384]
SMOKE_TOKENS = [1, 64, 512]

# Peak DRAM bandwidth in GB/s, matched against torch's device name (first hit).
PEAK_GBPS = [
    ("GB200", 8000.0),
    ("B200", 8000.0),
    ("H200", 4800.0),
    ("H20", 4000.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),
    ("A800", 2039.0),
    ("L40S", 864.0),
    ("L40", 864.0),
    ("L4", 300.0),
    ("A10G", 600.0),
    ("A10", 600.0),
    ("RTX 4090", 1008.0),
    ("RTX 6000 Ada", 960.0),
]


@dataclass
class Case:
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    slot_mapping: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor
    bytes_moved: int


def make_case(
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype,
) -> Case:
    g = torch.Generator().manual_seed(num_tokens)
    num_q_heads = 4 * num_kv_heads
    widths = [num_q_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size]
    qkv = (torch.randn(num_tokens, sum(widths), generator=g) * 100).to(dtype).to(device)
    _, k, v = qkv.split(widths, dim=-1)
    decode = num_tokens <= 64
    num_blocks = num_tokens + 1 if decode else -(-num_tokens // block_size) + 1
    order = torch.randperm(num_blocks, generator=g)
    if decode:
        offsets = torch.randint(0, block_size, (num_tokens,), generator=g)
        slots = order[:num_tokens] * block_size + offsets
    else:
        token = torch.arange(num_tokens)
        slots = order[token // block_size] * block_size + token % block_size
    physical = torch.zeros(num_blocks, block_size, num_kv_heads, 2 * head_size, dtype=torch.uint8)
    kv_cache = physical.to(device).permute(0, 2, 1, 3)  # logical [blocks, heads, slots, 2*hs]
    key_cache, value_cache = kv_cache.transpose(1, 2).split(head_size, dim=-1)
    in_bytes = torch.finfo(dtype).bits // 8
    return Case(
        key=k.view(num_tokens, num_kv_heads, head_size),
        value=v.view(num_tokens, num_kv_heads, head_size),
        kv_cache=kv_cache,
        key_cache=key_cache,
        value_cache=value_cache,
        slot_mapping=slots.to(device),
        k_scale=torch.tensor(0.37, device=device),
        v_scale=torch.tensor(2.9, device=device),
        bytes_moved=num_tokens * num_kv_heads * head_size * 2 * (in_bytes + 1),
    )


STAND_IN = "CUDA per-token (vLLM design)"


def _load_module(path: str) -> Any:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _load_copy(path: str) -> Callable[..., None]:
    """vLLM's Triton cache write from a copy made by benchmarks/vendor_vllm_triton.py."""
    return _load_module(path).triton_reshape_and_cache_flash


def _vllm_call(op: Callable[..., None]) -> Callable[[Case], None]:
    """A vLLM cache write (CUDA op or Triton launcher: same arguments) on a ``Case``."""

    def run(c: Case) -> None:
        op(c.key, c.value, c.key_cache, c.value_cache, c.slot_mapping, "fp8", c.k_scale, c.v_scale)

    return run


def implementations(
    device: torch.device, vllm_triton_copy: str | None = None
) -> tuple[dict[str, Callable[[Case], None]], list[str]]:
    """The contenders this machine can run, and a note for each one it cannot."""
    from kvscale_plugin.kernels import fp8_cache_write, fp8_cache_write_reference

    def reference(c: Case) -> None:
        fp8_cache_write_reference(
            c.key, c.value, c.key_cache, c.value_cache, c.slot_mapping, c.k_scale, c.v_scale
        )

    if device.type != "cuda":
        return {"torch reference": reference}, [
            "no GPU: timing the torch reference only (the Triton kernel and vLLM's "
            "kernels need a CUDA device)"
        ]

    impls: dict[str, Callable[[Case], None]] = {}
    notes: list[str] = []
    capability = torch.cuda.get_device_capability(device)
    try:
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.reshape_and_cache_flash  # noqa: B018 - raises if not built

        impls["vLLM CUDA reshape_and_cache_flash"] = _vllm_call(ops.reshape_and_cache_flash)
    except (ImportError, AttributeError, RuntimeError) as exc:
        notes.append(f"vLLM CUDA reshape_and_cache_flash unavailable: {exc}")
        try:
            stand_in = _load_module(str(Path(__file__).with_name("cuda_baseline.py")))
            impls[STAND_IN] = stand_in.make_cuda_baseline()
            notes.append(
                f"baseline '{STAND_IN}': vLLM's reshape_and_cache_flash design re-implemented "
                "(benchmarks/cuda_baseline.py), compiled with NVRTC; not vLLM's binary"
            )
        except Exception as exc2:  # noqa: BLE001 - a benchmark baseline is optional
            notes.append(f"CUDA stand-in unavailable: {type(exc2).__name__}: {exc2}")

    def ours(conversion: str) -> Callable[[Case], None]:
        def run(c: Case) -> None:
            fp8_cache_write(
                c.key,
                c.value,
                c.key_cache,
                c.value_cache,
                c.slot_mapping,
                c.k_scale,
                c.v_scale,
                conversion=conversion,  # type: ignore[arg-type]
            )

        return run

    impls["kvscale fused (software cvt)"] = ours("software")
    if capability >= (8, 9):
        impls["kvscale fused (hardware cvt)"] = ours("hardware")
    else:
        notes.append(
            f"kvscale hardware conversion needs sm_89+ (this is sm_{capability[0]}{capability[1]})"
        )
    try:
        try:
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import (
                triton_reshape_and_cache_flash,
            )
        except ImportError:
            if not vllm_triton_copy:
                raise
            triton_reshape_and_cache_flash = _load_copy(vllm_triton_copy)
            notes.append(f"vLLM triton_reshape_and_cache_flash: copied source {vllm_triton_copy}")

        if capability < (8, 9):
            raise RuntimeError("needs native fp8e4nv (sm_89+)")

        impls["vLLM triton_reshape_and_cache_flash"] = _vllm_call(triton_reshape_and_cache_flash)
    except (ImportError, RuntimeError) as exc:
        notes.append(f"vLLM triton_reshape_and_cache_flash unavailable: {exc}")
    impls["torch reference"] = reference
    return impls, notes


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for pattern, gbps in PEAK_GBPS:
        if pattern in name:
            return gbps
    props = torch.cuda.get_device_properties(device)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return None


def time_us(fn: Callable[[], None], device: torch.device, reps: int, cuda_graph: bool) -> float:
    if device.type == "cuda":
        import triton.testing

        if cuda_graph:
            return triton.testing.do_bench_cudagraph(fn, rep=reps, return_mode="median") * 1e3
        return (
            triton.testing.do_bench(fn, warmup=max(5, reps // 4), rep=reps, return_mode="median")
            * 1e3
        )
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def mismatch_share(actual: torch.Tensor, expected: torch.Tensor) -> float:
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    both_nan = ((a & 0x7F) == 0x7F) & ((e & 0x7F) == 0x7F)
    return ((a != e) & ~both_nan).float().mean().item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="3 sizes, few repetitions (CI)")
    parser.add_argument("--tokens", type=lambda s: [int(t) for t in s.split(",")], default=None)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--peak-gbps", type=float, default=None, help="device memory bandwidth")
    parser.add_argument("--cuda-graph", action="store_true", help="time CUDA-graph replays")
    parser.add_argument(
        "--vllm-triton-copy",
        default=None,
        help="where vLLM is not installed: a copy of its Triton cache write "
        "(made by benchmarks/vendor_vllm_triton.py)",
    )
    args = parser.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokens = args.tokens or (SMOKE_TOKENS if args.smoke else DECODE_TOKENS + PREFILL_TOKENS)
    # Milliseconds of timing per point on a GPU (triton's do_bench), repetitions on the CPU.
    reps = (10 if args.smoke else 100) if device.type == "cuda" else (3 if args.smoke else 20)
    impls, notes = implementations(device, args.vllm_triton_copy)
    peak = peak_gbps(device, args.peak_gbps)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"

    print(f"# FP8 KV-cache write benchmark, {datetime.date.today().isoformat()}")
    print(f"# device: {device_name}; peak bandwidth: {f'{peak:.0f} GB/s' if peak else 'unknown'}")
    print(
        f"# {args.num_kv_heads} KV heads x head_size {args.head_size}, bf16 in, fp8 e4m3 out, "
        f"block {args.block_size}, torch {torch.__version__}"
        + (", CUDA-graph replays" if args.cuda_graph and device.type == "cuda" else "")
    )
    for note in notes:
        print(f"# {note}")
    header = f"{'tokens':>6}  {'implementation':<36} {'us':>10} {'GB/s':>9} {'% peak':>7} "
    header += f"{'x CUDA base':>11} {'bytes != ref':>12}"
    print(header)
    baseline_name = "vLLM CUDA reshape_and_cache_flash"
    for num_tokens in tokens:
        case = make_case(
            num_tokens, args.num_kv_heads, args.head_size, args.block_size, device, torch.bfloat16
        )
        impls["torch reference"](case)
        expected = case.kv_cache.clone()
        results: dict[str, tuple[float, float]] = {}
        for name, fn in impls.items():
            case.kv_cache.zero_()
            fn(case)
            wrong = mismatch_share(case.kv_cache, expected)
            graph = args.cuda_graph and name != "torch reference"  # the oracle syncs
            results[name] = (time_us(lambda f=fn, c=case: f(c), device, reps, graph), wrong)
        base_us = results.get(baseline_name, results.get(STAND_IN, (None, 0.0)))[0]
        for name, (us, wrong) in results.items():
            gbps = case.bytes_moved / (us * 1e-6) / 1e9
            pct = f"{100 * gbps / peak:6.1f}%" if peak else "    n/a"
            ratio = f"{base_us / us:10.2f}x" if base_us else "        n/a"
            print(
                f"{num_tokens:>6}  {name:<36} {us:>10.1f} {gbps:>9.1f} {pct:>7} "
                f"{ratio:>11} {100 * wrong:>11.2f}%"
            )


if __name__ == "__main__":
    main()
