"""Scales from a trainer's own forward pass (RL: the old-log-prob pass over the rollout).

``record_kv_scales(model)`` wraps forwards the trainer already runs on its transformers
model; ``scales()`` then returns the FP8 KV-cache scales of what those forwards put
through attention, named and shaped as a checkpoint stores them, ready to append to the
weights a trainer sends to the engine::

    with record_kv_scales(model, group=dp_group) as rec:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    weights.update(rec.scales("tensor"))

With ``in_force`` (the scales last synced to the engine), the same forward also counts
the elements the cache would clip with them, and ``rec.drift()`` says whether to sync
fresh scales (``drift``: amax ratio and clipped fraction per layer, a one-line verdict)::

    with record_kv_scales(model, in_force=synced) as rec:
        ...
    if rec.drift().refresh:
        synced = rec.scales("tensor")

The recording is ``kvscale calibrate``'s (``observer.KVRecorder``): keys after k-norm
and rotary embedding, values, per KV head, at the positions the attention mask keeps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from kvscale_plugin.calibration.common import CalibrationError, check_scheme, sorted_modules
from kvscale_plugin.calibration.drift import (
    Drift,
    DriftThresholds,
    count_clipped,
    drift_of,
    thresholds_from_scales,
)
from kvscale_plugin.calibration.maths import reads_other_cache, scale_from_amax
from kvscale_plugin.calibration.observer import KVRecorder


class KVScaleRecorder(KVRecorder):
    """A ``KVRecorder`` whose maxima are max-reduced over ``group`` (data-parallel ranks)
    and turned into checkpoint scale tensors by ``scales``; with ``in_force``, also the
    clipped elements per head that ``drift`` reports (sum-reduced over ``group``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        group: Any = None,
        in_force: Mapping[str, Any] | None = None,
        thresholds: DriftThresholds | None = None,
    ) -> None:
        super().__init__(model)
        self.group = group
        config = model.config  # type: ignore[union-attr]
        self._config: dict[str, Any] = config.to_dict() if hasattr(config, "to_dict") else {}
        self.thresholds = thresholds or DriftThresholds()
        #: module -> (K, V) clip thresholds 448 * scale in force, [1, H or 1, 1, 1].
        self._limits = (
            None if in_force is None else thresholds_from_scales(in_force, self.module_names)
        )
        #: module -> (K, V) clipped elements per head; elements per head recorded.
        self.clipped: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.elements: dict[str, torch.Tensor | int] = {}
        self._counts_reduced = False

    def __enter__(self) -> KVScaleRecorder:
        super().__enter__()
        return self

    def record(
        self,
        module: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> None:
        super().record(module, key, value, valid)
        if self._limits is None:
            return
        name = self.module_names[id(module)]
        limits = self._limits.get(name)
        if limits is None:
            return  # no scale in force (e.g. a layer reading another layer's cache)
        if limits[0].device != key.device:
            limits = self._limits[name] = (limits[0].to(key.device), limits[1].to(key.device))
        ck, cv = count_clipped(key, limits[0], valid), count_clipped(value, limits[1], valid)
        positions = key.shape[0] * key.shape[2] if valid is None else valid.sum()
        n = positions * key.shape[3]
        if name in self.clipped:
            ck, cv = ck + self.clipped[name][0], cv + self.clipped[name][1]
            n = n + self.elements[name]
        self.clipped[name], self.elements[name] = (ck, cv), n

    def drift(self) -> Drift:
        """How the recorded K / V fit the scales in force (``in_force``): per layer the
        amax ratio and clipped fraction, ``refresh`` and a one-line ``verdict`` (see
        ``drift.DriftThresholds``). With ``group``, a collective like ``scales``: the
        maxima max-reduced, the counts summed over the ranks, once: call it after the
        forwards (a later call returns the same report; forwards after it are not
        reduced again -- record them in a new context)."""
        if self._limits is None:
            raise CalibrationError(
                "drift() needs the scales in force: record_kv_scales(model, in_force=scales)"
            )
        if self.group is not None:
            self._reduce()
            self._reduce_counts()
        self.check_recorded("report drift")
        amax = {n: (self.k[n], self.v[n]) for n in self.k}
        return drift_of(amax, self.clipped, self.elements, self._limits, self.thresholds)

    def _reduce_counts(self) -> None:
        """Sum-reduce ``clipped`` and ``elements`` over ``group`` (once)."""
        import torch.distributed as dist

        if self._counts_reduced or not self.clipped:
            return
        names = sorted_modules(self.clipped)
        heads = [self.clipped[n][0].numel() for n in names]
        on = self.clipped[names[0]][0].device
        counts = [torch.as_tensor(self.elements[n], dtype=torch.int64, device=on) for n in names]
        flat = torch.cat([*(torch.cat(self.clipped[n]) for n in names), torch.stack(counts)])
        if dist.get_backend(self.group) == "gloo":
            flat = flat.cpu()
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        flat = flat.to(on)
        at = 0
        for name, h in zip(names, heads, strict=True):
            self.clipped[name] = (flat[at : at + h], flat[at + h : at + 2 * h])
            at += 2 * h
        for name, count in zip(names, flat[at:], strict=True):
            self.elements[name] = count
        self._counts_reduced = True

    def scales(self, scheme: str = "tensor") -> dict[str, torch.Tensor]:
        """``<attention module>.k_scale`` / ``.v_scale`` -> float32 CPU tensor, ``[1]``
        for ``tensor``, ``[num_kv_heads, 1, 1]`` for ``attn_head`` (``amax / 448``,
        floored; see ``maths``). Layers that read another layer's KV cache get none.

        With ``group``, a collective: every rank of the group calls it, after its
        forwards, and all get the same scales (the maxima over all ranks' batches).
        Raises ``CalibrationError`` when nothing usable was recorded (never 1.0 scales).
        """
        check_scheme(scheme, CalibrationError)
        if self.group is not None:
            self._reduce()
        self.check_recorded("compute scales")
        names = sorted_modules(self.k)
        shared = set(reads_other_cache(self._config, names))
        return {
            f"{name}.{kind}_scale": scale_from_amax(amax[name], scheme).cpu()
            for name in names
            if name not in shared
            for kind, amax in (("k", self.k), ("v", self.v))
        }

    def _reduce(self) -> None:
        """Max-reduce ``k``, ``v`` and ``tokens`` over ``group`` (idempotent)."""
        import torch.distributed as dist

        names = sorted_modules(self.k)
        every: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, names, group=self.group)
        if any(other != names for other in every):
            counts = ", ".join(f"rank {r}: {len(n)}" for r, n in enumerate(every))
            raise CalibrationError(
                f"the ranks recorded different attention layers ({counts}): every rank of "
                "the group must run its forward inside record_kv_scales on the same model"
            )
        if not names:
            return  # check_recorded says so, on every rank
        heads = [self.k[n].numel() for n in names]
        on = self.k[names[0]].device
        tokens = [torch.as_tensor(self.tokens[n], dtype=torch.float32, device=on) for n in names]
        flat = torch.cat([*(torch.cat([self.k[n], self.v[n]]) for n in names), torch.stack(tokens)])
        if dist.get_backend(self.group) == "gloo":
            flat = flat.cpu()  # gloo reduces CPU tensors
        dist.all_reduce(flat, op=dist.ReduceOp.MAX, group=self.group)
        flat = flat.to(on)
        at = 0
        for name, h in zip(names, heads, strict=True):
            self.k[name], self.v[name] = flat[at : at + h], flat[at + h : at + 2 * h]
            at += 2 * h
        for name, count in zip(names, flat[at:], strict=True):
            self.tokens[name] = count


def record_kv_scales(
    model: torch.nn.Module,
    *,
    group: Any = None,
    in_force: Mapping[str, Any] | None = None,
    thresholds: DriftThresholds | None = None,
) -> KVScaleRecorder:
    """A context manager recording, during the forwards of ``model`` it wraps, what an
    FP8 KV cache would store; its ``scales(scheme)`` are the scales to send.

    ``model``: the transformers model (FSDP2-sharded or not; a DDP wrapper's
    ``.module``). ``group``: a ``torch.distributed`` process group (e.g. the
    data-parallel group) to max-reduce over; None: this process's forwards only. The
    forwards compute exactly what they compute without it (logits and gradients).
    ``in_force``: the scales the engine serves now (``<module>.k_scale`` / ``.v_scale``
    -> tensor, per tensor or per head, as ``scales()`` returns them): the forwards then
    also count what they would clip, for ``drift()``; ``thresholds``: when ``drift()``
    says refresh (``DriftThresholds()`` by default).
    """
    return KVScaleRecorder(model, group=group, in_force=in_force, thresholds=thresholds)
