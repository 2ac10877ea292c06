"""FP8 (e4m3fn) KV-cache write for vLLM's CPU attention cache layout, in plain torch.

vLLM's CPU build (0.32) writes its FP8 cache with ``cpu_attn_reshape_and_cache``, which
rounds toward zero, turns NaN into 448 and -0 into +0; every CUDA path rounds to nearest
even. This module writes the same cache locations with kvscale's contract instead, bit
for bit::

    (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)   # round to nearest even

(saturation to +-448, NaN kept as NaN, -0 kept), padding slots (< 0) skipped.

Layout ("vec": x86 with AVX-512 and no AMX, what ``_get_attn_isa`` picks for an
FP8 cache there). One layer's cache is ``[num_blocks, num_kv_heads, block_size,
2 * head_size]`` bytes; each (block, head) owns ``2 * block_size * head_size``
contiguous bytes, K first, then V:

    K[t, d] at  d * block_size + t                        (transposed)
    V[t, d] at  block_size * head_size + t * head_size + d

(derived by writing position codes through vLLM's op and reading the bytes back;
the host adapter re-checks it against vLLM's own op before first use, with
``layout_matches``). Other ISAs ("amx", ...) lay the cache out differently and are not
handled here.

Pure torch, no host import, no Python loop over tokens; any strides for ``key`` /
``value`` (slices of a fused qkv tensor are fine). The write sits on every layer of
every model step, where torch's per-op overhead (a few microseconds per op, more
with the caches cold inside an engine) is its whole cost at decode sizes. So it is
split in two:

- ``plan_write(slot_mapping, geometry)``: the byte offset of every K and V element
  in the cache (int64, ``[tokens, 2, heads, head_size]`` flattened) and scratch
  tensors; a dozen small ops, once per model step, shared by every layer whose cache
  has that geometry (``cache_target``; a host keeps a step's plans in ``StepPlans``).
- ``write_planned(key, value, flat, plan, k_scale, v_scale)``: per layer, six ops
  whatever the size: K and V copied (widened) into the plan's fp32 scratch, one
  in-place division by the (K, V) scale pair, one in-place clamp, one conversion to
  e4m3 (torch's, round to nearest even) and one ``scatter_`` of the bytes into a
  flat ``uint8`` view of the cache.

``cpu_fp8_cache_write`` does all three for one call. The same write compiled to one C
call per layer is ``cpu_native`` (the default where it builds); the host adapter chooses
between them and the host's own write (vLLM: ``KVSCALE_CPU_FP8_WRITE``).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from kvscale_plugin._log import logger
from kvscale_plugin.fp8 import FP8_E4M3_MAX

#: Cache layouts this module writes (named after vLLM's CPU attention ISA strings).
LAYOUTS = ("vec",)

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# fp32 divisor tensors per scale value: dividing a bf16 / fp16 tensor by a
# dimensioned fp32 tensor promotes to fp32, so one ``div`` computes
# ``x.float() / s`` exactly (``write_planned`` divides fp32 scratch in place by
# the [1, 2, 1, 1] pair). Bounded: scales change only on a weight reload.
_MAX_ENTRIES = 4096


@functools.lru_cache(maxsize=_MAX_ENTRIES)
def _scale_tensor(*scales: float) -> torch.Tensor:
    """``[1]`` for one scale; ``[1, 2, 1, 1]`` for a (K, V) pair."""
    shape = (1,) if len(scales) == 1 else (1, len(scales), 1, 1)
    return torch.tensor(scales, dtype=torch.float32).view(shape)


def _saturate_(y: torch.Tensor) -> torch.Tensor:
    """fp32 ``y`` clamped in place to e4m3's finite range (NaN stays NaN); converting the
    result with ``.to(torch.float8_e4m3fn)`` rounds to nearest even."""
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``(x.float() / scale).clamp(-448, 448)`` as float8_e4m3fn; ``scale`` is taken as fp32.

    One ``div`` (a 1-d fp32 divisor promotes bf16 / fp16 to fp32 exactly), an
    in-place clamp (keeps NaN) and torch's round-to-nearest-even conversion.
    """
    return _saturate_(torch.div(x, _scale_tensor(float(scale)))).to(torch.float8_e4m3fn)


def cpu_cache_views(
    kv_cache: torch.Tensor, layout: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``uint8`` views ``[num_blocks, block_size, num_kv_heads, head_size]`` of one
    layer's CPU cache such that ``view[block, t, h, d]`` is the byte vLLM's CPU
    attention reads for token ``t`` of ``block``, head ``h``, element ``d`` (K, V).

    The views hold the cache's storage: keep them no longer than the cache itself."""
    if layout not in LAYOUTS:
        raise ValueError(f"unsupported CPU cache layout {layout!r}; supported: {LAYOUTS}")
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(
            "expected one layer's cache [num_blocks, num_kv_heads, block_size, 2*head_size], "
            f"got shape {tuple(kv_cache.shape)}"
        )
    if kv_cache.element_size() != 1:
        raise ValueError(f"expected a 1-byte (FP8 / uint8) cache, got {kv_cache.dtype}")
    num_blocks, num_heads, block_size, two_hs = kv_cache.shape
    head_size = two_hs // 2
    raw = kv_cache.view(torch.uint8)
    if raw.stride(3) != 1 or raw.stride(2) != two_hs:
        raise ValueError("each (block, head) of the CPU cache must be one contiguous region")
    sb, sh = raw.stride(0), raw.stride(1)
    plane = block_size * head_size
    offset = raw.storage_offset()
    key_view = raw.as_strided(
        (num_blocks, block_size, num_heads, head_size), (sb, 1, sh, block_size), offset
    )
    value_view = raw.as_strided(
        (num_blocks, block_size, num_heads, head_size), (sb, head_size, sh, 1), offset + plane
    )
    return key_view, value_view


class CacheTarget(NamedTuple):
    """One layer's cache as the write addresses it (``cache_target``)."""

    flat: torch.Tensor
    """1-d ``uint8`` view over the cache's bytes (the scatter target)."""
    geometry: tuple[int, int, int, int, int]
    """``(block_size, num_kv_heads, head_size, block stride, head stride)`` in bytes:
    what the byte offsets depend on (equal for every layer of one engine)."""


class WritePlan(NamedTuple):
    """Where one step's tokens go (``plan_write``): computed once per slot mapping and
    cache geometry, shared by every layer that writes with both."""

    num_tokens: int
    """``len(slot_mapping)``: rows of ``key`` / ``value`` the write consumes."""
    rows: torch.Tensor | None
    """int64 rows to write when some slots are padding (< 0); None: all rows."""
    index: torch.Tensor | None
    """int64 byte offsets into ``CacheTarget.flat``, one per element of
    ``stack((key, value), dim=1)[rows]`` in order; None: nothing to write."""
    quotients: torch.Tensor | None
    """fp32 ``[rows, 2, num_kv_heads, head_size]`` scratch for ``x / s`` (reused by
    every layer of the step: no allocation per write)."""
    key_quotients: torch.Tensor | None
    """``quotients[:, 0]`` (K's half)."""
    value_quotients: torch.Tensor | None
    """``quotients[:, 1]`` (V's half)."""
    codes: torch.Tensor | None
    """float8_e4m3fn scratch of the same shape, for the quantized values."""
    code_bytes: torch.Tensor | None
    """``codes`` as 1-d ``uint8`` (the scatter source)."""


def cache_target(kv_cache: torch.Tensor, layout: str = "vec") -> CacheTarget:
    """Checks one layer's cache (as ``cpu_cache_views``) and returns its flat byte view
    and geometry. The view holds the cache's storage: keep it no longer than the cache."""
    cpu_cache_views(kv_cache, layout)  # validation only
    num_blocks, num_heads, block_size, two_hs = kv_cache.shape
    raw = kv_cache.view(torch.uint8)
    extent = 1 + sum(
        (size - 1) * stride for size, stride in zip(raw.shape, raw.stride(), strict=True)
    )
    flat = raw.view(-1) if raw.is_contiguous() else raw.as_strided((extent,), (1,))
    geometry = (block_size, num_heads, two_hs // 2, raw.stride(0), raw.stride(1))
    return CacheTarget(flat, geometry)


# Per geometry: (the byte offset of element (h, d) of a token's K ([0]) and V ([1])
# from the token's start, [1, 2, num_heads, head_size]; the factors that turn a
# token's offset in its block into the starts of its K column and V row, [1, 2]).
@functools.lru_cache(maxsize=_MAX_ENTRIES)
def _geometry_tensors_for(
    geometry: tuple[int, int, int, int, int],
) -> tuple[torch.Tensor, torch.Tensor]:
    block_size, num_heads, head_size, _, stride_head = geometry
    h = torch.arange(num_heads, dtype=torch.int64).view(num_heads, 1) * stride_head
    d = torch.arange(head_size, dtype=torch.int64).view(1, head_size)
    k = h + d * block_size  # K transposed: d * block_size + t
    v = h + block_size * head_size + d  # V: block_size * head_size + t * head_size + d
    per_offset = torch.tensor([[1, head_size]], dtype=torch.int64)
    return torch.stack((k, v)).unsqueeze(0), per_offset


def plan_write(slot_mapping: torch.Tensor, geometry: tuple[int, int, int, int, int]) -> WritePlan:
    """The byte offsets (and scratch tensors) for writing ``slot_mapping``'s tokens
    into any cache of this ``geometry`` (``block * block_size + offset``; slots < 0
    are skipped).

    About a dozen small torch ops: a host that writes many layers per step with one
    slot mapping computes this once per step and passes it to ``write_planned``."""
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return WritePlan(0, None, None, None, None, None, None, None)
    block_size, num_heads, head_size, stride_block, _ = geometry
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    rows = None
    if bool((slots < 0).any()):
        rows = (slots >= 0).nonzero().view(-1)
        if rows.shape[0] == 0:
            return WritePlan(num_tokens, rows, None, None, None, None, None, None)
        slots = slots[rows]
    head_offsets, per_offset = _geometry_tensors_for(geometry)
    block_start = torch.div(slots, block_size, rounding_mode="floor").mul_(stride_block)
    offset = slots.remainder(block_size)
    # [n, 2]: where the token's K column and V row start; then every element's byte.
    starts = torch.addcmul(block_start.unsqueeze(1), offset.unsqueeze(1), per_offset)
    index = starts.view(-1, 2, 1, 1).add(head_offsets).view(-1)
    shape = (slots.shape[0], 2, num_heads, head_size)
    quotients = torch.empty(shape, dtype=torch.float32)
    codes = torch.empty(shape, dtype=torch.float8_e4m3fn)
    key_quotients, value_quotients = quotients.unbind(1)
    code_bytes = codes.view(torch.uint8).view(-1)
    return WritePlan(
        num_tokens, rows, index, quotients, key_quotients, value_quotients, codes, code_bytes
    )


def write_planned(
    key: torch.Tensor,
    value: torch.Tensor,
    flat: torch.Tensor,
    plan: WritePlan,
    k_scale: float,
    v_scale: float,
) -> None:
    """The hot path: quantize ``key`` / ``value`` (round to nearest even) and scatter
    them to ``plan``'s offsets in ``flat`` (``cache_target(kv_cache).flat``).

    ``key`` / ``value``: ``[num_tokens, num_kv_heads, head_size]`` (at least
    ``plan.num_tokens`` rows), the geometry ``plan`` was made for. Six torch ops per
    call at any size, no allocation, plus two row selections when the step has
    padding slots. Uses the plan's scratch tensors: one write at a time per plan."""
    index = plan.index
    if index is None:
        return
    n = plan.num_tokens
    if key.shape[0] != n:
        key, value = key[:n], value[:n]
    if plan.rows is not None:
        key, value = key[plan.rows], value[plan.rows]
    # x.float() / s (exact widening, then one fp32 division by the (K, V) scales),
    # clamped in place (NaN stays NaN), converted with round-to-nearest-even: the
    # steps of ``quantize_e4m3``, in the plan's scratch tensors (no allocation).
    plan.key_quotients.copy_(key)
    plan.value_quotients.copy_(value)
    y = plan.quotients.div_(_scale_tensor(float(k_scale), float(v_scale)))
    plan.codes.copy_(_saturate_(y))
    flat.scatter_(0, index, plan.code_bytes)


def cpu_fp8_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float,
    v_scale: float,
    layout: str = "vec",
) -> None:
    """Quantize K and V (round to nearest even) and scatter them into vLLM's CPU cache.

    ``key`` / ``value``: ``[num_tokens, num_kv_heads, head_size]`` bf16 / fp16 / fp32,
    any strides; only the first ``len(slot_mapping)`` rows are written.
    ``kv_cache``: one layer's ``[num_blocks, num_kv_heads, block_size, 2*head_size]``
    uint8 (or float8_e4m3fn) tensor, written in place. ``slot_mapping``: int32/int64
    ``[num_tokens]``, ``block * block_size + offset``; slots < 0 are left untouched.
    ``k_scale`` / ``v_scale``: the scales vLLM's CPU attention dequantizes with.

    ``cache_target`` + ``plan_write`` + ``write_planned`` in one call; a host writing
    many layers per step keeps the target per layer and the plan per step instead.
    """
    target = cache_target(kv_cache, layout)
    write_planned(
        key, value, target.flat, plan_write(slot_mapping, target.geometry), k_scale, v_scale
    )


def cpu_fp8_cache_read(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, layout: str = "vec"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The K and V bytes stored for ``slot_mapping`` (all >= 0): two
    ``[num_tokens, num_kv_heads, head_size]`` uint8 tensors (tests, benchmarks)."""
    key_view, value_view = cpu_cache_views(kv_cache, layout)
    block_size = key_view.shape[1]
    slots = slot_mapping.to(torch.int64)
    index = (slots // block_size, slots % block_size)
    return key_view[index], value_view[index]


@dataclass(frozen=True)
class HeldTarget:
    """The write a host made for one layer's cache tensor (bound to its ``cache_target``, or
    ``cpu_native.native_target``), valid while the host hands over the same tensor with the
    same storage and geometry (the compiled write keeps a raw pointer: a cache whose
    storage was swapped must never be written through the old one)."""

    cache: torch.Tensor
    route: str  # the host's name for the write
    data_ptr: int
    stride: tuple[int, ...]
    shape: tuple[int, ...]
    write: Callable[..., None]  # write(key, value, slot_mapping, k_scale, v_scale)

    @classmethod
    def of(cls, kv_cache: torch.Tensor, route: str, write: Callable[..., None]) -> HeldTarget:
        """``write``, held for ``kv_cache`` as it is now."""
        shape = tuple(kv_cache.shape)
        return cls(kv_cache, route, kv_cache.data_ptr(), kv_cache.stride(), shape, write)

    def serves(self, kv_cache: torch.Tensor, route: str) -> bool:
        return (
            self.cache is kv_cache
            and self.route == route
            and self.data_ptr == kv_cache.data_ptr()
            and self.stride == kv_cache.stride()
            and self.shape == tuple(kv_cache.shape)
        )


class StepPlan(NamedTuple):
    slot_mapping: torch.Tensor  # held: its id stays its own while the plan is kept
    plan: WritePlan


class StepPlans:
    """Write plans of a host's current model step (see ``plan``)."""

    def __init__(self) -> None:
        self.context: weakref.ref[Any] | None = None
        self.plans: dict[tuple[int, tuple[int, ...]], StepPlan] = {}

    def plan(
        self, slot_mapping: torch.Tensor, geometry: tuple[int, int, int, int, int], context: Any
    ) -> WritePlan:
        """The write plan for ``slot_mapping``: computed once per model step and cache
        geometry, then shared by every layer that writes in that step.

        ``context`` stands for the step (the host's forward context; weakly
        referenceable). A plan is reused only inside the context it was made in and only
        for the very tensor object it was made from. Never across steps: a host may refill
        its slot-mapping buffer between steps, possibly without bumping the tensor's
        version, so neither the tensor's identity nor its data pointer tells steps apart.
        The plans are dropped when the step's context is. Without a context (None: direct
        calls) nothing is reused.
        """
        if context is None:
            return plan_write(slot_mapping, geometry)
        plans = self.for_context(context)
        key = (id(slot_mapping), geometry)
        hit = plans.get(key)
        if hit is not None and hit.slot_mapping is slot_mapping:
            return hit.plan
        plan = plan_write(slot_mapping, geometry)
        plans[key] = StepPlan(slot_mapping, plan)
        return plan

    def for_context(self, ctx: Any) -> dict[tuple[int, tuple[int, ...]], StepPlan]:
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


def layout_matches(
    reference: Callable[..., None],
    layout: str,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    write: Callable[..., None] = cpu_fp8_cache_write,
) -> bool:
    """Whether ``write`` (``cpu_fp8_cache_write``'s signature; this module's, or
    ``cpu_native``'s) puts every byte where the host's own op ``reference`` (called as
    ``reference(key, value, kv_cache, slot_mapping, layout, k_scale, v_scale)``) puts it,
    for this layout.

    Both write the same exactly representable values (where rounding cannot
    differ), with padding slots, into scratch caches; the caches must be equal.
    """
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
        reference(key, value, theirs, slots, layout, 1.0, 1.0)
        write(key, value, ours, slots, 1.0, 1.0, layout)
    except Exception as exc:  # noqa: BLE001 - any failure means "not proven"
        logger.debug("kvscale: layout check for %s failed: %s", layout, exc)
        return False
    return torch.equal(ours, theirs)
