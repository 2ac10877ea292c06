"""The compiled FP8 cache write for vLLM's CPU layout (``cpu_fp8_write.c``).

The plain-torch write (``cpu_cache_write``) needs six torch ops per layer and a plan
per step; at decode sizes their per-op overhead is its whole cost. The same contract
written as one C loop costs one call, less than vLLM's own (truncating) write:
``write_native`` quantizes K and V
(``(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)``, bit for bit) straight
into the cache bytes, slots < 0 skipped, with no temporary tensors.

The C file ships with the package and is compiled on first use with the machine's C
compiler (``$CC``, else Python's own, ``cc``, ``gcc`` or ``clang``) into
``$KVSCALE_NATIVE_DIR`` or ``$XDG_CACHE_HOME/kvscale-plugin/native`` (``~/.cache``),
keyed by the source, the compiler (command and version), the flags, the Python ABI and
the CPU; later processes load the built file (a few milliseconds, with its self-test).
It is a plain CPython extension: no torch headers, so the build takes about a second
(Triton does the same for its GPU launchers). Without a working compiler (or Python
headers), or if the built file fails its checks, ``load()`` returns None and says why
once; the host then uses the plain-torch write, which stores the same bytes.

No host import: pure torch + the standard library.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from kvscale_plugin._log import logger, warn_once

SOURCE = Path(__file__).with_name("cpu_fp8_write.c")
MODULE_NAME = "_kvscale_cpu_fp8"
DIR_ENV = "KVSCALE_NATIVE_DIR"
"""Environment variable: where the compiled write is kept (default: the user cache)."""

# IEEE arithmetic is part of the contract: never -ffast-math / -Ofast here.
# -fno-trapping-math only lets the compiler turn the NaN-keeping clamp into selects
# (vectorized); results are unchanged. The build is for this machine's CPU
# (-march=native, measured 3x faster than the x86-64 baseline): the CPU's identity is
# part of the cache key, and a compiler that refuses the flag builds without it.
CFLAGS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-fno-fast-math",
    "-fno-trapping-math",
    "-ffp-contract=off",
    "-std=c99",
)
NATIVE_FLAGS = ("-march=native",)

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Decision(NamedTuple):
    """What ``load()`` decided in this process: the module, or None and why not."""

    module: ModuleType | None
    failure: str | None = None


#: This process's decision, made on first use; a test installs None to decide again.
decision: Decision | None = None
_lock = threading.Lock()


def _compiler() -> list[str] | None:
    for candidate in (os.environ.get("CC"), sysconfig.get_config_var("CC"), "cc", "gcc", "clang"):
        if not candidate:
            continue
        argv = shlex.split(candidate)
        if argv and shutil.which(argv[0]):
            return argv
    return None


def build_dir() -> Path:
    """``$KVSCALE_NATIVE_DIR``, else ``$XDG_CACHE_HOME/kvscale-plugin/native``
    (``~/.cache/...``)."""
    explicit = os.environ.get(DIR_ENV)
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscale-plugin" / "native"


def _build_dirs() -> list[Path]:
    """Where to look and build, in order: ``build_dir()``, then (unless
    ``$KVSCALE_NATIVE_DIR`` is set) a per-user folder in the temp dir, for a home that
    cannot be written."""
    if os.environ.get(DIR_ENV):
        return [build_dir()]
    user = getattr(os, "getuid", lambda: "user")()
    return [build_dir(), Path(tempfile.gettempdir()) / f"kvscale-plugin-native-{user}"]


def _build(compiler: list[str], target: Path) -> None:
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").is_file():
        raise RuntimeError(f"Python headers not found ({include}/Python.h)")
    # Private folders (0700): a shared temp dir must not let anyone else plant the file.
    target.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Build beside the target, then rename: processes starting together (vLLM's TP
    # workers) never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=target.suffix, dir=target.parent)
    os.close(fd)
    try:
        errors = []
        for extra in (NATIVE_FLAGS, ()):
            cmd = [*compiler, *CFLAGS, *extra, f"-I{include}", str(SOURCE), "-o", tmp]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            except (OSError, subprocess.SubprocessError) as exc:
                raise RuntimeError(f"cannot run the C compiler `{compiler[0]}`: {exc}") from exc
            if proc.returncode == 0:
                os.replace(tmp, target)
                return
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            errors.append(f"`{shlex.join(cmd)}` failed: " + " | ".join(tail))
        raise RuntimeError("; ".join(errors))
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and feature flags (Linux), else
    the platform's own description."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read(1 << 16).splitlines() if ":" in ln]
        keep = ("model name", "flags", "Features", "CPU part", "CPU implementer")
        return "\n".join(ln for ln in lines if ln.split(":")[0].strip() in keep)
    except OSError:
        import platform

        return f"{platform.machine()} {platform.processor()}"


@functools.cache
def _compiler_version(compiler: tuple[str, ...]) -> str:
    try:
        proc = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=30)
        return proc.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _target_path(compiler: list[str], base: Path | None = None) -> Path:
    return (base or build_dir()) / _build_name(tuple(compiler))


@functools.cache
def _build_name(compiler: tuple[str, ...]) -> str:
    """``<hash>/<module file>``: what the built file depends on, computed once."""
    digest = hashlib.sha256()
    digest.update(SOURCE.read_bytes())
    digest.update(_compiler_version(tuple(compiler)).encode())
    digest.update(
        repr((compiler, CFLAGS, NATIVE_FLAGS, sys.version, sysconfig.get_platform())).encode()
    )
    digest.update(_cpu_identity().encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return f"{digest.hexdigest()[:16]}/{MODULE_NAME}{suffix}"


def _check_private(path: Path) -> None:
    """Refuse to load a file that someone else could have written: the file and the two
    folders above it (``<dir>/<hash>/``) must belong to this user and be writable by
    nobody else (POSIX; elsewhere nothing to check)."""
    getuid = getattr(os, "getuid", None)
    if getuid is None:
        return
    for item in (path, path.parent, path.parent.parent):
        st = item.stat()
        if st.st_uid != getuid() or st.st_mode & 0o022:
            raise RuntimeError(
                f"{item} belongs to another user or is writable by others; not loading "
                f"{path.name} from there (remove it, or set {DIR_ENV} to a private folder)"
            )


# Inputs that catch a miscompiled conversion (a compiler or $CC flags that ignore IEEE
# rules): e4m3 ties, subnormals, the saturation edge, NaN, +-0, at scales that round.
_PROBE_VALUES = [0.0, -0.0, float("nan"), float("inf"), 1.0625, 1.1875, 1.3125, 17.0, 19.0]
_PROBE_VALUES += [2.0**-9 * k for k in (0.5, 1.0, 1.5, 2.5, 3.0, 7.5)]
_PROBE_VALUES += [440.0, 448.0, 449.0, 464.0, 479.9, 480.0, 1000.0, 1.6016, 0.123, 3e38]


def _self_test(module: ModuleType) -> None:
    """The built module must store torch's own bytes on tricky inputs before it is used."""
    from kvscale_plugin.kernels.cpu_cache_write import cpu_fp8_cache_read
    from kvscale_plugin.kernels.reference import quantize_e4m3_reference

    base = torch.tensor(_PROBE_VALUES + [-v for v in _PROBE_VALUES], dtype=torch.float32)
    heads, head_size, block_size = 1, 32, 32
    values = torch.cat([base, torch.linspace(-600.0, 600.0, 64 * 32 - base.numel())])
    n = values.numel() // head_size
    for dtype in DTYPES:
        x = values.to(dtype).view(n, heads, head_size)
        for scale in (1.0, 0.37, 3.8627140522003174, 2.0**-7):
            cache = torch.zeros(
                n // block_size, heads, block_size, 2 * head_size, dtype=torch.uint8
            )
            slots = torch.arange(n)
            write_native(module, x, x, native_target(cache), slots, scale, scale)
            want = quantize_e4m3_reference(x, torch.tensor([scale])).view(torch.uint8)
            k_bytes, v_bytes = cpu_fp8_cache_read(cache, slots)
            bad = int((k_bytes != want).sum()) + int((v_bytes != want).sum())
            if bad:
                raise RuntimeError(
                    f"the built module stores {bad} of {2 * want.numel()} {dtype} values at "
                    f"scale {scale} differently from torch (a compiler or CC flags that "
                    "do not keep IEEE arithmetic?)"
                )


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load() -> ModuleType | None:
    """The compiled module (built on first use), or None when it cannot be built here
    (the reason is logged once and kept in ``failure()``). Decided once per process."""
    global decision
    if decision is None:
        with _lock:
            if decision is None:
                decision = _decide()
    return decision.module


def _decide() -> Decision:
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C compiler found (set CC, or install cc/gcc/clang)")
        unwritable = []
        for base in _build_dirs():
            path = _target_path(compiler, base)
            try:
                if not path.is_file():
                    logger.info("kvscale: compiling the CPU FP8 cache write into %s", path.parent)
                    _build(compiler, path)
                break
            except OSError as exc:  # a folder that cannot be written: the next one
                unwritable.append(f"{base}: {exc}")
        else:
            raise RuntimeError("no folder to build in: " + "; ".join(unwritable))
        _check_private(path)
        try:
            candidate = _import(path)
        except (ImportError, OSError) as exc:  # a damaged file: build it once more
            logger.info("kvscale: rebuilding %s (%s)", path, exc)
            _build(compiler, path)
            candidate = _import(path)
        candidate.setup(torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64)
        _self_test(candidate)
        return Decision(candidate)
    except Exception as exc:  # noqa: BLE001 - any failure: the torch write instead
        failure = f"{type(exc).__name__}: {exc}"
        warn_once(
            "cpu-native-build",
            "kvscale: the compiled CPU FP8 cache write is not available (%s); the "
            "plain-torch write is used (same bytes, slower at decode sizes). For the "
            "compiled one, set CC to a working C compiler (Python's headers "
            "installed); KVSCALE_CPU_FP8_WRITE=rne-torch selects the plain-torch "
            "write without this warning.",
            failure,
        )
        return Decision(None, failure)


def failure() -> str | None:
    """Why ``load()`` returned None in this process (None if it did not)."""
    return decision.failure if decision is not None else None


class NativeTarget(NamedTuple):
    """One layer's CPU cache as the compiled write addresses it (``native_target``)."""

    cache: torch.Tensor
    """The cache tensor itself: holding it keeps ``spec``'s pointer valid."""
    spec: tuple[int, int, int, int, int, int, int]
    """``(data pointer, block stride, head stride, num_blocks, block_size,
    num_kv_heads, head_size)``, strides in bytes: what the C write is given."""


def native_target(kv_cache: torch.Tensor, layout: str = "vec") -> NativeTarget:
    """Checks one layer's cache (as ``cpu_cache_write.cpu_cache_views``: 4-d, 1-byte,
    each (block, head) contiguous, on the CPU; ``layout`` one of its ``LAYOUTS``) for the
    compiled write."""
    from kvscale_plugin.kernels.cpu_cache_write import cpu_cache_views

    cpu_cache_views(kv_cache, layout)
    if kv_cache.device.type != "cpu":
        raise ValueError(f"the compiled FP8 write needs a CPU cache, got {kv_cache.device}")
    raw = kv_cache.view(torch.uint8)
    num_blocks, num_heads, block_size, two_hs = raw.shape
    spec = (
        raw.data_ptr(),
        raw.stride(0),
        raw.stride(1),
        num_blocks,
        block_size,
        num_heads,
        two_hs // 2,
    )
    return NativeTarget(kv_cache, spec)


def write_native(
    module: ModuleType,
    key: torch.Tensor,
    value: torch.Tensor,
    target: NativeTarget,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
) -> int:
    """The hot path: one C call for K and V of ``len(slot_mapping)`` tokens.

    ``key`` / ``value``: ``[>= num_tokens, num_kv_heads, head_size]`` CPU tensors of
    one dtype among bf16 / fp16 / fp32, last dimension contiguous (slices of a fused
    qkv tensor are fine); ``slot_mapping``: contiguous 1-d int32 / int64. Returns how
    many tokens were written (slots >= 0). The C side checks shapes, strides and
    dtypes before it reads any pointer (``ValueError``) and every slot against the
    cache's size before it writes (``IndexError``).
    """
    if not (key.is_cpu and value.is_cpu and slot_mapping.is_cpu):
        raise ValueError("the compiled FP8 write needs CPU tensors")
    return module.write(
        key.data_ptr(),
        key.shape,
        key.stride(),
        key.dtype,
        value.data_ptr(),
        value.shape,
        value.stride(),
        value.dtype,
        target.spec,
        slot_mapping.data_ptr(),
        slot_mapping.shape,
        slot_mapping.stride(),
        slot_mapping.dtype,
        float(k_scale),
        float(v_scale),
    )


def cpu_fp8_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    layout: str = "vec",
) -> None:
    """``cpu_cache_write.cpu_fp8_cache_write`` done by the compiled write (``load()``;
    ``RuntimeError`` where it is not available): ``native_target`` + ``write_native`` in
    one call, for checks (a host keeps the target per layer instead)."""
    module = load()
    if module is None:
        raise RuntimeError(f"the compiled FP8 write is not available: {failure()}")
    target = native_target(kv_cache, layout)
    write_native(module, key, value, target, slot_mapping, k_scale, v_scale)
