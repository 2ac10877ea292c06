"""When a test's failure is vLLM refusing an FP8 cache on a CPU that cannot run one (the
only failure the suite reports as a skip), and when it is not."""

from __future__ import annotations

from typing import Any

from kvscale_plugin.demo.probe import FP8_CPU_REFUSAL
from kvscale_testing.engines import cpu_runs_fp8_cache

#: Whether this CPU runs vLLM's FP8 KV cache (x86 with AVX-512 or AMX).
CPU_FP8 = cpu_runs_fp8_cache()
#: vLLM's own CPU cache-write op has no FP8 kernel there either (kv_cache_idx 1).
FP8_CPU_OP_REFUSAL = ("Unsupported CPU attention configuration", "kv_cache_idx=1")
FP8_SKIP_REASON = (
    "this CPU has neither AVX-512 nor AMX: vLLM's CPU attention refuses an FP8 KV cache "
    "here (the test needs one)"
)


def _refusal_text(text: str) -> bool:
    return FP8_CPU_REFUSAL in text or all(part in text for part in FP8_CPU_OP_REFUSAL)


def is_fp8_cpu_refusal(excinfo: Any) -> bool:
    """Whether a test failed because vLLM refused an FP8 cache: its exception (or one in
    that exception's cause / context chain) is not an assertion and carries vLLM's refusal
    text. A failed ``assert`` never is -- also one whose message quotes the refusal."""
    if excinfo is None or excinfo.errisinstance(AssertionError):
        return False
    exc: BaseException | None = excinfo.value
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, AssertionError):
            return False
        if _refusal_text(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False
