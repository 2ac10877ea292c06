"""SGLang attention backends that ignore KV scales, and what kvscale does on them.

In SGLang 0.5.23 the KV scales reach an FP8 cache only through the attention backend:
it passes ``layer.k_scale`` / ``v_scale`` (or their ``*_float``) to the pool's
``set_kv_buffer`` on writes and hands them to its kernels on reads; the pool itself
divides only by what it is given. The backends below call ``set_kv_buffer(layer, loc,
k, v)`` with no scale and read the cache with none, so an FP8 cache on them holds K and
V at scale 1.0 whatever the checkpoint calibrated: values beyond FP8's range saturate,
small ones lose their precision, and nothing says so. (On a CPU SGLang refuses an FP8
cache on any backend but ``intel_amx``, which applies the scales; these matter on GPUs.)

kvscale does not serve that quietly wrong cache:

* ``--kv-cache-dtype auto`` (the FP8 cache would be kvscale's own choice): kvscale
  keeps the cache in the model dtype instead, with one warning naming the backend and
  the backends that apply the scales.
* an explicit FP8 ``--kv-cache-dtype``: start-up is refused with that message (the
  user asked for two things that cannot both hold).
* any other ``--kv-cache-dtype``: nothing to do.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

#: Backend name (``--attention-backend``) -> the SGLang 0.5.23 module whose
#: ``set_kv_buffer`` calls pass no k/v scale and whose attention reads none.
SCALE_BLIND_BACKENDS = {
    "torch_native": "sglang.srt.layers.attention.torch_native_backend",
    "flex_attention": "sglang.srt.layers.attention.torch_flex_backend",
    "wave": "sglang.srt.layers.attention.wave_backend",
    "qsa": "sglang.srt.layers.attention.qwen_sparse_attn_backend",
}
#: Backends that pass the layer's scales to the cache write (named in the advice).
SCALE_APPLYING_BACKENDS = {
    "triton": "sglang.srt.layers.attention.triton_backend",
    "fa3": "sglang.srt.layers.attention.flashattention_backend",
    "flashinfer": "sglang.srt.layers.attention.flashinfer_backend",
    "trtllm_mha": "sglang.srt.layers.attention.trtllm_mha_backend",
    "intel_amx": "sglang.srt.layers.attention.intel_amx_backend",
}
_ADVICE = (
    "use an attention backend that applies them (--attention-backend triton, fa3, "
    "flashinfer or trtllm_mha on NVIDIA GPUs; intel_amx on CPUs with AMX)"
)


class BackendAction(Enum):
    """What kvscale does about the KV cache, given the attention backends."""

    SERVE = "serve"  # nothing to change
    MODEL_DTYPE = "model_dtype"  # auto: keep the cache in the model dtype, warn once
    REFUSE = "refuse"  # explicit FP8: refuse to start


@dataclass(frozen=True)
class BackendVerdict:
    action: BackendAction
    #: The configured backends that ignore KV scales (empty for SERVE).
    blind: tuple[str, ...] = ()
    message: str | None = None


def judge_attention_backends(
    requested_kv_cache_dtype: str | None, backends: Iterable[str | None]
) -> BackendVerdict:
    """kvscale's decision for a supported FP8 scheme served through ``backends``
    (SGLang's ``(prefill, decode)`` pair) with ``--kv-cache-dtype``
    ``requested_kv_cache_dtype`` (None: not known, taken as ``auto``)."""
    requested = requested_kv_cache_dtype or "auto"
    if requested != "auto" and not requested.startswith("fp8"):
        return BackendVerdict(BackendAction.SERVE)
    blind = tuple(dict.fromkeys(b for b in backends if b in SCALE_BLIND_BACKENDS))
    if not blind:
        return BackendVerdict(BackendAction.SERVE)
    names = " and ".join(blind)
    verbs = "backends write and read" if len(blind) > 1 else "backend writes and reads"
    what = (
        f"SGLang's {names} attention {verbs} the FP8 KV cache without the layers' "
        "k/v scales (SGLang passes none to set_kv_buffer there), so the checkpoint's "
        "calibrated KV scales would be ignored (K and V stored at scale 1.0)"
    )
    if requested == "auto":
        return BackendVerdict(
            BackendAction.MODEL_DTYPE,
            blind,
            f"kvscale: {what}; kvscale keeps the KV cache in the model dtype instead of FP8. "
            f"For an FP8 KV cache with the checkpoint's scales, {_ADVICE}.",
        )
    return BackendVerdict(
        BackendAction.REFUSE,
        blind,
        f"kvscale: --kv-cache-dtype {requested} with --quantization kvscale: {what}. "
        f"To serve the checkpoint's scales, {_ADVICE}; or drop --kv-cache-dtype (kvscale "
        "then keeps the KV cache in the model dtype on this backend).",
    )


def configured_attention_backends() -> tuple[str | None, ...]:
    """SGLang's configured ``(prefill, decode)`` attention backends in this process, or
    ``()`` outside a server (nothing published) or on a SGLang without the accessor."""
    try:
        from sglang.srt.runtime_context import attention_backends, get_context

        if not get_context().is_config_namespace_published("exec"):
            return ()
        return tuple(attention_backends())
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return ()
