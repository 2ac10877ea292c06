"""kvscale's round-to-nearest-even FP8 KV-cache write for kvscale layers on vLLM's CPU
platform: the vLLM adapter of ``kvscale_plugin.kernels.cpu_cache_write`` (the contract,
vLLM's "vec" cache layout, the plain-torch write) and ``kvscale_plugin.kernels.cpu_native``
(the same write compiled, the default); ``KVSCALE_CPU_FP8_WRITE`` (``ENV_VAR``) chooses.

vLLM's CPU attention writes an FP8 cache with a truncating op. For attention layers
served by kvscale with an FP8 e4m3 cache, ``serve_layer`` routes the CPU backend's
cache-update step, ``CPUAttentionBackendImpl.do_kv_cache_update``, to kvscale's write,
which stores the contract's values at the positions vLLM's CPU attention reads, quantized
with the same Python-float scales that attention dequantizes with
(``layer._k_scale_float`` / ``_v_scale_float``). The attention itself is vLLM's,
unchanged. The compiled write is used where it builds (else one warning, and the
plain-torch write, whose per-step plan is shared by all layers of one vLLM forward step:
``_planned_write``). ``KVSCALE_CPU_FP8_WRITE`` is read when a layer first writes.

The CPU platform ignores ``--attention-backend`` (its ``get_attn_backend_cls`` returns
CPU_ATTN whatever was selected), so no registered backend can be chosen there. Instead,
each attention layer served by kvscale gets, when its KV method processes it
(``serve_layer``), an impl whose class is a subclass of vLLM's with kvscale's
``do_kv_cache_update``; vLLM's class is never changed, and an engine without
``--quantization kvscale`` runs vLLM's own write. The subclass hands every call it does
not own to vLLM's method: layers not served by kvscale, caches that
are not FP8 e4m3 (bf16, e5m2), encoder attention, input dtypes other than
bf16 / fp16 / fp32, and cache layouts other than the one proven here ("vec"). A layout
is also checked against vLLM's own op on a scratch cache before its first use
(``layout_matches_vllm``); if the bytes disagree, vLLM's write is kept with one warning.

Each impl keeps the route it took per input dtype (``_route``), named by implementation
and layout: ``"c:vec"``, ``"torch:vec"``; None is vLLM's write.

The kernel modules are imported only in processes that write a kvscale FP8 cache: when a
kvscale layer first writes.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvscale_plugin._log import logger, warn_once
from kvscale_plugin.hosts.vllm.layers import is_kvscale_layer
from kvscale_plugin.hosts.vllm.process import HOST

if TYPE_CHECKING:
    from kvscale_plugin.kernels.cpu_cache_write import HeldTarget, StepPlans

_ORIGINAL_ATTR = "__kvscale_original__"
_ROUTE_ATTR = "_kvscale_cpu_write_route"
_TARGET_ATTR = "_kvscale_cpu_cache_target"
_FP8_E4M3_CACHE_DTYPES = ("fp8", "fp8_e4m3")


ENV_VAR = "KVSCALE_CPU_FP8_WRITE"
"""Environment variable: ``rne`` (default: kvscale's write, compiled where possible,
``cpu_native``), ``rne-torch`` (kvscale's write in plain torch, ``cpu_cache_write``) or
``vllm`` (vLLM's own truncating write for every layer, for comparisons)."""

MODES = ("rne", "rne-torch", "vllm")


def write_mode() -> str:
    """The mode ``KVSCALE_CPU_FP8_WRITE`` selects (unknown values: one warning, ``rne``)."""
    raw = os.environ.get(ENV_VAR, "").strip().lower()
    if raw in ("", "rne"):
        return "rne"
    if raw in MODES:
        return raw
    warn_once(
        f"cpu-write-env-{raw}",
        "kvscale: %s=%r is not one of %s; using 'rne'.",
        ENV_VAR,
        raw,
        "/".join(MODES),
    )
    return "rne"


def serve_layer(layer: torch.nn.Module) -> bool:
    """Give one kvscale attention layer kvscale's cache write: its attention impl becomes
    an instance of a subclass of its own class whose ``do_kv_cache_update`` is
    kvscale's (``_wrap``), built once per impl class. vLLM's class and every other
    layer's impl are untouched. Idempotent (every load calls it). Returns whether the
    layer's impl is kvscale's now (False: not a CPU attention impl)."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    impl = getattr(layer, "impl", None)
    if not isinstance(impl, CPUAttentionBackendImpl):
        return False
    base = type(impl)
    if getattr(base, _ORIGINAL_ATTR, None) is not None:
        return True  # kvscale's already
    with HOST.lock:
        sub = HOST.cpu_subclasses.get(base)
        if sub is None:
            sub = type(
                f"KVScale{base.__name__}",
                (base,),
                {
                    "__module__": __name__,
                    "__doc__": f"vLLM's {base.__name__} with kvscale's FP8 cache write.",
                    "do_kv_cache_update": _wrap(base.do_kv_cache_update),
                    _ORIGINAL_ATTR: base,
                },
            )
            HOST.cpu_subclasses[base] = sub
    impl.__class__ = sub
    return True


def _wrap(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def do_kv_cache_update(
        self: Any,
        layer: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        route = _route(self, layer, key, kv_cache)
        if route is None:
            original(self, layer, key, value, kv_cache, slot_mapping)
            return
        held: HeldTarget | None = self.__dict__.get(_TARGET_ATTR)
        if held is None or not held.serves(kv_cache, route):
            held = _hold(self, kv_cache, route)
        held.write(key, value, slot_mapping, layer._k_scale_float, layer._v_scale_float)

    setattr(do_kv_cache_update, _ORIGINAL_ATTR, original)
    return do_kv_cache_update


def _hold(impl: Any, kv_cache: torch.Tensor, route: str) -> HeldTarget:
    """Make (and keep on ``impl``) the write of ``route`` into ``kv_cache``, with what it
    needs bound here once (kernel modules, the cache's target, vLLM's forward-context
    getters), so that a write imports and looks up nothing."""
    from kvscale_plugin.kernels import cpu_cache_write, cpu_native

    implementation, layout = route.split(":", 1)
    # A normal (not inference-mode) view: writable both in vLLM's inference-mode
    # forward and outside it.
    with torch.inference_mode(False):
        if implementation == "c":  # only routed there when the compiled write loaded
            write = _native_write(cpu_native, cpu_native.native_target(kv_cache, layout))
        else:
            write = _planned_write(cpu_cache_write, cpu_cache_write.cache_target(kv_cache, layout))
    held = cpu_cache_write.HeldTarget.of(kv_cache, route, write)
    setattr(impl, _TARGET_ATTR, held)
    return held


def _native_write(cpu_native: Any, target: Any) -> Callable[..., None]:
    module, write_native = cpu_native.load(), cpu_native.write_native

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k: float, v: float):
        write_native(module, key, value, target, slots, k, v)

    return write


def _planned_write(cpu_cache_write: Any, target: Any) -> Callable[..., None]:
    """The plain-torch write, with its plan shared inside the vLLM forward context it was
    made in (``StepPlans.plan``): one model step (speculative-decoding draft steps each set
    their own), in which vLLM hands the same ``slot_mapping`` to every layer of a KV-cache
    group (and refills it in place between steps). Outside one (direct calls) nothing is
    shared."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if HOST.step_plans is None:
        HOST.step_plans = cpu_cache_write.StepPlans()
    plans: StepPlans = HOST.step_plans
    write_planned = cpu_cache_write.write_planned
    flat, geometry = target

    def write(key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, k: float, v: float):
        ctx = get_forward_context() if is_forward_context_available() else None
        write_planned(key, value, flat, plans.plan(slots, geometry, ctx), k, v)

    return write


def _route(
    impl: Any, layer: torch.nn.Module, key: torch.Tensor, kv_cache: torch.Tensor
) -> str | None:
    """kvscale's write as ``"IMPLEMENTATION:LAYOUT"`` (``"c:vec"``, ``"torch:vec"``), or
    None for vLLM's.

    Decided once per (impl, input dtype): the impl is one layer's, and nothing
    that decides changes between steps (scales are read at every call).
    """
    routes: dict[torch.dtype, str | None] | None = impl.__dict__.get(_ROUTE_ATTR)
    if routes is None:
        routes = {}
        setattr(impl, _ROUTE_ATTR, routes)
    dtype = key.dtype
    if dtype not in routes:
        routes[dtype] = _decide(impl, layer, dtype, kv_cache)
    return routes[dtype]


def _decide(
    impl: Any, layer: torch.nn.Module, dtype: torch.dtype, kv_cache: torch.Tensor
) -> str | None:
    from vllm.v1.attention.backend import AttentionType

    from kvscale_plugin.kernels.cpu_cache_write import INPUT_DTYPES, LAYOUTS

    if not is_kvscale_layer(layer):
        return None
    if getattr(impl, "kv_cache_dtype", None) not in _FP8_E4M3_CACHE_DTYPES:
        return None  # bf16 / fp16 / e5m2 caches: vLLM's write
    if getattr(impl, "attn_type", None) in (AttentionType.ENCODER_ONLY, AttentionType.ENCODER):
        return None  # no cache to update (vLLM's method returns at once)
    mode = write_mode()
    if mode == "vllm":
        warn_once(
            "cpu-write-vllm",
            "kvscale: %s=vllm: FP8 KV cache written by vLLM's CPU op (rounds toward zero).",
            ENV_VAR,
        )
        return None
    if dtype not in INPUT_DTYPES or kv_cache.element_size() != 1 or kv_cache.dim() != 4:
        warn_once(
            f"cpu-write-input-{dtype}-{kv_cache.dtype}",
            "kvscale: FP8 KV cache write for %s activations into a %s cache %s is not "
            "handled; vLLM's CPU write (round toward zero) is used.",
            dtype,
            kv_cache.dtype,
            tuple(kv_cache.shape),
        )
        return None
    isa = getattr(layer, "isa", None)
    _, _, block_size, two_hs = kv_cache.shape
    if isa not in LAYOUTS:
        warn_once(
            f"cpu-write-isa-{isa}",
            "kvscale: vLLM's CPU attention uses the %r cache layout here, which kvscale's "
            "round-to-nearest-even FP8 write does not handle (only %s); vLLM's own write "
            "(round toward zero) is used.",
            isa,
            "/".join(LAYOUTS),
        )
        return None
    from kvscale_plugin.kernels import cpu_native

    implementation = "torch"
    if mode == "rne" and cpu_native.load() is not None:  # one warning when it cannot be built
        implementation = "c"
    if implementation == "c" and not layout_matches_vllm(isa, block_size, two_hs // 2, dtype, "c"):
        warn_once(
            f"cpu-write-layout-c-{isa}-{block_size}-{two_hs // 2}",
            "kvscale: the compiled FP8 cache write does not reproduce vLLM's %r cache "
            "layout (block size %d, head size %d); kvscale's plain-torch write is used "
            "(same bytes; %s=rne-torch selects it without this check).",
            isa,
            block_size,
            two_hs // 2,
            ENV_VAR,
        )
        implementation = "torch"
    if not layout_matches_vllm(isa, block_size, two_hs // 2, dtype, implementation):
        warn_once(
            f"cpu-write-layout-{isa}-{block_size}-{two_hs // 2}",
            "kvscale: kvscale's FP8 cache write (%s) does not reproduce vLLM's %r cache "
            "layout (block size %d, head size %d) on this build; vLLM's own write (round "
            "toward zero) is used.",
            implementation,
            isa,
            block_size,
            two_hs // 2,
        )
        return None
    if not HOST.cpu_write_announced:
        HOST.cpu_write_announced = True
        logger.info(
            "kvscale: FP8 KV cache of kvscale layers written with round-to-nearest-even "
            "on the CPU (%s; %s=vllm restores vLLM's truncating write).",
            "compiled" if implementation == "c" else "plain torch",
            ENV_VAR,
        )
    return f"{implementation}:{isa}"


def vllm_cpu_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    isa: str,
    k_scale: float,
    v_scale: float,
    kv_cache_dtype: str = "fp8",
) -> None:
    """vLLM's own CPU cache write (FP8: truncating) into one layer's
    ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` cache."""
    from vllm import _custom_ops as ops

    num_blocks, num_heads, block_size, _ = kv_cache.shape
    halves = kv_cache.view(num_blocks, num_heads, 2 * block_size, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(
        key,
        value,
        *halves,
        slots,
        isa,
        k_scale=k_scale,
        v_scale=v_scale,
        kv_cache_dtype=kv_cache_dtype,
    )


@functools.cache
def layout_matches_vllm(
    isa: str, block_size: int, head_size: int, dtype: torch.dtype, implementation: str = "torch"
) -> bool:
    """Whether kvscale's write (``implementation``: ``"c"`` or ``"torch"``) puts every
    byte where vLLM's op (``vllm_cpu_write``) puts it, for this layout
    (``cpu_cache_write.layout_matches``)."""
    from kvscale_plugin.kernels import cpu_cache_write, cpu_native

    ours = cpu_native if implementation == "c" else cpu_cache_write
    return cpu_cache_write.layout_matches(
        vllm_cpu_write, isa, block_size, head_size, dtype, ours.cpu_fp8_cache_write
    )
