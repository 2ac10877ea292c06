"""vLLM attention backend whose FP8 KV-cache write is kvscale's fused kernel.

Select it with ``--attention-backend CUSTOM`` (``vllm.LLM(...,
attention_backend="CUSTOM")``): ``register_backend()`` runs in every process that builds a
kvscale engine (the ``custom-backend`` feature, ``activation``); a stock engine never
has it.
It is vLLM's Triton attention backend in every respect but one: for a layer
whose KV method is kvscale's and whose cache is FP8 e4m3, the cache write
(``do_kv_cache_update``) goes through ``kvscale_plugin.kernels.triton_fp8_write``,
which reads ``layer._k_scale`` / ``layer._v_scale`` on the device at every call
(CUDA-graph replays and in-place reloads see the current scales). Every other
layer, cache dtype and platform is left to the parent class untouched.

Loading this module imports nothing from vLLM. The backend classes, and with
them vLLM's Triton backend and our kernel, are built on first attribute access
(PEP 562 ``__getattr__``), which is how vLLM resolves the registered class
path. Registration therefore stays cheap in processes that never build an
attention layer (the API server), and on the CPU platform, which ignores the
selection, nothing but one registry entry changes.
"""

from __future__ import annotations

from typing import Any

from kvscale_plugin._log import info_once, logger, warn_once
from kvscale_plugin.hosts.vllm.layers import is_kvscale_layer
from kvscale_plugin.hosts.vllm.process import HOST

BACKEND_NAME = "CUSTOM"
BACKEND_CLASS_PATH = f"{__name__}.KVScaleTritonAttentionBackend"
"""What ``AttentionBackendEnum.CUSTOM`` resolves to once registered."""

_CLASS_NAMES = ("KVScaleTritonAttentionBackend", "KVScaleTritonAttentionImpl")


def register_backend() -> bool:
    """Make ``--attention-backend CUSTOM`` select kvscale's Triton backend.

    Idempotent and cheap (imports vLLM's backend registry only). Returns True
    when ``AttentionBackendEnum.CUSTOM`` points at our backend afterwards,
    False when another package already owns ``CUSTOM`` (left as it is, with one
    warning) or this vLLM has no ``CUSTOM`` slot.
    """
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum
        from vllm.v1.attention.backends.registry import register_backend as vllm_register

        custom = AttentionBackendEnum.CUSTOM
    except (ImportError, AttributeError) as exc:
        warn_once(
            "vllm-backend-unavailable",
            "kvscale: this vLLM has no AttentionBackendEnum.CUSTOM (%s); the fused FP8 "
            "cache write is unavailable and vLLM's own cache write is used.",
            exc,
        )
        return False
    if custom.is_overridden():
        current = custom.get_path()
        if current == BACKEND_CLASS_PATH:
            return True
        warn_once(
            "vllm-backend-taken",
            "kvscale: AttentionBackendEnum.CUSTOM is already registered to %s; not "
            "replacing it. '--attention-backend CUSTOM' will select that backend, not "
            "kvscale's fused FP8 cache write.",
            current,
        )
        return False
    vllm_register(custom, BACKEND_CLASS_PATH)
    return True


def __getattr__(name: str) -> Any:
    if name in _CLASS_NAMES:
        return _build_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_PER_HEAD_NOT_OURS = (
    "kvscale: layer {} has per-head KV scales but is not served by kvscale; the CUSTOM "
    "backend (vLLM's Triton attention) reads one scale per layer and would mis-scale every "
    "head but the first. Serve the checkpoint with --quantization kvscale, or choose "
    "another attention backend."
)


def _announce_per_head_max() -> None:
    info_once(
        "custom-backend-per-head",
        "kvscale: per-head KV scales on the CUSTOM backend: vLLM's Triton attention takes "
        "one scale per layer, so each layer's FP8 cache is written and read with the max "
        "over its heads (nothing clips).",
    )


def _build_classes() -> dict[str, type]:
    with HOST.lock:
        if not HOST.backend_classes:
            HOST.backend_classes.update(_define_classes())
    return HOST.backend_classes


def _define_classes() -> dict[str, type]:
    import torch
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
    )
    from vllm.v1.kv_cache_interface import KVQuantMode

    from kvscale_plugin.kernels import fp8_cache_write as kernel
    from kvscale_plugin.kernels import use_hardware_conversion

    if HOST.fp8_cache_write is None:
        HOST.fp8_cache_write = kernel

    input_dtypes = (torch.bfloat16, torch.float16, torch.float32)
    logged: set[str] = set()

    class KVScaleTritonAttentionImpl(TritonAttentionImpl):
        """Triton attention; kvscale layers with an FP8 e4m3 cache write through our kernel."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            # The static half of the routing decision, settled once per layer so
            # that the per-step check is two attribute reads. Our kernel writes
            # e4m3fn with per-tensor or per-head scales only: e5m2, ROCm's fnuz
            # formats and per-token-head caches stay with the parent, as do
            # encoder layers (which have no cache).
            self.kvscale_cache_ok = (
                self.kv_cache_dtype in ("fp8", "fp8_e4m3")
                and self.fp8_dtype == torch.float8_e4m3fn
                and self._kv_quant_mode == KVQuantMode.FP8_PER_TENSOR
                and self.attn_type not in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER)
            )

        def do_kv_cache_update(
            self,
            layer: torch.nn.Module,
            key: torch.Tensor,
            value: torch.Tensor,
            kv_cache: torch.Tensor,
            slot_mapping: torch.Tensor,
        ) -> None:
            per_head = layer._k_scale.numel() > 1
            ours = is_kvscale_layer(layer)
            if per_head and not ours and self.kvscale_cache_ok:
                raise RuntimeError(_PER_HEAD_NOT_OURS.format(getattr(layer, "layer_name", "?")))
            if not (self.kvscale_cache_ok and ours and key.dtype in input_dtypes):
                super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
                return
            if "ours" not in logged:
                logged.add("ours")
                logger.info(
                    "kvscale: FP8 KV cache written by the fused kernel (%s conversion).",
                    "hardware" if use_hardware_conversion(key.device) else "software",
                )
            # Same views as the parent: (blocks, heads, slots, 2*hs) ->
            # (blocks, slots, heads, hs) halves for K and V. key/value may hold
            # more (CUDA-graph padding) rows than slot_mapping; the kernel writes
            # len(slot_mapping) tokens, as vLLM's kernels do.
            key_cache, value_cache = kv_cache.transpose(1, 2).split(self.head_size, dim=-1)
            if per_head:
                # vLLM's Triton attention reads one k/v scale per layer (the first
                # element): per-head layers are written and read with the layer max.
                _announce_per_head_max()
                k_scale, v_scale = layer._kvscale_k_max, layer._kvscale_v_max
            else:
                k_scale, v_scale = layer._k_scale, layer._v_scale
            HOST.fp8_cache_write(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)

        def forward(self, layer: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not (
                self.kvscale_cache_ok and layer._k_scale.numel() > 1 and is_kvscale_layer(layer)
            ):
                return super().forward(layer, *args, **kwargs)
            # The same per-layer max the cache was written with, for the read.
            saved = layer._k_scale, layer._v_scale
            layer._k_scale, layer._v_scale = layer._kvscale_k_max, layer._kvscale_v_max
            try:
                return super().forward(layer, *args, **kwargs)
            finally:
                layer._k_scale, layer._v_scale = saved

    class KVScaleTritonAttentionBackend(TritonAttentionBackend):
        """vLLM's Triton attention backend with kvscale's fused FP8 cache write."""

        @staticmethod
        def get_name() -> str:
            # vLLM maps the name back to the enum (AttentionBackendEnum[name]).
            return BACKEND_NAME

        @staticmethod
        def get_impl_cls() -> type[KVScaleTritonAttentionImpl]:
            return KVScaleTritonAttentionImpl

        @classmethod
        def supports_per_head_quant_scales(cls) -> bool:
            # kvscale's per-head layers are served with the per-layer max (write and
            # read); any other per-head layer is refused at its first cache write.
            return True

    classes: dict[str, type] = {
        "KVScaleTritonAttentionBackend": KVScaleTritonAttentionBackend,
        "KVScaleTritonAttentionImpl": KVScaleTritonAttentionImpl,
    }
    for cls_name, cls in classes.items():
        # Defined inside a function, but addressed (by vLLM's class path and by
        # pickle) as module attributes.
        cls.__qualname__ = cls_name
    return classes
