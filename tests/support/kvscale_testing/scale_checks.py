"""The scale checks tests assert, through what the product itself calls: a cycle's tensors
judged by ``scales.scale_problem_records`` (what ``loadcycle.read_scale`` and so every
host's loader runs) into one ``CorruptScales``, refused as a start-up load refuses them;
and a tensor's problems as ``kvscale inspect`` reads them (``scales.scale_problems``)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvscale_plugin.scales import (
    CorruptScaleError,
    CorruptScales,
    scale_problem_records,
    scale_problems,
)


def check_scales(
    named_values: Iterable[tuple[str, torch.Tensor | float]], *, num_heads: int | None = None
) -> None:
    """Raise the ``CorruptScaleError`` a load raises (every bad tensor and head named)."""
    corrupt = CorruptScales()
    for name, value in named_values:
        corrupt.add(scale_problem_records(name, value, num_heads=num_heads))
    if corrupt:
        raise CorruptScaleError(corrupt.message())


def scale_problem(value: torch.Tensor | float, *, num_heads: int | None = None) -> str | None:
    """Every reason one tensor cannot be served, joined (None: it can)."""
    problems = scale_problems("", value, num_heads=num_heads)
    if not problems:
        return None
    return "; ".join(f"{key}: {why}" if key else why for key, why in problems.items())
