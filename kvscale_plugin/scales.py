"""Checkpoint-first KV scale resolution (pure torch; imports no host).

One path, no runtime estimation: scale placeholders start at ``SENTINEL``;
whatever the checkpoint loaded into them decides the layer's scales.

* k and v loaded            -> use them
* neither loaded            -> 1.0 (the caller warns once: scheme declared, scales missing)
* only one (legacy kv_scale) -> use it for both
* FP8-fnuz platforms         -> x2 (computed from the loaded values every time,
                               so a reload never compounds it)

Only per-tensor scalars are accepted; a loaded value that is 0, negative, NaN or
inf is corrupt and is reported with every other corrupt tensor in one error.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

import torch

#: Value a scale placeholder holds until the checkpoint writes it: never a valid scale.
SENTINEL = -1.0


class ScaleSource(str, Enum):
    CHECKPOINT = "checkpoint"  # both k and v came from the checkpoint
    DUPLICATED = "duplicated"  # one scale (legacy kv_scale) used for k and v
    DEFAULT = "default"  # none loaded: 1.0
    UNSCALED = "unscaled"  # scheme unsupported or cache not FP8: checkpoint ignored


@dataclass(frozen=True)
class ResolvedScales:
    k: float
    v: float
    source: ScaleSource


class CorruptScaleError(ValueError):
    """Raised when loaded KV scales cannot be served (0, negative, NaN, inf, not scalar)."""


def scale_problem(value: torch.Tensor | float) -> str | None:
    """Why a loaded scale cannot be used, or None when it is a valid per-tensor scale."""
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            return f"dtype {value.dtype} is not a float scale (expected float32/bf16/fp16)"
        if value.numel() != 1:
            return (
                f"shape {tuple(value.shape)} is not a per-tensor scalar "
                "(per-channel / per-head KV scales are not supported)"
            )
        value = float(value.detach().float().reshape(()).item())
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return f"{value} (infinite)"
    if value == 0.0:
        return "0 (a zero scale turns the FP8 cache into NaN/inf)"
    if value < 0.0:
        return f"{value} (negative)"
    return None


def format_corrupt_scales(problems: Mapping[str, str]) -> str:
    """The error text for every corrupt scale tensor, one per line."""
    lines = "\n".join(f"  - {name}: {why}" for name, why in sorted(problems.items()))
    return (
        f"kvscale: {len(problems)} KV-cache scale tensor(s) in the checkpoint cannot be "
        f"used:\n{lines}\n"
        "Serving with these would silently corrupt the FP8 KV cache. Re-calibrate the "
        "checkpoint (llm-compressor), fix or remove these tensors, or serve without an "
        "FP8 KV cache (--kv-cache-dtype bfloat16)."
    )


def check_scales(named_values: Iterable[tuple[str, torch.Tensor | float]]) -> None:
    """Raise one ``CorruptScaleError`` naming every bad tensor; return if all are valid."""
    problems = {
        name: why for name, value in named_values if (why := scale_problem(value)) is not None
    }
    if problems:
        raise CorruptScaleError(format_corrupt_scales(problems))


def _loaded(value: float) -> bool:
    # Anything the loader accepted is > 0 (corrupt values are rejected earlier);
    # the untouched placeholder still holds SENTINEL.
    return value != SENTINEL


def resolve_kv_scales(k: float, v: float, *, fnuz: bool = False) -> ResolvedScales:
    """Resolve a layer's k/v scales from what the checkpoint loaded (or SENTINEL).

    Raises ``CorruptScaleError`` if a loaded value is not a positive finite number.
    """
    check_scales((name, val) for name, val in (("k_scale", k), ("v_scale", v)) if _loaded(val))
    factor = 2.0 if fnuz else 1.0
    if _loaded(k) and _loaded(v):
        return ResolvedScales(k * factor, v * factor, ScaleSource.CHECKPOINT)
    if not _loaded(k) and not _loaded(v):
        return ResolvedScales(1.0, 1.0, ScaleSource.DEFAULT)
    only = k if _loaded(k) else v
    return ResolvedScales(only * factor, only * factor, ScaleSource.DUPLICATED)


def unscaled() -> ResolvedScales:
    """Scales for a cache that must not use the checkpoint's tensors."""
    return ResolvedScales(1.0, 1.0, ScaleSource.UNSCALED)
