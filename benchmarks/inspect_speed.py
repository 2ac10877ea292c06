"""`kvscale inspect` cost: grows with the number of tensors, not with the size of the weights.

Builds synthetic sharded llama-shaped checkpoints with safetensors (random bf16
weights, per-layer F32 k/v scales, a config.json declaring an FP8
kv_cache_scheme), then measures, with the page cache dropped for the checkpoint's
files before each run (posix_fadvise DONTNEED after fsync: "cold-ish"):

* inspect: ``inspect_checkpoint(dir)`` in this process (imports already warm);
* process: the whole ``kvscale inspect DIR`` process, fresh interpreter and imports
  included (warm page cache; median of ``--process-runs``), beside the report's own time;
  ``kvscale --help`` the same way, for the interpreter's and the CLI's floor;
* read: reading every safetensors file fully, in 16 MiB chunks;
* cached: bytes of the checkpoint's files in the page cache after one cold inspect
  (``mincore``; Linux): what the kernel really read, read-ahead included -- the
  ``bytes_read`` inspect reports counts only what it asked for.

Checkpoints: the default one (80 layers, 20 shards, a few hundred MB); the same
tensor count with ~1/60 of the weight bytes; and 2x / 4x the tensors with small
weights. Prints one row per checkpoint and the inspect/read ratio.

    python benchmarks/inspect_speed.py [--layers 80] [--shards 20] [--hidden 512]
                                        [--intermediate 1024] [--repeats 5]
                                        [--process-runs 9] [--cli]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from cli_startup import kvscale_command  # benchmarks/, this script's folder
from safetensors.torch import save_file

from kvscale_plugin.scheme import FP8_KV_SCHEME

VOCAB = 1024


def build(out: Path, layers: int, shards: int, hidden: int, inter: int) -> Path:
    """A llama-shaped sharded checkpoint: 11 tensors per layer (+ embed, norm, lm_head)."""
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    # One random pool sliced per tensor (cloned: safetensors refuses shared storage);
    # generating fresh random data per tensor would dominate the build time.
    pool = torch.randn(max(VOCAB, inter) * hidden, generator=gen).to(torch.bfloat16)

    def rand(*shape: int) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        return pool[:n].clone().reshape(shape)

    per_layer: list[dict[str, torch.Tensor]] = []
    for i in range(layers):
        p = f"model.layers.{i}."
        per_layer.append(
            {
                p + "self_attn.q_proj.weight": rand(hidden, hidden),
                p + "self_attn.k_proj.weight": rand(hidden, hidden),
                p + "self_attn.v_proj.weight": rand(hidden, hidden),
                p + "self_attn.o_proj.weight": rand(hidden, hidden),
                p + "mlp.gate_proj.weight": rand(inter, hidden),
                p + "mlp.up_proj.weight": rand(inter, hidden),
                p + "mlp.down_proj.weight": rand(hidden, inter),
                p + "input_layernorm.weight": rand(hidden),
                p + "post_attention_layernorm.weight": rand(hidden),
                p + "self_attn.k_scale": torch.tensor([0.01 + i * 1e-4], dtype=torch.float32),
                p + "self_attn.v_scale": torch.tensor([0.02 + i * 1e-4], dtype=torch.float32),
            }
        )
    extra = {
        "model.embed_tokens.weight": rand(VOCAB, hidden),
        "model.norm.weight": rand(hidden),
        "lm_head.weight": rand(VOCAB, hidden),
    }
    weight_map: dict[str, str] = {}
    per_shard = -(-layers // shards)
    total = 0
    for s in range(shards):
        part: dict[str, torch.Tensor] = {}
        for layer in per_layer[s * per_shard : (s + 1) * per_shard]:
            part.update(layer)
        if s == shards - 1:
            part.update(extra)
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
        total += sum(t.numel() * t.element_size() for t in part.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    (out / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": hidden,
                "intermediate_size": inter,
                "num_hidden_layers": layers,
                "num_attention_heads": max(1, hidden // 64),
                "num_key_value_heads": max(1, hidden // 128),
                "vocab_size": VOCAB,
                "torch_dtype": "bfloat16",
                "quantization_config": {
                    "quant_method": "compressed-tensors",
                    "format": "dense",
                    "config_groups": {},
                    "ignore": [],
                    "quantization_status": "compressed",
                    "kv_cache_scheme": dict(FP8_KV_SCHEME),
                },
            },
            indent=2,
        )
    )
    return out


def files_of(ckpt: Path) -> list[Path]:
    return sorted(ckpt.glob("*.safetensors"))


def drop_cache(ckpt: Path) -> None:
    """Ask the kernel to evict the checkpoint's pages (no root needed; best effort)."""
    for path in [*files_of(ckpt), ckpt / "config.json", ckpt / "model.safetensors.index.json"]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cached_bytes(ckpt: Path) -> int | None:
    """Bytes of the checkpoint's safetensors files now in the page cache (None: no mincore)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = (
            [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
        )
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    page = os.sysconf("SC_PAGE_SIZE")
    total = 0
    for path in files_of(ckpt):
        size = path.stat().st_size
        fd = os.open(path, os.O_RDONLY)
        try:
            # Mapping a file does not read it; mincore only reports what is cached.
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            vec = ctypes.create_string_buffer(-(-size // page))
            ok = libc.mincore(addr, size, vec) == 0
            libc.munmap(addr, size)
            if not ok:
                return None
            total += sum(b & 1 for b in vec.raw) * page
        finally:
            os.close(fd)
    return total


def read_all(ckpt: Path) -> int:
    n = 0
    for path in files_of(ckpt):
        with open(path, "rb", buffering=0) as f:
            while chunk := f.read(16 << 20):
                n += len(chunk)
    return n


def timed(fn, ckpt: Path, repeats: int, cold: bool = True) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            drop_cache(ckpt)
        t0 = time.perf_counter()
        fn(ckpt)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def process_time(argv: list[str], runs: int) -> float:
    """Median wall time of ``runs`` fresh processes of ``argv`` (after one warm-up run)."""
    times = []
    for i in range(runs + 1):
        t0 = time.perf_counter()
        proc = subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if i:
            times.append(time.perf_counter() - t0)
        if proc.returncode not in (0, 1):
            raise SystemExit(f"{' '.join(argv)} exited with {proc.returncode}:\n{proc.stderr}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=80)
    parser.add_argument("--shards", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--process-runs",
        type=int,
        default=9,
        help="fresh `kvscale inspect` / `kvscale --help` processes timed per figure (median)",
    )
    parser.add_argument(
        "--cli",
        action="store_true",
        help="also time one whole `kvscale inspect --json` process, page cache dropped",
    )
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints (printed)")
    args = parser.parse_args()

    from kvscale_plugin.inspection import inspect_checkpoint

    L, S = args.layers, args.shards
    small = (64, 128)
    cases = [
        (f"{L} layers, {S} shards", L, S, args.hidden, args.intermediate),
        (f"{L} layers, {S} shards, small weights", L, S, *small),
        (f"{2 * L} layers, {S} shards, small weights", 2 * L, S, *small),
        (f"{4 * L} layers, {S} shards, small weights", 4 * L, S, *small),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="kvscale-inspect-bench-"))
    try:
        built = []
        for label, layers, shards, hidden, inter in cases:
            ckpt = build(
                tmp / label.replace(" ", "_").replace(",", ""), layers, shards, hidden, inter
            )
            built.append((label, layers, ckpt))
        # Warm imports (torch, compressed-tensors, pluggy rules) outside the timings.
        report = inspect_checkpoint(built[0][2])
        assert report.exit_status == 0, [p.message for p in report.problems]
        assert len(report.layers) == L

        print(
            f"kvscale inspect vs reading the files; median of {args.repeats}, page cache "
            "dropped before each run (cold-ish)"
        )
        kvscale = kvscale_command()
        print(
            f"process ms: the whole `{' '.join(Path(a).name for a in kvscale)} inspect DIR` "
            f"process (warm page cache), median of {args.process_runs}"
        )
        header = (
            f"{'checkpoint':<36}{'tensors':>8}{'MB':>9}{'inspect ms':>12}"
            f"{'(warm) ms':>11}{'process ms':>12}{'read ms':>10}{'inspect/read':>14}"
        )
        print(header)
        print("-" * len(header))
        for label, _layers, ckpt in built:
            size = sum(p.stat().st_size for p in files_of(ckpt))
            rep = inspect_checkpoint(ckpt)
            t_inspect = timed(inspect_checkpoint, ckpt, args.repeats)
            t_warm = timed(inspect_checkpoint, ckpt, args.repeats, cold=False)
            t_process = process_time([*kvscale, "inspect", str(ckpt)], args.process_runs)
            t_read = timed(read_all, ckpt, args.repeats)
            print(
                f"{label:<36}{rep.num_tensors:>8}{size / 1e6:>9.1f}{t_inspect * 1e3:>12.1f}"
                f"{t_warm * 1e3:>11.1f}{t_process * 1e3:>12.1f}{t_read * 1e3:>10.1f}"
                f"{t_inspect / t_read:>14.4f}"
            )
            drop_cache(ckpt)
            inspect_checkpoint(ckpt)
            cached = cached_bytes(ckpt)
            shown = "?" if cached is None else f"{cached:,}"
            print(
                f"{'':<36}inspect read {rep.bytes_read:,} of {rep.total_bytes:,} bytes; "
                f"cached after a cold inspect: {shown} bytes"
            )
        t_help = process_time([*kvscale, "--help"], args.process_runs)
        print(f"{'kvscale --help (the floor)':<76}{t_help * 1e3:>12.1f}")
        if args.cli:
            ckpt = built[0][2]
            drop_cache(ckpt)
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "kvscale_plugin.cli", "inspect", str(ckpt), "--json"],
                capture_output=True,
                text=True,
            )
            wall = time.perf_counter() - t0
            print(
                f"whole CLI process on '{built[0][0]}' (Python start-up and imports "
                f"included): {wall:.2f} s, exit status {proc.returncode}"
            )
        if args.keep:
            print(f"checkpoints kept in {tmp}")
    finally:
        if not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
