"""Classifying and decoding scale tensors: naming, scale-likeness, values and their problems.

The value rules are the core's (``scales.shape_problem``, ``value_problems``: what
``scale_problems`` applies to a loaded tensor, without torch): the ones kvscale's
loaders apply. Only tensors of at most ``checkpoint.MAX_DECODE_ELEMENTS`` elements are
decoded (from their own bytes, ``Checkpoint.read_values``).
"""

from __future__ import annotations

import math
import re
import struct

from kvscale_plugin.checkpoint import MAX_DECODE_ELEMENTS, Checkpoint, TensorInfo
from kvscale_plugin.inspection.records import Naming, TensorProblem
from kvscale_plugin.scales import shape_problem, value_problems

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
#: Dtypes whose elements are real numbers (decoded to show their values). Not: the
#: packed sub-byte F4 / F6_* and complex C64.
DECODABLE = frozenset(
    {
        *("F64", "F32", "F16", "BF16"),
        *("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"),
        *("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"),
    }
)

# Names that look like attention KV / query scales or zero points. A tensor that
# matches but that no rule maps is reported as unmapped (it would be dropped).
SCALE_LIKE = re.compile(
    r"(?:^|\.)(?:[qkv]|kv)_(?:scale|zero_point)$|\.[qkv]_proj\.output_(?:scale|zero_point)$"
)
# Host parameter: "<attention module>.<k|v|q>_<scale|zero_point>".
TARGET = re.compile(r"^(?P<module>.+)\.(?P<kind>[qkv])_(?P<what>scale|zero_point)$")


def naming(name: str) -> Naming:
    """How the checkpoint names this scale (the exporter's convention)."""
    if name.endswith(".kv_scale"):
        return "kv_scale"
    if re.search(r"_proj\.output_scale$", name):
        return "output_scale"
    if re.search(r"zero_point$", name):
        return "zero_point"
    if re.search(r"\.qkv_proj\.[qkv]_scale$", name):
        return "qkv_proj"
    if re.search(r"\.[qkv]_proj\.[qkv]_scale$", name):
        return "k_proj"
    if re.search(r"\.attn\.[qkv]_scale$", name):
        return "host"
    if re.search(r"(?:^|\.)[qkv]_scale$", name):
        return "self_attn"
    return "other"


def _float32(x: float) -> float:
    """``x`` rounded to float32, as the loaders judge a scale (``tensor.float()``)."""
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:  # beyond float32 after rounding
        return math.copysign(math.inf, x)


def decode(
    ckpt: Checkpoint, info: TensorInfo, heads: int | None
) -> tuple[float | None, tuple[float, ...] | None, list[TensorProblem]]:
    """Value (single element), every element, and problems of one scale tensor.

    ``heads=None``: a per-tensor scalar is expected; ``heads=H``: one scale per head
    (``[H, 1, 1]`` or ``[H]``). The rules are the core's (``scales.scale_problems``),
    the ones kvscale's loaders apply.
    """
    problems: list[TensorProblem] = []
    if info.dtype not in FLOAT_DTYPES:
        problems.append(
            TensorProblem(
                "malformed_dtype",
                f"dtype {info.dtype} is not a float type (expected F32, BF16 or F16)",
            )
        )
    shape_why = shape_problem(info.shape, heads)
    if shape_why is not None:
        problems.append(TensorProblem("malformed_shape", shape_why))
    if info.dtype not in DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, None, problems
    values = ckpt.read_values(info)
    value = values[0] if len(values) == 1 else None
    # Element rules only where the shape is right (a non-float dtype is reported above).
    if shape_why is None and info.dtype in FLOAT_DTYPES:
        f32 = [_float32(x) for x in values]
        for p in value_problems(info.name, f32, num_heads=heads):
            problems.append(TensorProblem("corrupt_value", p.why, p.head))
    return value, values, problems


def zero_point_value(ckpt: Checkpoint, info: TensorInfo) -> tuple[float | None, bool]:
    """(value if single, whether any element is non-zero); zero points are never large."""
    if info.dtype not in DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, False
    values = ckpt.read_values(info)
    return (values[0] if len(values) == 1 else None), any(x != 0 for x in values)
