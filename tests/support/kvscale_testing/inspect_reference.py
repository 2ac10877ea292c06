"""``kvscale inspect``'s former torch path, kept as the reference its fast path must equal.

Until the fast path, inspect decoded scale tensors with the ``safetensors`` library as torch
tensors (``Checkpoint.read_tensor``), judged them with the core's torch entry
(``scales.scale_problems``; shapes through a ``meta`` tensor), validated files with
``safe_open(framework="pt")`` and parsed every ``kv_cache_scheme`` with compressed-tensors'
``QuantizationArgs``. ``torch_path()`` puts exactly that back for the duration of a
``with`` block, so a test can run both paths on one checkpoint and compare their output
byte for byte (``tests/unit/test_fuzz_inspect.py``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from unittest import mock

from kvscale_plugin import checkpoint, scheme
from kvscale_plugin.checkpoint import MAX_DECODE_ELEMENTS, Checkpoint, TensorInfo
from kvscale_plugin.fp8 import per_head_shape_ok
from kvscale_plugin.inspection import report
from kvscale_plugin.inspection.records import TensorProblem
from kvscale_plugin.inspection.tensors import DECODABLE, FLOAT_DTYPES


def shape_problem(name: str, shape: tuple[int, ...], heads: int | None) -> str | None:
    if per_head_shape_ok(shape, heads) if heads is not None else math.prod(shape) == 1:
        return None
    import torch

    from kvscale_plugin.scales import scale_problems

    meta = torch.empty(shape, dtype=torch.float32, device="meta")
    return scale_problems(name, meta, num_heads=heads).get(name)


def decode(
    ckpt: Checkpoint, info: TensorInfo, heads: int | None
) -> tuple[float | None, tuple[float, ...] | None, list[TensorProblem]]:
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
    if shape_why is None and info.dtype in FLOAT_DTYPES:
        for key, why in scale_problems(info.name, tensor, num_heads=heads).items():
            head = key[len(info.name) :].removeprefix("[head ").removesuffix("]")
            problems.append(TensorProblem("corrupt_value", why, int(head) if head else None))
    return value, values, problems


def zero_point_value(ckpt: Checkpoint, info: TensorInfo) -> tuple[float | None, bool]:
    if info.dtype not in DECODABLE or info.numel > MAX_DECODE_ELEMENTS:
        return None, False
    tensor = ckpt.read_tensor(info)
    nonzero = bool((tensor.double() != 0).any()) if tensor.numel() else False
    value = float(tensor.double().reshape(()).item()) if tensor.numel() == 1 else None
    return value, nonzero


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Inspect as it was before the fast path: torch decoding, compressed-tensors for
    every scheme, files validated with ``framework="pt"``."""
    safe_open = checkpoint._safe_open
    with (
        mock.patch.object(report, "decode", decode),
        mock.patch.object(report, "zero_point_value", zero_point_value),
        mock.patch.object(scheme, "_plain_args", lambda scheme: None),
        mock.patch.object(checkpoint, "_safe_open", lambda path, fw="pt": safe_open(path, fw)),
    ):
        yield
