"""The load cycle's policy, decided once for every host: does a layer serve the
checkpoint's k/v scales?

A layer's cache serves checkpoint scales when it is a statically quantized cache
(FP8 with one scale per layer or per head) and the scheme allows it: a supported scheme,
or -- where the host's stock code does so (vLLM) -- no scheme and an FP8 cache the user
asked for. Caches that compute their scales on the fly (vLLM's ``fp8_per_token_head`` and
the int8 / int4 per-token-head modes) and layers kept out of the quantized cache
(``--kv-cache-dtype-skip-layers``: their dtype is the model's) never do: their checkpoint
scales are neither applied nor validated as served.

Pure: hosts hand in their layer's cache dtype and whether the host counts it as quantized.
"""

from __future__ import annotations

from kvscale_plugin.scheme import SchemeVerdict

#: Cache dtypes (suffix) whose scales are computed per token and head as the cache is written.
DYNAMIC_SUFFIX = "per_token_head"


def computes_own_scales(cache_dtype: str) -> bool:
    """The cache quantizes with scales it computes itself (checkpoint scales unused)."""
    return str(cache_dtype).endswith(DYNAMIC_SUFFIX)


def serves_checkpoint_scales(verdict: SchemeVerdict, cache_dtype: str, *, quantized: bool) -> bool:
    """Whether a layer whose cache is ``cache_dtype`` (``quantized``: the host says it is
    a quantized cache) serves the checkpoint's k/v scales: a supported scheme, or no
    scheme and an FP8 cache the user chose (vLLM's stock code loads per-tensor scales
    then; SGLang builds no KV method without a scheme, so it never asks)."""
    if not quantized or computes_own_scales(cache_dtype):
        return False
    return verdict.supported or not verdict.declared


def dynamic_scales_notice(cache_dtype: str) -> str:
    """The one line said (once per engine) for a cache that computes its own scales."""
    return (
        f"kvscale: --kv-cache-dtype {cache_dtype} computes its k/v scales per token and head "
        "as it writes the cache: the checkpoint's k/v scales are not used (nor checked)."
    )
