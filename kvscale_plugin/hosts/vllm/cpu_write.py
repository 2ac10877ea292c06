"""Round-to-nearest-even FP8 KV-cache write for kvscale layers on vLLM's CPU platform.

vLLM 0.32's CPU attention writes an FP8 cache with ``cpu_attn_reshape_and_cache``,
which rounds toward zero (and turns NaN into 448, -0 into +0); every CUDA path
rounds to nearest even. For attention layers served by kvscale with an FP8 e4m3
cache, ``serve_layer`` routes the CPU backend's cache-update step,
``CPUAttentionBackendImpl.do_kv_cache_update``, to
``kvscale_plugin.kernels.cpu_cache_write``, which stores exactly
``(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)`` at the bytes vLLM's CPU
attention reads, with ``s`` the same Python-float scales that attention
dequantizes with (``layer._k_scale_float`` / ``_v_scale_float``). The attention
itself is vLLM's, unchanged.

Two implementations store the same bytes. The default is one C call per layer
(``kernels/cpu_native``: compiled on first use with the machine's C compiler, about
half a second once, then cached on disk), which costs less than vLLM's own write. Where
it cannot be built (no compiler or Python headers: one warning), the plain-torch write
(``kernels/cpu_cache_write``) is used: the byte offsets of a step's tokens (its "plan")
are computed once per forward step and shared by all layers (``_step_plan``), and each
layer then costs six small torch ops.

The CPU platform ignores ``--attention-backend`` (its ``get_attn_backend_cls`` returns
CPU_ATTN whatever was selected), so no registered backend can be chosen there. Instead,
each attention layer served by kvscale gets, when its KV method processes it
(``serve_layer``), an impl whose class is a subclass of vLLM's with kvscale's
``do_kv_cache_update``; vLLM's class is never changed, and an engine without
``--quantization kvscale`` runs vLLM's own write. The subclass hands every call it does
not own to vLLM's method: layers not served by kvscale, caches that
are not FP8 e4m3 (bf16, e5m2), encoder attention, input dtypes other than
bf16 / fp16 / fp32, and cache layouts other than the one proven here ("vec":
x86 with AVX-512 and no AMX). A layout is also checked against vLLM's own op on a
scratch cache before its first use; if the bytes disagree, vLLM's write is kept
with one warning.

``KVSCALE_CPU_FP8_WRITE=vllm`` keeps vLLM's truncating write for every layer (for
comparisons); ``rne`` (default) selects kvscale's, compiled where possible;
``rne-torch`` kvscale's in plain torch. Read when a layer first writes.

Each impl keeps the route it took per input dtype (``_route``), named by implementation
and layout: ``"c:vec"``, ``"torch:vec"``; None is vLLM's write.
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvscale_plugin._log import logger, warn_once
from kvscale_plugin.hosts.vllm.layers import is_kvscale_layer

ENV_VAR = "KVSCALE_CPU_FP8_WRITE"
"""Environment variable: ``rne`` (default: kvscale's write, compiled where possible),
``rne-torch`` (kvscale's write in plain torch) or ``vllm`` (vLLM's own)."""

MODES = ("rne", "rne-torch", "vllm")

_ORIGINAL_ATTR = "__kvscale_original__"
_ROUTE_ATTR = "_kvscale_cpu_write_route"
_TARGET_ATTR = "_kvscale_cpu_cache_target"
_FP8_E4M3_CACHE_DTYPES = ("fp8", "fp8_e4m3")

_install_lock = threading.Lock()


@dataclass(frozen=True)
class _Kernels:
    """kvscale's write, bound when a layer first routes to it (``_decide``): the kernel
    modules are imported only in processes that write a kvscale FP8 cache."""

    write: Callable[..., None]  # cpu_cache_write.write_planned
    target: Callable[..., Any]  # cpu_cache_write.cache_target
    plan: Callable[..., Any]  # cpu_cache_write.plan_write
    has_forward_context: Callable[[], bool]
    get_forward_context: Callable[[], Any]
    native_module: Any = None  # the compiled write, when it was built
    native_write: Callable[..., int] | None = None
    native_target: Callable[..., Any] | None = None


class _Process:
    """This process's cache-write state."""

    kernels: _Kernels | None = None
    announced = False  # the INFO line is logged once per process


_process = _Process()


@dataclass(frozen=True)
class _HeldTarget:
    """The write target made for one layer's cache tensor, valid while the engine hands
    over the same tensor with the same storage and geometry (the compiled write keeps a
    raw pointer: a cache whose storage was swapped must never be written through the
    old one)."""

    cache: torch.Tensor
    route: str
    data_ptr: int
    stride: tuple[int, ...]
    shape: tuple[int, ...]
    target: Any

    def serves(self, kv_cache: torch.Tensor, route: str) -> bool:
        return (
            self.cache is kv_cache
            and self.route == route
            and self.data_ptr == kv_cache.data_ptr()
            and self.stride == kv_cache.stride()
            and self.shape == tuple(kv_cache.shape)
        )


class _StepPlan(NamedTuple):
    slot_mapping: torch.Tensor  # held: its id stays its own while the plan is kept
    plan: Any


class _StepPlans:
    """Write plans of the current forward step (see ``_step_plan``)."""

    def __init__(self) -> None:
        self.context: weakref.ref[Any] | None = None
        self.plans: dict[tuple[int, tuple[int, ...]], _StepPlan] = {}

    def for_context(self, ctx: Any) -> dict[tuple[int, tuple[int, ...]], _StepPlan]:
        """The plans of ``ctx``'s step (a new step drops the last one's)."""
        if self.context is None or self.context() is not ctx:
            self.plans.clear()
            self.context = weakref.ref(ctx, self._forget)
        return self.plans

    def _forget(self, ref: weakref.ref[Any]) -> None:
        """Weakref callback: the step's forward context is gone, and so are its plans."""
        if self.context is ref:
            self.plans.clear()
            self.context = None


_step_plans = _StepPlans()


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


_subclasses: dict[type, type] = {}


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
    with _install_lock:
        sub = _subclasses.get(base)
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
            _subclasses[base] = sub
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
        kernels = _process.kernels
        assert kernels is not None  # bound by _decide before any route is taken
        held: _HeldTarget | None = self.__dict__.get(_TARGET_ATTR)
        if held is None or not held.serves(kv_cache, route):
            # A normal (not inference-mode) view: writable both in vLLM's
            # inference-mode forward and outside it.
            with torch.inference_mode(False):
                made = (
                    kernels.native_target(kv_cache)
                    if route == "c:vec"  # only routed there when the compiled write loaded
                    else kernels.target(kv_cache, route.split(":", 1)[1])
                )
            held = _HeldTarget(
                kv_cache, route, kv_cache.data_ptr(), kv_cache.stride(), tuple(kv_cache.shape), made
            )
            setattr(self, _TARGET_ATTR, held)
        target = held.target
        if route == "c:vec":
            kernels.native_write(
                kernels.native_module,
                key,
                value,
                target,
                slot_mapping,
                layer._k_scale_float,
                layer._v_scale_float,
            )
            return
        flat, geometry = target
        kernels.write(
            key,
            value,
            flat,
            _step_plan(kernels, slot_mapping, geometry),
            layer._k_scale_float,
            layer._v_scale_float,
        )

    setattr(do_kv_cache_update, _ORIGINAL_ATTR, original)
    return do_kv_cache_update


def _step_plan(kernels: _Kernels, slot_mapping: torch.Tensor, geometry: tuple[int, ...]) -> Any:
    """The write plan for ``slot_mapping``: computed once per forward step and cache
    geometry, then shared by every layer that writes in that step.

    A plan is reused only inside the vLLM forward context it was made in (one model
    step; speculative-decoding draft steps each set their own) and only for the very
    tensor object it was made from (vLLM hands the same ``slot_mapping`` to every
    layer of a KV-cache group in a step). Never across steps: vLLM refills its
    slot-mapping buffer between steps, possibly without bumping the tensor's version,
    so neither the tensor's identity nor its data pointer tells steps apart. The
    plans are dropped when the step's context is. Outside a forward context (direct
    calls) nothing is reused.
    """
    ctx = kernels.get_forward_context() if kernels.has_forward_context() else None
    if ctx is None:
        return kernels.plan(slot_mapping, geometry)
    plans = _step_plans.for_context(ctx)
    key = (id(slot_mapping), geometry)
    hit = plans.get(key)
    if hit is not None and hit.slot_mapping is slot_mapping:
        return hit.plan
    plan = kernels.plan(slot_mapping, geometry)
    plans[key] = _StepPlan(slot_mapping, plan)
    return plan


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
    from vllm.forward_context import get_forward_context, is_forward_context_available

    from kvscale_plugin.kernels import cpu_native
    from kvscale_plugin.kernels.cpu_cache_write import cache_target, plan_write, write_planned

    implementation = "torch"
    native: dict[str, Any] = {}
    if mode == "rne":
        module = cpu_native.load()  # one warning when it cannot be built
        if module is not None:
            implementation = "c"
            native = {
                "native_module": module,
                "native_write": cpu_native.write_native,
                "native_target": cpu_native.native_target,
            }
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
    if _process.kernels is None or (native and _process.kernels.native_module is None):
        _process.kernels = _Kernels(
            write_planned,
            cache_target,
            plan_write,
            is_forward_context_available,
            get_forward_context,
            **native,
        )
    if not _process.announced:
        _process.announced = True
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
    byte where vLLM's op puts it, for this layout.

    Both write the same exactly representable values (where rounding cannot
    differ), with padding slots, into scratch caches; the caches must be equal.
    """
    from kvscale_plugin.kernels.cpu_cache_write import cpu_fp8_cache_write

    num_blocks, num_heads = 3, 2
    num_tokens = 2 * block_size + 2
    gen = torch.Generator().manual_seed(0)
    # Finite nonzero e4m3 codes (not 0x00/0x80/NaN, which vLLM's op maps differently).
    codes = torch.randint(1, 0x7F, (2, num_tokens, num_heads, head_size), generator=gen)
    codes |= torch.randint(0, 2, codes.shape, generator=gen) << 7
    values = codes.to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
    key, value = values[0], values[1]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[::5] = -1
    shape = (num_blocks, num_heads, block_size, 2 * head_size)
    theirs = torch.randint(0, 256, shape, generator=gen).to(torch.uint8)
    ours = theirs.clone()
    try:
        vllm_cpu_write(key, value, theirs, slots, isa, 1.0, 1.0)
        if implementation == "c":
            from kvscale_plugin.kernels import cpu_native

            module = cpu_native.load()
            if module is None:
                return False
            cpu_native.write_native(
                module, key, value, cpu_native.native_target(ours), slots, 1.0, 1.0
            )
        else:
            cpu_fp8_cache_write(key, value, ours, slots, 1.0, 1.0, isa)
    except Exception as exc:  # noqa: BLE001 - any failure means "not proven"
        logger.debug("kvscale: layout check for %s failed: %s", isa, exc)
        return False
    return torch.equal(ours, theirs)
