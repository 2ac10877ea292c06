"""Which tests a CPU runs: vLLM's CPU attention runs an FP8 KV cache only on x86 with
AVX-512 or AMX. Tests that need one carry the ``needs_fp8_cpu_cache`` marker (skipped up
front elsewhere, tests/conftest.py); behaviours that do not need FP8 run on ``KV_DTYPE``."""

from __future__ import annotations

import pytest

from kvscale_testing.engines import cpu_runs_fp8_cache

#: Whether this CPU runs vLLM's FP8 KV cache (x86 with AVX-512 or AMX).
CPU_FP8 = cpu_runs_fp8_cache()
FP8_SKIP_REASON = (
    "this CPU has neither AVX-512 nor AMX: vLLM's CPU attention refuses an FP8 KV cache "
    "here (the test needs one)"
)
#: The KV cache a test runs on when what it checks does not need FP8: vLLM's FP8 cache
#: ("auto" on an FP8 checkpoint) where this CPU runs one, else bf16 -- the scales are
#: still loaded, validated and set on the attention layers, only never applied.
KV_DTYPE = "auto" if CPU_FP8 else "bfloat16"
#: The marker: ``@needs_fp8_cpu_cache`` (or ``pytestmark = needs_fp8_cpu_cache``).
needs_fp8_cpu_cache = pytest.mark.needs_fp8_cpu_cache

#: vLLM 0.32's CPU build on a CPU without AVX-512 loads its AVX2 kernels (``vllm._C_AVX2``),
#: and a tensor-parallel engine given token-id prompts then fails in the vocab-parallel
#: embedding ("IndexError: index out of range in self") -- stock vLLM alike, kvscale not
#: loaded (seen with the CPU checks answering "no": ``make test-without-fp8-cpu``).
AVX512_TP_SKIP_REASON = (
    "this CPU has neither AVX-512 nor AMX: vLLM's AVX2 kernels fail tensor-parallel engines "
    "on token-id prompts (IndexError in the vocab-parallel embedding, stock vLLM alike)"
)
#: The marker for those: ``@needs_avx512_cpu_for_tp``.
needs_avx512_cpu_for_tp = pytest.mark.needs_avx512_cpu_for_tp

#: The marker of a test whose cache follows the CPU (``KV_DTYPE``): it reaches vLLM's FP8
#: CPU path where the CPU runs one, so it declares so (tests/support/amx_site/
#: kvscale_fp8_guard.py fails an undeclared one on every machine), and `make
#: test-without-fp8-cpu` selects it to run its other branch.
follows_cpu_fp8 = pytest.mark.follows_cpu_fp8
