"""Test processes only: a test that reaches vLLM's FP8 CPU path must say so.

vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX; elsewhere (most
laptops, many cloud VMs) its CPU attention refuses one ("FP8 KV cache on CPU requires x86
with AVX-512 or AMX") and its AVX2 kernels have no FP8 cache write at all ("Unsupported
CPU attention configuration: ... isa=1 kv_cache_idx=1"). A test that needs that path
carries ``needs_fp8_cpu_cache`` (skipped up front on such a CPU); a test whose cache follows
the CPU (``kvscale_testing.skips.KV_DTYPE``) carries ``follows_cpu_fp8`` (and its other
branch is run by ``make test-without-fp8-cpu``). Any other test that gets there would fail
on such a CPU, so it fails here too, on every machine, naming the marker to add.

The two places every FP8 use of vLLM's CPU build goes through are guarded:
``vllm.v1.attention.backends.cpu_attn._get_attn_isa`` with an FP8 ``kv_cache_dtype`` (where
an engine's FP8 cache is accepted or refused) and vLLM's CPU cache-write op
``cpu_attn_reshape_and_cache`` with an FP8 ``kv_cache_dtype`` (``vllm._custom_ops``;
``vllm._cpu_ops`` from 0.34), also called directly by tests.

``install()`` puts the guard on ``sys.meta_path`` (the test session's process: from
tests/conftest.py; every process it starts: from sitecustomize.py, when
``KVSCALE_TEST_FP8_GUARD=1`` is inherited). The running test's declaration travels in
``KVSCALE_TEST_FP8_DECLARED`` (set by tests/conftest.py around each test, so engine
processes a test starts inherit it); each hit is also written to
``KVSCALE_TEST_FP8_GUARD_LOG``, so that a test which swallows the error (``pytest.raises
(Exception)``) still fails. Where torch says the CPU has neither AVX-512 nor AMX, the guard
steps aside: vLLM's own refusal is what a test there meets.
"""

from __future__ import annotations

import functools
import importlib.machinery
import os
import sys
from typing import Any

ENV_ON = "KVSCALE_TEST_FP8_GUARD"
ENV_DECLARED = "KVSCALE_TEST_FP8_DECLARED"
ENV_LOG = "KVSCALE_TEST_FP8_GUARD_LOG"
MARKERS = ("needs_fp8_cpu_cache", "follows_cpu_fp8")

#: module -> (function, the position of its ``kv_cache_dtype`` argument)
GUARDED = {
    "vllm.v1.attention.backends.cpu_attn": ("_get_attn_isa", 3),
    "vllm._custom_ops": ("cpu_attn_reshape_and_cache", 8),
    "vllm._cpu_ops": ("cpu_attn_reshape_and_cache", 8),
}


class Fp8CpuPathNotDeclared(RuntimeError):
    """A test reached vLLM's FP8 CPU path without declaring it."""


def _cpu_runs_fp8() -> bool:
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def _check(where: str, kv_cache_dtype: Any) -> None:
    if not isinstance(kv_cache_dtype, str) or not kv_cache_dtype.startswith("fp8"):
        return
    if os.environ.get(ENV_ON) != "1" or os.environ.get(ENV_DECLARED):
        return
    if not _cpu_runs_fp8():
        return  # vLLM refuses by itself here: that refusal is what the test meets
    message = (
        f"this test reaches vLLM's FP8 CPU path ({where}, kv_cache_dtype={kv_cache_dtype!r}) "
        "without declaring it: on a CPU without AVX-512 / AMX it fails. Mark it "
        "`needs_fp8_cpu_cache` (kvscale_testing.skips) if it checks FP8 behaviour, or run "
        "it on `KV_DTYPE` and mark it `follows_cpu_fp8`, or give it a bf16 cache."
    )
    log = os.environ.get(ENV_LOG)
    if log:
        try:
            with open(log, "a", encoding="utf-8") as out:
                out.write(f"pid {os.getpid()}: {message}\n")
        except OSError:
            pass
    raise Fp8CpuPathNotDeclared(message)


def _guard(module: Any, function: str, position: int) -> None:
    original = getattr(module, function, None)
    if original is None or getattr(original, "__kvscale_fp8_guard__", False):
        return
    where = f"{module.__name__}.{function}"

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        dtype = kwargs.get("kv_cache_dtype", args[position] if len(args) > position else None)
        _check(where, dtype)
        return original(*args, **kwargs)

    guarded.__kvscale_fp8_guard__ = True  # type: ignore[attr-defined]
    setattr(module, function, guarded)


class _GuardFinder:
    """A meta-path entry that lets each guarded module import, then wraps its function."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in GUARDED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        function, position = GUARDED[name]

        def exec_and_guard(module: Any) -> None:
            exec_module(module)
            _guard(module, function, position)

        spec.loader.exec_module = exec_and_guard  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Guard this process (idempotent); modules imported already are wrapped now."""
    os.environ[ENV_ON] = "1"
    if not any(isinstance(f, _GuardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _GuardFinder())
    for name, (function, position) in GUARDED.items():
        if name in sys.modules:
            _guard(sys.modules[name], function, position)
