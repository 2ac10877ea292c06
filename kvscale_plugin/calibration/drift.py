"""Drift of an RL trainer's keys and values against the FP8 KV-cache scales in force.

``record_kv_scales(model, in_force=scales)`` counts, on the forward the trainer already
runs, how what the cache would store fits the scales the engine serves (the ones last
synced); ``rec.drift()`` then says, per attention layer and per K / V:

* the **amax ratio**: recorded amax / (448 * scale in force), the max over KV heads
  (above 1: the cache clips; far below 1: the scale wastes FP8's range);
* the **clipped fraction**: the share of K (V) elements with ``|x| > 448 * scale``, the
  elements an FP8 cache write clamps (padding never counted);

and a one-line verdict with ``refresh`` (sync fresh scales) or ``keep``::

    with record_kv_scales(model, in_force=synced) as rec:
        logits = model(**batch).logits
    report = rec.drift()
    if report.refresh:
        synced = rec.scales("tensor")   # and send them with the weights
    print(report.verdict)               # keep: max amax ratio 0.83, nothing clips

``DriftThresholds`` holds when to refresh (see its fields for the defaults and why).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvscale_plugin.calibration.common import CalibrationError, sorted_modules
from kvscale_plugin.fp8 import FP8_E4M3_MAX


@dataclass(frozen=True)
class DriftThresholds:
    """When ``drift()`` says refresh.

    ``max_clipped``: a layer's K or V clipping more than this fraction of its elements
    (default 5e-4 = 0.05%). Clipping is the failure that costs log-prob (a clamped key
    moves every attention logit it takes part in). On SmolLM2-135M
    (``benchmarks/rl_drift.py``, docs/rl-drift.md) fresh scales never beat stale ones
    beyond noise while the worst layer clipped at most 0.027% of its elements, and did
    from 0.09%: 0.05% sits between. Lower it to refresh earlier (a refresh is cheap when
    the loop syncs weights anyway).
    ``min_ratio``: a layer's amax ratio under this (default 1/16: the top four binades of
    FP8's range unused, so the smallest values start to fall into e4m3's subnormals; above
    it FP8's relative precision is the same at any ratio). 0 turns that check off.
    """

    max_clipped: float = 5e-4
    min_ratio: float = 1 / 16


@dataclass(frozen=True)
class KindDrift:
    """One layer's K or V against its scale in force."""

    #: Recorded amax / (448 * scale in force), per KV head (one value per head).
    ratios: list[float]
    #: Elements over ``448 * scale``, per KV head.
    clipped_counts: list[int]
    #: Elements recorded per KV head (real positions x head_dim).
    elements_per_head: int

    @property
    def ratio(self) -> float:
        """The max amax ratio over the heads."""
        return max(self.ratios)

    @property
    def clipped(self) -> float:
        """Fraction of this layer's K (or V) elements that clip."""
        total = self.elements_per_head * len(self.clipped_counts)
        return sum(self.clipped_counts) / total if total else 0.0


@dataclass(frozen=True)
class LayerDrift:
    """One attention layer (``model.layers.N.self_attn``)."""

    name: str
    k: KindDrift
    v: KindDrift


@dataclass(frozen=True)
class Drift:
    """What ``KVScaleRecorder.drift()`` returns."""

    layers: list[LayerDrift]
    refresh: bool
    #: One line: ``refresh: layer 7 v clips 0.40% (amax ratio 1.31)`` or
    #: ``keep: max amax ratio 0.83, nothing clips``.
    verdict: str
    thresholds: DriftThresholds = field(default_factory=DriftThresholds)

    @property
    def max_ratio(self) -> float:
        return max(max(layer.k.ratio, layer.v.ratio) for layer in self.layers)

    @property
    def min_ratio(self) -> float:
        return min(min(layer.k.ratio, layer.v.ratio) for layer in self.layers)

    @property
    def max_clipped(self) -> float:
        """The largest clipped fraction of any layer's K or V."""
        return max(max(layer.k.clipped, layer.v.clipped) for layer in self.layers)

    @property
    def clipped(self) -> float:
        """Clipped fraction over all K and V elements of all layers."""
        n = sum(sum(x.clipped_counts) for layer in self.layers for x in (layer.k, layer.v))
        total = sum(
            x.elements_per_head * len(x.clipped_counts)
            for layer in self.layers
            for x in (layer.k, layer.v)
        )
        return n / total if total else 0.0


def layer_label(name: str) -> str:
    """``model.layers.7.self_attn`` -> ``layer 7`` (other names as they are)."""
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return f"layer {m.group(1)}" if m else name


def _pct(x: float) -> str:
    return f"{x * 100:.2g}%" if x < 0.001 else f"{x * 100:.2f}%"


def verdict_of(layers: list[LayerDrift], thresholds: DriftThresholds) -> tuple[bool, str]:
    """(refresh, the one-line verdict) for ``layers``."""
    kinds = [
        (layer.name, kind, x) for layer in layers for kind, x in (("k", layer.k), ("v", layer.v))
    ]
    name, kind, worst = max(kinds, key=lambda t: (t[2].clipped, t[2].ratio))
    over = sum(x.clipped > thresholds.max_clipped for _, _, x in kinds)
    if worst.clipped > thresholds.max_clipped:
        more = (
            f"; {over} of {len(kinds)} K/V over {_pct(thresholds.max_clipped)}" if over > 1 else ""
        )
        line = (
            f"refresh: {layer_label(name)} {kind} clips {_pct(worst.clipped)} "
            f"(amax ratio {worst.ratio:.2f}){more}"
        )
        return True, line
    # A K or V that is all zeros (amax 0) has nothing to store: no scale is too large.
    live = [t for t in kinds if t[2].ratio > 0] or kinds
    lname, lkind, low = min(live, key=lambda t: t[2].ratio)
    if 0 < low.ratio < thresholds.min_ratio:
        return True, (
            f"refresh: {layer_label(lname)} {lkind} amax ratio {low.ratio:.3f} < "
            f"{thresholds.min_ratio:.3g} (scale too large for what the layer now stores)"
        )
    top = max(x.ratio for _, _, x in kinds)
    if worst.clipped == 0:
        return False, f"keep: max amax ratio {top:.2f}, nothing clips"
    return False, (
        f"keep: max amax ratio {top:.2f}, at most {_pct(worst.clipped)} clips "
        f"({layer_label(name)} {kind}; threshold {_pct(thresholds.max_clipped)})"
    )


def thresholds_from_scales(
    in_force: Mapping[str, Any], names: Mapping[int, str]
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """attention module -> (K, V) clip thresholds ``448 * scale`` as float32 ``[1, H or 1,
    1, 1]``, from ``in_force`` (``<module>.k_scale`` / ``.v_scale`` -> tensor or number,
    as ``scales()`` returns them); modules with neither are left out."""
    modules = set(names.values())
    out: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    unknown = []
    for key in in_force:
        base, _, kind = key.rpartition(".")
        if kind not in ("k_scale", "v_scale") or base not in modules:
            unknown.append(key)
    if unknown:
        raise CalibrationError(
            f"in_force names no attention module of this model: {', '.join(sorted(unknown)[:3])}"
            " (expected '<attention module>.k_scale' / '.v_scale', as scales() names them)"
        )
    for base in sorted_modules({k.rpartition(".")[0] for k in in_force}):
        pair = []
        for kind in ("k_scale", "v_scale"):
            if f"{base}.{kind}" not in in_force:
                raise CalibrationError(f"in_force has {base}'s other scale but not .{kind}")
            s = torch.as_tensor(in_force[f"{base}.{kind}"], dtype=torch.float32).detach().cpu()
            if not (torch.isfinite(s).all() and (s > 0).all()):
                raise CalibrationError(f"in_force {base}.{kind}: not finite and positive")
            pair.append((s.reshape(1, -1, 1, 1) * FP8_E4M3_MAX).float())
        out[base] = (pair[0], pair[1])
    return out


def count_clipped(
    x: torch.Tensor, threshold: torch.Tensor, valid: torch.Tensor | None
) -> torch.Tensor:
    """Per KV head, the elements of ``x`` ``[batch, kv_heads, seq, head_dim]`` with
    ``|x| > threshold`` (``[1, kv_heads or 1, 1, 1]``) at the ``valid`` ``[batch, seq]``
    positions (None: all), as an int64 ``[kv_heads]`` tensor (no device sync)."""
    if threshold.shape[1] not in (1, x.shape[1]):
        raise CalibrationError(
            f"a scale in force has {threshold.shape[1]} values, the layer {x.shape[1]} KV heads"
        )
    over = x.detach().abs() > threshold
    if valid is not None:
        over &= valid[:, None, :, None]
    return over.sum(dim=(0, 2, 3))


def drift_of(
    amax: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    clipped: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    elements: Mapping[str, Any],
    thresholds_in_force: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    thresholds: DriftThresholds,
) -> Drift:
    """The report from per-layer (K, V) maxima and clipped counts per head, elements per
    head, and the clip thresholds in force (layers without a scale in force: left out)."""
    layers = []
    for name in sorted_modules(n for n in clipped if n in thresholds_in_force):
        kinds = []
        for i in (0, 1):
            limit = thresholds_in_force[name][i].reshape(-1)
            ratios = (amax[name][i].detach().float().cpu() / limit).tolist()
            counts = clipped[name][i].cpu().tolist()
            kinds.append(KindDrift(ratios, counts, int(elements[name])))
        layers.append(LayerDrift(name, kinds[0], kinds[1]))
    if not layers:
        raise CalibrationError(
            "no recorded attention layer has a scale in force: in_force must name this "
            "model's attention modules ('<module>.k_scale' / '.v_scale')"
        )
    refresh, line = verdict_of(layers, thresholds)
    return Drift(layers, refresh, line, thresholds)
