"""Checkpoint-first KV scale resolution (imports no host, nor torch: callers hand in tensors).

One path, no runtime estimation: whatever the checkpoint loaded decides the
layer's scales. "Not loaded" is ``None``, never a magic number, so no real
value can pass for "missing".

* k and v loaded             -> use them
* neither loaded             -> 1.0 (the caller warns once: scheme declared, scales missing)
* only one (legacy kv_scale) -> use it for both
* FP8-fnuz platforms         -> x2 (computed from the loaded values every time,
                                so a reload never compounds it)

A scale is a per-tensor scalar, or -- for ``strategy: attn_head`` -- one value
per KV head. Every element must be a positive finite float in the plausible range
(``fp8.PLAUSIBLE_SCALE_MIN`` .. ``PLAUSIBLE_SCALE_MAX``); a bad one is reported,
naming the tensor and the head, together with every other bad tensor in one error.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

from kvscale_plugin.fp8 import (
    FLOAT32_MAX,
    FP8_E4M3_MAX,
    PLAUSIBLE_SCALE_MAX,
    PLAUSIBLE_SCALE_MIN,
    per_head_shape_ok,
)

#: Value a host's scale placeholder holds until the checkpoint writes it (vLLM's and
#: SGLang's loaders and dummy loads need *some* number there). Adapters track what
#: was loaded explicitly and pass ``None`` for "not loaded"; this value is negative,
#: so if it ever reached ``resolve_kv_scales`` it would be rejected as corrupt.
SENTINEL = -1.0

#: A resolved or loaded scale: one float per tensor, or one per KV head.
Scale = float | Sequence[float]


class ScaleSource(str, Enum):
    CHECKPOINT = "checkpoint"  # both k and v came from the checkpoint
    DUPLICATED = "duplicated"  # one scale (legacy kv_scale) used for k and v
    DEFAULT = "default"  # none loaded: 1.0
    UNSCALED = "unscaled"  # scheme unsupported or cache not FP8: checkpoint ignored


@dataclass(frozen=True)
class ResolvedScales:
    """A layer's scales. ``k`` / ``v`` are the per-layer numbers a one-scale path
    uses (the max over heads for per-head scales, so that nothing clips);
    ``k_heads`` / ``v_heads`` hold every head's scale (one entry when per-tensor)."""

    k: float
    v: float
    source: ScaleSource
    k_heads: tuple[float, ...] = ()
    v_heads: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not self.k_heads:
            object.__setattr__(self, "k_heads", (self.k,))
        if not self.v_heads:
            object.__setattr__(self, "v_heads", (self.v,))

    @property
    def per_head(self) -> bool:
        return len(self.k_heads) > 1 or len(self.v_heads) > 1


class CorruptScaleError(ValueError):
    """Raised when loaded KV scales cannot be served (0, negative, NaN, inf, bad shape)."""


#: Ends the message of an update (a reload, a weight sync) refused for corrupt scales:
#: every rank refuses it alike, and whoever reads the ranks' answers knows it by this.
REFUSED_MARK = " [kvscale: refused on every rank]"


#: Largest usable scale: the cache's largest value (448) times the scale must stay a
#: finite float32, or dequantizing turns the cache into inf/NaN. No calibration gives one.
MAX_SCALE = FLOAT32_MAX / FP8_E4M3_MAX


def _value_problem(value: float) -> str | None:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return f"{value} (infinite)"
    if value == 0.0:
        return "0 (a zero scale turns the FP8 cache into NaN/inf)"
    if value < 0.0:
        return f"{value} (negative)"
    if value > MAX_SCALE:
        return f"{value} (too large: 448 x scale overflows float32, the cache reads as inf/NaN)"
    if not PLAUSIBLE_SCALE_MIN <= value <= PLAUSIBLE_SCALE_MAX:
        return (
            f"{value:.4g} (implausible: calibrated scales lie between {PLAUSIBLE_SCALE_MIN:g} "
            f"and {PLAUSIBLE_SCALE_MAX:g}; this looks like uninitialised memory, not a "
            "calibration)"
        )
    return None


def rank_kv_heads(total_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The checkpoint KV heads one tensor-parallel rank holds (vLLM's and SGLang's rule):
    partitioned when ``total_kv_heads >= tp_size``, else each head replicated on
    ``tp_size // total_kv_heads`` consecutive ranks."""
    if total_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad layout: {total_kv_heads} KV heads, rank {tp_rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        per_rank = total_kv_heads // tp_size
        return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return (tp_rank // (tp_size // total_kv_heads),)


@dataclass(frozen=True)
class ScaleProblem:
    """Why one scale tensor -- or one head of it -- cannot be served."""

    tensor: str  # the tensor's name, as the loader knows it
    why: str
    head: int | None = None  # the bad element of a per-head tensor; None: the whole tensor
    note: str = ""  # where it was loaded, when the name alone does not say (an MTP draft)

    @property
    def label(self) -> str:
        """How messages name it: ``tensor``, ``tensor[head i]``, plus ``(note)``."""
        head = f"[head {self.head}]" if self.head is not None else ""
        return f"{self.tensor}{head}" + (f" ({self.note})" if self.note else "")


def scale_problem_records(
    name: str, value: torch.Tensor | float, *, num_heads: int | None = None
) -> list[ScaleProblem]:
    """Every reason the loaded ``value`` of tensor ``name`` cannot be served.

    ``num_heads=None``: a per-tensor scalar is expected. ``num_heads=H``: one
    scale per KV head, shaped ``[H]`` or ``[H, 1, 1]``. A dtype/shape problem is
    the whole tensor's (``head=None``); a bad element names its head. Empty = usable.
    """

    if not _is_tensor(value):
        why = _value_problem(float(value))
    elif not value.is_floating_point():
        why = f"dtype {value.dtype} is not a float scale (expected float32/bf16/fp16)"
    else:
        why = shape_problem(tuple(value.shape), num_heads)
        if why is None:
            values = value.detach().float().reshape(-1).tolist()
            return value_problems(name, values, num_heads=num_heads)
    return [ScaleProblem(name, why)] if why is not None else []


def shape_problem(shape: tuple[int, ...], num_heads: int | None) -> str | None:
    """Why a float scale of ``shape`` cannot be served (``scale_problem_records``'s rule)."""
    if num_heads is None:
        if math.prod(shape) != 1:
            return (
                f"shape {shape} is not a per-tensor scalar (the kv_cache_scheme says "
                "strategy 'tensor'; per-head scales need strategy 'attn_head')"
            )
    elif not per_head_shape_ok(shape, num_heads):
        return (
            f"shape {shape} does not match the model's {num_heads} KV heads "
            f"(strategy 'attn_head' expects [{num_heads}, 1, 1] or [{num_heads}])"
        )
    return None


def value_problems(
    name: str, values: Sequence[float], *, num_heads: int | None = None
) -> list[ScaleProblem]:
    """``scale_problem_records`` of a float tensor of the right shape, given as its
    elements in float32 (no torch needed)."""
    if num_heads is None:
        why = _value_problem(values[0])
        return [ScaleProblem(name, why)] if why is not None else []
    return [
        ScaleProblem(name, why, head)
        for head, element in enumerate(values)
        if (why := _value_problem(element)) is not None
    ]


def _is_tensor(value: Any) -> bool:
    """A torch tensor (torch not imported yet: no value can be one)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def scale_problems(
    name: str, value: torch.Tensor | float, *, num_heads: int | None = None
) -> dict[str, str]:
    """``scale_problem_records`` as ``{label: why}``: keys are ``name`` (dtype/shape
    problems) or ``name[head i]`` (a bad element). Empty = usable."""
    return {p.label: p.why for p in scale_problem_records(name, value, num_heads=num_heads)}


class CorruptScales:
    """The corrupt scale tensors one engine's load cycle found, kept by tensor and head
    until the cycle ends (reported together, in one error)."""

    def __init__(self, on_change: Callable[[], None] | None = None) -> None:
        self._records: dict[tuple[str, int | None], ScaleProblem] = {}
        # Told of every change (a load cycle caches the union of its layers' records).
        self._on_change = on_change

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change()

    def add(self, problems: Iterable[ScaleProblem]) -> None:
        for problem in problems:
            self._records[(problem.tensor, problem.head)] = problem
        self._changed()

    def forget(self, tensor: str) -> None:
        """Drop what an earlier load said about ``tensor`` (and each of its heads)."""
        for key in [k for k in self._records if k[0] == tensor]:
            del self._records[key]
        self._changed()

    def forget_under(self, prefix: str) -> None:
        """Drop every record of a tensor named ``prefix.<something>`` (one layer's)."""
        for key in [k for k in self._records if k[0].startswith(prefix + ".")]:
            del self._records[key]
        self._changed()

    def clear(self) -> None:
        self._records.clear()
        self._changed()

    def refile(self, tensor: str, as_tensor: str, *, note: str = "") -> None:
        """Name ``tensor``'s records ``as_tensor`` (with ``note``): e.g. the checkpoint's
        name for what a loader recorded under an engine-side name."""
        for key in [k for k in self._records if k[0] == tensor]:
            old = self._records.pop(key)
            self.add([ScaleProblem(as_tensor, old.why, old.head, note)])

    def renamed(self, names: Mapping[str, str]) -> CorruptScales:
        """A copy with each tensor called ``names[tensor]`` where given: a host adapter
        records problems by its parameter names and reports them by the checkpoint's
        (as written on disk, so a user can find them in the file)."""
        copy = CorruptScales()
        for problem in self._records.values():
            disk = names.get(problem.tensor)
            copy.add([replace(problem, tensor=disk) if disk else problem])
        return copy

    def records(self) -> list[ScaleProblem]:
        return list(self._records.values())

    def update(self, other: CorruptScales) -> None:
        self.add(other.records())

    @classmethod
    def union(cls, *parts: CorruptScales) -> CorruptScales:
        """A new record of every problem in ``parts``."""
        out = cls()
        for part in parts:
            out.update(part)
        return out

    def __bool__(self) -> bool:
        return bool(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def as_mapping(self) -> dict[str, str]:
        return {p.label: p.why for p in self._records.values()}

    def message(self) -> str:
        """The error text naming every corrupt tensor (``format_corrupt_scales``)."""
        return format_corrupt_scales(self.as_mapping())


def format_corrupt_scales(problems: Mapping[str, str]) -> str:
    """The error text for every corrupt scale tensor, one per line."""
    lines = "\n".join(f"  - {name}: {why}" for name, why in sorted(problems.items()))
    return (
        f"kvscale: {len(problems)} KV-cache scale value(s) in the checkpoint cannot be "
        f"used:\n{lines}\n"
        "Serving with these would silently corrupt the FP8 KV cache. Re-calibrate the "
        "checkpoint (llm-compressor, or `kvscale calibrate`), fix or remove these tensors, "
        "or serve without an FP8 KV cache (--kv-cache-dtype bfloat16)."
    )


def _as_tuple(value: Scale) -> tuple[float, ...]:
    if _is_tensor(value):
        return tuple(float(x) for x in value.detach().float().reshape(-1).tolist())
    if isinstance(value, (int, float)):
        return (float(value),)
    return tuple(float(x) for x in value)


def resolve_kv_scales(k: Scale | None, v: Scale | None, *, fnuz: bool = False) -> ResolvedScales:
    """Resolve a layer's k/v scales from what the checkpoint loaded (``None`` = not loaded).

    Scalars or per-head sequences. Raises ``CorruptScaleError`` if a loaded value is
    not a positive finite number, or if k and v have different head counts.
    """
    loaded = {n: _as_tuple(s) for n, s in (("k_scale", k), ("v_scale", v)) if s is not None}
    problems: dict[str, str] = {}
    for name, values in loaded.items():
        if not values:
            problems[name] = "empty (no value)"
        for head, element in enumerate(values):
            why = _value_problem(element)
            if why is not None:
                problems[f"{name}[head {head}]" if len(values) > 1 else name] = why
    if len(loaded) == 2 and len(loaded["k_scale"]) != len(loaded["v_scale"]):
        problems["v_scale"] = (
            f"{len(loaded['v_scale'])} value(s) but k_scale has {len(loaded['k_scale'])}"
        )
    if problems:
        raise CorruptScaleError(format_corrupt_scales(problems))

    factor = 2.0 if fnuz else 1.0
    if not loaded:
        return ResolvedScales(1.0, 1.0, ScaleSource.DEFAULT)
    k_heads = loaded.get("k_scale") or loaded["v_scale"]
    v_heads = loaded.get("v_scale") or loaded["k_scale"]
    k_heads = tuple(x * factor for x in k_heads)
    v_heads = tuple(x * factor for x in v_heads)
    source = ScaleSource.CHECKPOINT if len(loaded) == 2 else ScaleSource.DUPLICATED
    return ResolvedScales(max(k_heads), max(v_heads), source, k_heads, v_heads)


def unscaled() -> ResolvedScales:
    """Scales for a cache that must not use the checkpoint's tensors."""
    return ResolvedScales(1.0, 1.0, ScaleSource.UNSCALED)
