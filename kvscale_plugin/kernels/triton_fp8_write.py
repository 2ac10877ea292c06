"""Fused FP8 (e4m3fn) KV-cache write: one launch quantizes K and V by their
calibrated scales and scatters them into the paged cache.

Bit-exact target (see ``reference.py``)::

    (x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)
    cache[slot // block_size, slot % block_size] = ...   # slot < 0: untouched

Layouts
    key, value           [num_tokens, num_kv_heads, head_size], any strides
                         (slices of a fused qkv tensor are fine); bf16/fp16/fp32.
                         They may hold more rows than ``slot_mapping`` (vLLM pads
                         its inputs for CUDA graphs): only the first
                         ``len(slot_mapping)`` rows are written.
    key_cache,           [num_blocks, block_size, num_kv_heads, head_size], any
    value_cache          strides (vLLM's per-layer ``[num_blocks, num_kv_heads,
                         block_size, 2*head_size]`` tensor, transposed and split
                         into its K and V halves, works as is);
                         ``torch.float8_e4m3fn`` or a ``uint8`` view of it.
    slot_mapping         int32 or int64 ``[num_tokens]``; < 0 marks padding.
    k_scale, v_scale     fp32 device tensors, one element (per tensor) or
                         ``[num_kv_heads]`` (per head). Read inside the kernel,
                         never turned into Python floats: CUDA-graph replays and
                         in-place scale reloads see the current values.

Two fp32 -> e4m3 conversions, chosen per launch:
    software   integer bit operations on the fp32 pattern: round to nearest
               even, saturate to +-448 (0x7E), NaN -> 0x7F, sign ORed back.
               Runs on any NVIDIA GPU (sm_80 has no FP8 convert instruction)
               and is the only one the Triton interpreter computes correctly
               (its own fp8 cast drops the rounding carry and rounds ties away).
    hardware   ``cvt.rn.satfinite.e4m3x2.f32`` (sm_89+): fewer instructions.
``auto`` takes hardware on sm_89+ and software below; the environment
variable ``KVSCALE_FP8_CONVERSION`` (auto / software / hardware) or the
``conversion`` argument overrides it. The interpreter always uses software.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch
import triton
import triton.language as tl

from kvscale_plugin.kernels.reference import fp8_cache_write_reference

Conversion = Literal["auto", "software", "hardware"]

CONVERSION_ENV = "KVSCALE_FP8_CONVERSION"
"""Environment variable that overrides the ``auto`` choice of conversion path."""

# Triton decided when this module was imported whether ``@triton.jit`` below
# builds GPU kernels or interpreted ones; the launcher must follow the same
# decision (tensors stay on the CPU, and only the software conversion is right).
INTERPRETER: bool = bool(triton.knobs.runtime.interpret)

_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_CACHE_DTYPES = (torch.float8_e4m3fn, torch.uint8)
_SLOT_DTYPES = (torch.int32, torch.int64)

# fp32 bit patterns used by the software conversion.
_F32_E4M3_MAX = tl.constexpr(0x43E00000)  # 448.0: largest finite e4m3fn
_F32_E4M3_MIN_NORMAL = tl.constexpr(0x3C800000)  # 2**-6: smallest normal e4m3fn
_F32_INF = tl.constexpr(0x7F800000)


@triton.jit
def _e4m3_bits_software(y):
    """fp32 -> e4m3fn byte with integer operations only (exact, any arch).

    Matches torch's ``y.clamp(-448, 448).to(float8_e4m3fn)`` bit for bit.
    Every lane computes both the normal and the subnormal candidate and a
    select picks one, so the shift amounts are clamped to stay defined for
    lanes whose candidate is discarded.
    """
    u = y.to(tl.int32, bitcast=True)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    # Normal results (|y| >= 2**-6): e4m3 keeps the top 3 of fp32's 23 mantissa
    # bits. Adding 0x7FFFF plus the lowest kept bit rounds the 20 dropped bits
    # to nearest even; a carry flows into the exponent, which is what
    # rounding up to the next binade needs. Then rebias the exponent 127 -> 7.
    # Clamping first keeps the addition inside int32 for inf/NaN lanes.
    a_sat = tl.minimum(a, _F32_E4M3_MAX)
    normal = ((a_sat + 0x7FFFF + ((a_sat >> 20) & 1)) >> 20) - (120 << 3)
    # Subnormal results (|y| < 2**-6): codes 0..7 are multiples of 2**-9, so the
    # code is round_to_nearest_even(|y| * 2**9) = mantissa >> (141 - exponent),
    # rounded with the same add-half-minus-one-plus-lsb trick. A result of 8 is
    # the smallest normal, whose encoding is also 8. Shifts past 24 already
    # give 0, so clamping to 31 keeps the shift defined without changing it.
    exponent = a >> 23
    mantissa = (a & 0x7FFFFF) | tl.where(exponent > 0, 0x800000, 0)
    shift = tl.minimum(141 - tl.minimum(tl.maximum(exponent, 1), 120), 31)
    half_minus_one = (1 << (shift - 1)) - 1
    subnormal = (mantissa + half_minus_one + ((mantissa >> shift) & 1)) >> shift
    bits = tl.where(a < _F32_E4M3_MIN_NORMAL, subnormal, normal)
    # Saturate (this also maps +-inf to +-448), then keep NaN a NaN.
    bits = tl.where(a >= _F32_E4M3_MAX, 0x7E, bits)
    bits = tl.where(a > _F32_INF, 0x7F, bits)
    return (bits | sign).to(tl.uint8)


@triton.jit
def _e4m3_bits_hardware(y):
    """fp32 -> e4m3fn byte with the sm_89+ convert instruction.

    The explicit saturation uses comparisons, not ``tl.minimum``/``tl.maximum``
    (PTX ``min``/``max`` return the non-NaN operand and would turn NaN into
    448); NaN fails both comparisons and reaches the convert, which keeps it.
    """
    y = tl.where(y > 448.0, 448.0, tl.where(y < -448.0, -448.0, y))
    return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def _quantize_store(
    src_ptr,
    src_stride_t,
    src_stride_h,
    src_stride_d,
    dst_ptr,
    dst_stride_b,
    dst_stride_s,
    dst_stride_h,
    dst_stride_d,
    scale_ptr,
    token,
    block,
    offset,
    heads,
    dims,
    head_mask,
    mask,
    PER_HEAD: tl.constexpr,
    HARDWARE_CONVERT: tl.constexpr,
):
    """Quantize one token's K (or V) heads by their scale and store them in the cache."""
    if PER_HEAD:
        scale = tl.load(scale_ptr + heads, mask=head_mask, other=1.0)[:, None]
    else:
        scale = tl.load(scale_ptr)
    src = (
        src_ptr
        + token * src_stride_t
        + heads[:, None] * src_stride_h
        + dims[None, :] * src_stride_d
    )
    dst = (
        dst_ptr
        + block * dst_stride_b
        + offset * dst_stride_s
        + heads[:, None] * dst_stride_h
        + dims[None, :] * dst_stride_d
    )
    x = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    # IEEE division, as torch does: ``/`` compiles to the approximate
    # div.full.f32 on NVIDIA, and a multiply by 1/scale rounds differently.
    y = tl.math.div_rn(x, scale)
    if HARDWARE_CONVERT:
        bits = _e4m3_bits_hardware(y)
    else:
        bits = _e4m3_bits_software(y)
    tl.store(dst, bits, mask=mask)


@triton.jit
def _fp8_cache_write_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,  # uint8 view
    value_cache_ptr,  # uint8 view
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
    key_cache_stride_b,
    key_cache_stride_s,
    key_cache_stride_h,
    key_cache_stride_d,
    value_cache_stride_b,
    value_cache_stride_s,
    value_cache_stride_h,
    value_cache_stride_d,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_PER_HEAD: tl.constexpr,
    V_PER_HEAD: tl.constexpr,
    HARDWARE_CONVERT: tl.constexpr,
):
    # Grid: (tokens, head groups). Strides are plain runtime ints: Triton
    # specializes the ones equal to 1, so the usual contiguous head dimension
    # still gets vector loads and stores.
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return  # padding token: leave the cache alone
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    token = token.to(tl.int64)

    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_mask = heads < NUM_HEADS
    mask = head_mask[:, None] & (dims < HEAD_SIZE)[None, :]

    _quantize_store(
        key_ptr,
        key_stride_t,
        key_stride_h,
        key_stride_d,
        key_cache_ptr,
        key_cache_stride_b,
        key_cache_stride_s,
        key_cache_stride_h,
        key_cache_stride_d,
        k_scale_ptr,
        token,
        block,
        offset,
        heads,
        dims,
        head_mask,
        mask,
        K_PER_HEAD,
        HARDWARE_CONVERT,
    )
    _quantize_store(
        value_ptr,
        value_stride_t,
        value_stride_h,
        value_stride_d,
        value_cache_ptr,
        value_cache_stride_b,
        value_cache_stride_s,
        value_cache_stride_h,
        value_cache_stride_d,
        v_scale_ptr,
        token,
        block,
        offset,
        heads,
        dims,
        head_mask,
        mask,
        V_PER_HEAD,
        HARDWARE_CONVERT,
    )


@functools.cache
def _device_capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def use_hardware_conversion(device: torch.device, conversion: Conversion | None = None) -> bool:
    """Whether a launch on ``device`` uses the hardware fp32 -> e4m3 convert.

    ``conversion=None`` reads ``KVSCALE_FP8_CONVERSION`` (default ``auto``).
    ``auto`` picks hardware on sm_89+ and software below. Both give the same
    bytes; the difference is cost. For the 8-head x 128 tile the software path
    compiles to about 3x the PTX instructions of the hardware one (~665 vs
    ~200, AOT for sm_90), and at H200 bandwidth a memory-bound write can spend
    only ~20 instructions per element, so where the convert instruction exists
    it is the one to use; sm_80 has none, and there the integer conversion is
    the only exact choice. Asking for hardware on a GPU without it is an error
    rather than a silent fallback, so a benchmark never measures the wrong path.
    """
    choice = conversion or os.environ.get(CONVERSION_ENV, "auto") or "auto"
    if choice not in ("auto", "software", "hardware"):
        raise ValueError(
            f"{CONVERSION_ENV}/conversion must be 'auto', 'software' or 'hardware', got {choice!r}"
        )
    if INTERPRETER or device.type != "cuda" or choice == "software":
        return False
    # ROCm builds of torch also report device.type == "cuda", but their FP8 is
    # fnuz, which this kernel does not write; the vLLM backend keeps such
    # caches with its parent, so only NVIDIA devices get here.
    index = device.index if device.index is not None else torch.cuda.current_device()
    has_fp8_convert = _device_capability(index) >= (8, 9)
    if choice == "hardware" and not has_fp8_convert:
        major, minor = _device_capability(index)
        raise ValueError(
            f"hardware FP8 conversion needs sm_89 or newer; {device} is sm_{major}{minor}. "
            f"Use conversion='software' (or {CONVERSION_ENV}=software)."
        )
    return has_fp8_convert


def _arguments_ok(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> bool:
    """All of ``_explain_bad_arguments`` as one cheap expression.

    This runs before every launch (per layer and step in eager and piecewise
    CUDA-graph mode), so it sticks to metadata that torch returns without
    building new objects, and never reads device memory, which keeps the
    launcher safe inside CUDA-graph capture.
    """
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4 or value_cache.dim() != 4:
        return False
    num_tokens, num_heads, head_size = key.shape
    value_tokens, value_heads, value_size = value.shape
    num_blocks, block_size, cache_heads, cache_size = key_cache.shape
    v_blocks, v_block_size, v_cache_heads, v_cache_size = value_cache.shape
    device = key.get_device()
    return (
        key.dtype in _INPUT_DTYPES
        and value.dtype in _INPUT_DTYPES
        and key_cache.dtype in _CACHE_DTYPES
        and value_cache.dtype in _CACHE_DTYPES
        and slot_mapping.dtype in _SLOT_DTYPES
        and slot_mapping.dim() == 1
        and num_heads == value_heads == cache_heads == v_cache_heads
        and head_size == value_size == cache_size == v_cache_size
        and num_blocks == v_blocks
        and block_size == v_block_size
        and min(num_tokens, value_tokens) >= slot_mapping.shape[0]
        and _scale_ok(k_scale, num_heads)
        and _scale_ok(v_scale, num_heads)
        and value.get_device() == device
        and key_cache.get_device() == device
        and value_cache.get_device() == device
        and slot_mapping.get_device() == device
        and k_scale.get_device() == device
        and v_scale.get_device() == device
    )


def _scale_ok(scale: torch.Tensor, num_heads: int) -> bool:
    numel = scale.numel()
    return scale.dtype == torch.float32 and (
        numel == 1 or (numel == num_heads and scale.is_contiguous())
    )


def _explain_bad_arguments(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
) -> ValueError:
    """The error for arguments ``_arguments_ok`` rejected, naming what is wrong."""
    for name, x in (("key", key), ("value", value)):
        if x.dim() != 3 or x.dtype not in _INPUT_DTYPES:
            return ValueError(
                f"{name} must be [num_tokens, num_kv_heads, head_size] in bf16/fp16/fp32, "
                f"got shape {tuple(x.shape)} dtype {x.dtype}"
            )
    if value.shape[1:] != key.shape[1:]:
        return ValueError(
            f"value heads/head_size {tuple(value.shape[1:])} differ from key's "
            f"{tuple(key.shape[1:])}"
        )
    for name, c in (("key_cache", key_cache), ("value_cache", value_cache)):
        if c.dim() != 4 or c.dtype not in _CACHE_DTYPES:
            return ValueError(
                f"{name} must be [num_blocks, block_size, num_kv_heads, head_size] in "
                f"float8_e4m3fn (or a uint8 view of it), got shape {tuple(c.shape)} "
                f"dtype {c.dtype}"
            )
        if c.shape[2:] != key.shape[1:]:
            return ValueError(
                f"{name} heads/head_size {tuple(c.shape[2:])} do not match key's "
                f"{tuple(key.shape[1:])}"
            )
    if key_cache.shape[:2] != value_cache.shape[:2]:
        return ValueError(
            f"key_cache and value_cache blocks differ: {tuple(key_cache.shape[:2])} vs "
            f"{tuple(value_cache.shape[:2])}"
        )
    if slot_mapping.dim() != 1 or slot_mapping.dtype not in _SLOT_DTYPES:
        return ValueError(
            f"slot_mapping must be a 1-D int32/int64 tensor, got shape "
            f"{tuple(slot_mapping.shape)} dtype {slot_mapping.dtype}"
        )
    num_tokens = slot_mapping.shape[0]
    if key.shape[0] < num_tokens or value.shape[0] < num_tokens:
        return ValueError(
            f"slot_mapping has {num_tokens} tokens but key/value have "
            f"{key.shape[0]}/{value.shape[0]} rows"
        )
    num_heads = key.shape[1]
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not _scale_ok(s, num_heads):
            return ValueError(
                f"{name} must be a float32 tensor with 1 element (per tensor) or "
                f"{num_heads} contiguous ones (per KV head), got shape {tuple(s.shape)} "
                f"dtype {s.dtype}"
            )
    for name, x in (
        ("value", value),
        ("key_cache", key_cache),
        ("value_cache", value_cache),
        ("slot_mapping", slot_mapping),
        ("k_scale", k_scale),
        ("v_scale", v_scale),
    ):
        if x.device != key.device:
            return ValueError(f"{name} is on {x.device} but key is on {key.device}")
    return ValueError("invalid arguments")  # unreachable while both checks agree


def fp8_cache_write(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    *,
    conversion: Conversion | None = None,
) -> None:
    """Quantize ``key``/``value`` to FP8 e4m3fn by their scales and scatter them
    into ``key_cache``/``value_cache`` at ``slot_mapping``, in one launch.

    Layouts and numerics: see the module docstring. ``conversion`` picks the
    fp32 -> e4m3 path (``None``: ``KVSCALE_FP8_CONVERSION``, default ``auto``).
    CPU tensors outside the Triton interpreter go to the torch reference, which
    gives the same bytes.
    """
    args = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if not _arguments_ok(*args):
        raise _explain_bad_arguments(*args)
    if not key.is_cuda and not INTERPRETER:
        fp8_cache_write_reference(
            key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale
        )
        return
    hardware = use_hardware_conversion(key.device, conversion)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    _, num_heads, head_size = key.shape
    # One program writes one token's K and V for a group of heads. Up to 2048
    # elements per tensor per program (8 KV heads x 128 = one program per
    # token, like vLLM's CUDA kernel) keeps per-program work large enough to
    # hide latency while decode batches still spread over many SMs.
    block_d = triton.next_power_of_2(head_size)
    block_h = min(triton.next_power_of_2(num_heads), max(1, 2048 // block_d))
    tile = block_h * block_d
    # ~8 elements (one 16-byte bf16 vector) per thread per tensor.
    num_warps = max(1, min(8, tile // 256))
    # Both conversions produce bytes; a uint8 view (same element size, so any
    # strides) gives the kernel one pointer type. vLLM's caches already are uint8.
    if key_cache.dtype != torch.uint8:
        key_cache = key_cache.view(torch.uint8)
    if value_cache.dtype != torch.uint8:
        value_cache = value_cache.view(torch.uint8)
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _fp8_cache_write_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        k_scale,
        v_scale,
        *key.stride(),
        *value.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        NUM_HEADS=num_heads,
        HEAD_SIZE=head_size,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        K_PER_HEAD=k_scale.numel() != 1,
        V_PER_HEAD=v_scale.numel() != 1,
        HARDWARE_CONVERT=hardware,
        num_warps=num_warps,
        # Bit-exactness rests on IEEE single operations; never let the compiler
        # contract float operations into FMAs (also silences Triton 3.9's
        # notice about the changing default).
        enable_fp_fusion=False,
    )
