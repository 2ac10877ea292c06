"""Whether this platform can run the FP8 KV cache that a declared scheme asks for.

vLLM's CPU build runs an FP8 KV cache only on x86 with AVX-512 or AMX: elsewhere (most
laptops, many cloud VMs, ARM) its CPU attention refuses one at start-up ("FP8 KV cache on
CPU requires x86 with AVX-512 or AMX"), after the model and its scales loaded, and its
other builds of the cache-write op have no FP8 path. Stock vLLM resolves
``--kv-cache-dtype auto`` to FP8 on a declared scheme and then fails there; kvscale chose
that FP8 cache, so where the platform cannot run it, ``auto`` degrades to the model
dtype's cache with one warning (the scales are still loaded, never applied)
-- as kvscale does on SGLang's scale-blind backends. An explicit ``--kv-cache-dtype fp8``
still gets vLLM's own refusal.

The rule is vLLM 0.30-0.34's own (``v1/attention/backends/cpu_attn.py``, ``_get_attn_isa``:
FP8 needs ``torch.cpu._is_amx_tile_supported()`` or ``torch.cpu._is_avx512_supported()``),
asked of torch, not of that private function.
"""

from __future__ import annotations

import torch

#: What the warning says (tests and docs quote it).
DEGRADED = (
    "kvscale: this CPU has neither AVX-512 nor AMX, and vLLM's CPU build runs an FP8 KV "
    "cache only on x86 with AVX-512 or AMX: --kv-cache-dtype auto serves the model "
    "dtype's cache here instead of FP8 (the checkpoint's k/v scales are loaded, not "
    "applied). FP8 runs on a CPU with AVX-512 or AMX, or on a GPU; "
    "--kv-cache-dtype fp8 asks vLLM for it here anyway (vLLM refuses)."
)


def cpu_cannot_run_fp8_cache() -> bool:
    """True on vLLM's CPU platform where the CPU has neither AMX nor AVX-512."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    cpu = torch.cpu
    amx = getattr(cpu, "_is_amx_tile_supported", None)
    avx512 = getattr(cpu, "_is_avx512_supported", None)
    if amx is None or avx512 is None:
        return False  # a torch that cannot tell: leave the choice to vLLM
    return not (amx() or avx512())
