"""The load cycle, decided once for every host: what each scale tensor a loader is given
holds (``read_scale``), whether a layer serves the checkpoint's k/v scales
(``serves_checkpoint_scales``), and what a load or reload does with what it loaded
(``decide``). The host adapters translate their host's API to these calls and back.

A layer's cache serves checkpoint scales when it is a statically quantized cache
(FP8 with one scale per layer or per head) and the scheme allows it: a supported scheme,
or -- where the host's stock code does so (vLLM) -- no scheme and an FP8 cache the user
asked for. Caches that compute their scales on the fly (vLLM's ``fp8_per_token_head`` and
the int8 / int4 per-token-head modes) and layers kept out of the quantized cache
(``--kv-cache-dtype-skip-layers``: their dtype is the model's) never do: their checkpoint
scales are neither applied nor validated as served.

The one rule for a load cycle (start-up load, or a reload: an in-place weight update)
per attention layer, given whether it serves checkpoint scales:

============================================  ==============================================
what the cycle loaded                         outcome
============================================  ==============================================
a corrupt scale anywhere, cache serves them   start-up: refused (the load raises, naming
                                              every bad tensor as on disk); reload: every
                                              layer keeps the scales in force, and the host
                                              refuses the reload once it has finished
a corrupt scale, cache does not use them      nothing served changes (the corrupt values
(bf16, a scheme kvscale does not serve)       never become the scales in force); one warning
                                              names the tensors
valid k and/or v scales                       served (resolved: one k_scale / v_scale /
                                              kv_scale for both), in place
no scale for the layer, reload                the scales in force are kept (one warning per
                                              engine: a trainer's update carries none)
no scale for the layer, start-up              1.0 (one warning for a declared scheme,
                                              none after a dummy load)
============================================  ==============================================

Pure: hosts hand in plain tensors and flags, never a host object.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

import torch

from kvscale_plugin._log import shorten
from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.scales import (
    CorruptScales,
    ResolvedScales,
    ScaleProblem,
    ScaleSource,
    resolve_kv_scales,
    scale_problem_records,
    unscaled,
)
from kvscale_plugin.scheme import SchemeVerdict

#: Zero points a checkpoint may ship beside its scales: accepted and dropped (the KV
#: cache is quantized symmetrically; a non-zero one is warned about).
ZERO_POINT_NAMES = ("q_zero_point", "k_zero_point", "v_zero_point")

#: Cache dtypes (suffix) whose scales are computed per token and head as the cache is written.
DYNAMIC_SUFFIX = "per_token_head"


def computes_own_scales(cache_dtype: str) -> bool:
    """The cache quantizes with scales it computes itself (checkpoint scales unused)."""
    return str(cache_dtype).endswith(DYNAMIC_SUFFIX)


def serves_checkpoint_scales(verdict: SchemeVerdict, cache_dtype: str, *, quantized: bool) -> bool:
    """Whether a layer whose cache is ``cache_dtype`` (``quantized``: the host says it is
    a quantized cache) serves the checkpoint's k/v scales: a supported scheme, or no
    scheme and an FP8 cache the user chose (vLLM's stock code loads per-tensor scales
    then; SGLang builds no KV method without a scheme, so it never asks)."""
    if not quantized or computes_own_scales(cache_dtype):
        return False
    return verdict.supported or not verdict.declared


def dynamic_scales_notice(cache_dtype: str) -> str:
    """The one line said (once per engine) for a cache that computes its own scales."""
    return (
        f"kvscale: --kv-cache-dtype {cache_dtype} computes its k/v scales per token and head "
        "as it writes the cache: the checkpoint's k/v scales are not used (nor checked)."
    )


def read_scale(
    tensor_name: str,
    loaded: torch.Tensor,
    heads: HeadLayout | None = None,
    *,
    is_query: bool = False,
) -> tuple[tuple[float, ...] | None, list[ScaleProblem]]:
    """What one scale tensor a loader is given holds for this rank: ``(values, [])`` with
    one value (per-tensor) or this rank's heads (``heads``: a per-head scheme), or
    ``(None, problems)``. Every element of the full tensor is checked (all heads, not only
    this rank's), and a tensor whose heads cannot be placed on this rank is a problem."""
    shape = tuple(loaded.shape)
    expected = None if heads is None else heads.expected_heads(shape, is_query=is_query)
    problems = scale_problem_records(tensor_name, loaded, num_heads=expected)
    if not problems and heads is not None and heads.heads is None:
        problems = [ScaleProblem(tensor_name, str(heads.problem))]
    if problems:
        return None, problems
    values = loaded.detach().float().reshape(-1)
    if heads is None:
        return (float(values[0]),), []
    return heads.take(values, is_query=is_query), []


class Action(str, Enum):
    """What a layer's post-load processing does with its served scales."""

    SERVE = "serve"  # write ``Outcome.resolved`` (in place)
    KEEP = "keep"  # leave the scales in force as they are
    REFUSE = "refuse"  # a start-up load with corrupt scales: raise naming every tensor


@dataclass(frozen=True)
class Outcome:
    """The decision for one layer of a load cycle (``decide``)."""

    action: Action
    resolved: ResolvedScales | None = None  # what SERVE writes
    # KEEP of a reload refused for corrupt scales (the host refuses it once it finished).
    refused: bool = False
    # KEEP of a reload that carried no scale for this layer (warned about once).
    carried_none: bool = False
    # Corrupt scales the layer's cache does not use (warned about, never served).
    unused_corrupt: bool = False

    @property
    def missing(self) -> bool:
        """SERVE of 1.0 for a layer that serves checkpoint scales but loaded none."""
        return self.resolved is not None and self.resolved.source is ScaleSource.DEFAULT


def decide(
    *,
    serves: bool,
    reload: bool,
    corrupt: bool,
    k: tuple[float, ...] | None,
    v: tuple[float, ...] | None,
    fnuz: bool = False,
) -> Outcome:
    """The rule of the module docstring for one layer: ``serves`` (its cache serves
    checkpoint scales: ``serves_checkpoint_scales``), ``reload`` (the layer has served
    before), ``corrupt`` (the cycle refused a tensor anywhere in the model), ``k`` / ``v``
    (what the cycle loaded for this layer, validated; None: nothing)."""
    if not serves:
        return Outcome(Action.SERVE, unscaled(), unused_corrupt=corrupt)
    if corrupt:
        return Outcome(Action.KEEP, refused=True) if reload else Outcome(Action.REFUSE)
    if k is None and v is None and reload:
        return Outcome(Action.KEEP, carried_none=True)
    return Outcome(Action.SERVE, resolve_kv_scales(k, v, fnuz=fnuz))


def unused_corrupt_message(corrupt: CorruptScales) -> str:
    """The warning for corrupt scales a cache does not use (a bf16 cache: an FP8 start
    would refuse them)."""
    return (
        "kvscale: the KV cache does not use the checkpoint's k/v scales (it is not FP8), "
        "so these corrupt ones are not served, and the engine goes on as before; an FP8 "
        "KV cache would refuse this checkpoint:\n"
        + corrupt.message()
        + "\nFix or re-calibrate them (check with `kvscale inspect`)."
    )


def reload_without_scales_message(layer_names: Iterable[str]) -> str:
    """The warning for a reload that gave layers that serve checkpoint scales none."""
    return (
        "kvscale: the reloaded weights carry no k_scale/v_scale tensors for "
        f"{shorten(layer_names)}, although the checkpoint declares a kv_cache_scheme; those "
        "layers keep the scales they had (1.0 after a dummy start). Reload a checkpoint with "
        "calibrated KV scales (kvscale calibrate), or serve with a bf16 KV cache."
    )


def refused_reload_message(corrupt: CorruptScales, host: str) -> str:
    """The error of a reload refused for corrupt scales (``corrupt``: named as on disk)."""
    return (
        corrupt.message()
        + "\nThe reload's KV scales are refused: every attention layer keeps the KV scales "
        f"it had. The reload's other weights are in place ({host} loads them before the "
        "scales can be checked): reload a checkpoint with valid KV scales (check it with "
        "`kvscale inspect`) before relying on this engine's outputs."
    )
