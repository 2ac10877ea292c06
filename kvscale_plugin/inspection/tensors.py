"""Classifying and decoding scale tensors: naming, scale-likeness, values and their problems.

The value rules are the core's (``scales.scale_problems``, ``per_head_shape_ok``):
the ones kvscale's loaders apply. Only tensors of at most
``checkpoint.MAX_DECODE_ELEMENTS`` elements are decoded (by the ``safetensors``
library, through ``Checkpoint.read_tensor``).
"""

from __future__ import annotations

import math
import re

from kvscale_plugin.checkpoint import MAX_DECODE_ELEMENTS, Checkpoint, TensorInfo
from kvscale_plugin.fp8 import per_head_shape_ok
from kvscale_plugin.inspection.records import Naming, TensorProblem

# kvscale_plugin.scales (and with it torch) is imported only where a tensor is judged.

FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
#: Dtypes whose elements are real numbers (decoded to show their values). Not: the
#: packed sub-byte F4 / F6_* (torch has no element type for them) and complex C64.
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


def shape_problem(name: str, shape: tuple[int, ...], heads: int | None) -> str | None:
    """The core's shape message (``scale_problems``), without reading the tensor."""
    if per_head_shape_ok(shape, heads) if heads is not None else math.prod(shape) == 1:
        return None
    import torch

    from kvscale_plugin.scales import scale_problems

    meta = torch.empty(shape, dtype=torch.float32, device="meta")
    return scale_problems(name, meta, num_heads=heads).get(name)


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
    shape_why = shape_problem(info.name, info.shape, heads)
    if shape_why is not None:
        problems.append(TensorProblem("malformed_shape", shape_why))
    if info.dtype not in DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, None, problems
    from kvscale_plugin.scales import scale_problems

    tensor = ckpt.read_tensor(info)
    values = tuple(float(x) for x in tensor.detach().double().reshape(-1).tolist())
    value = values[0] if len(values) == 1 else None
    # Element rules only where the shape is right (a non-float dtype is reported above).
    if shape_why is None and info.dtype in FLOAT_DTYPES:
        for key, why in scale_problems(info.name, tensor, num_heads=heads).items():
            head = key[len(info.name) :].removeprefix("[head ").removesuffix("]")
            problems.append(TensorProblem("corrupt_value", why, int(head) if head else None))
    return value, values, problems


def zero_point_value(ckpt: Checkpoint, info: TensorInfo) -> tuple[float | None, bool]:
    """(value if single, whether any element is non-zero); zero points are never large."""
    if info.dtype not in DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, False
    tensor = ckpt.read_tensor(info)
    nonzero = bool((tensor.double() != 0).any()) if tensor.numel() else False
    value = float(tensor.double().reshape(()).item()) if tensor.numel() == 1 else None
    return value, nonzero
