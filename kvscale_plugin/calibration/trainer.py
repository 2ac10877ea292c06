"""Scales from a trainer's own forward pass (RL: the old-log-prob pass over the rollout).

``record_kv_scales(model)`` wraps forwards the trainer already runs on its transformers
model; ``scales()`` then returns the FP8 KV-cache scales of what those forwards put
through attention, named and shaped as a checkpoint stores them, ready to append to the
weights a trainer sends to the engine::

    with record_kv_scales(model, group=dp_group) as rec:
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    weights.update(rec.scales("tensor"))

The recording is ``kvscale calibrate``'s (``observer.KVRecorder``): keys after k-norm
and rotary embedding, values, per KV head, at the positions the attention mask keeps.
"""

from __future__ import annotations

from typing import Any

import torch

from kvscale_plugin.calibration.common import CalibrationError, check_scheme, sorted_modules
from kvscale_plugin.calibration.maths import reads_other_cache, scale_from_amax
from kvscale_plugin.calibration.observer import KVRecorder


class KVScaleRecorder(KVRecorder):
    """A ``KVRecorder`` whose maxima are max-reduced over ``group`` (data-parallel ranks)
    and turned into checkpoint scale tensors by ``scales``."""

    def __init__(self, model: torch.nn.Module, *, group: Any = None) -> None:
        super().__init__(model)
        self.group = group
        config = model.config  # type: ignore[union-attr]
        self._config: dict[str, Any] = config.to_dict() if hasattr(config, "to_dict") else {}

    def __enter__(self) -> KVScaleRecorder:
        super().__enter__()
        return self

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


def record_kv_scales(model: torch.nn.Module, *, group: Any = None) -> KVScaleRecorder:
    """A context manager recording, during the forwards of ``model`` it wraps, what an
    FP8 KV cache would store; its ``scales(scheme)`` are the scales to send.

    ``model``: the transformers model (FSDP2-sharded or not; a DDP wrapper's
    ``.module``). ``group``: a ``torch.distributed`` process group (e.g. the
    data-parallel group) to max-reduce over; None: this process's forwards only. The
    forwards compute exactly what they compute without it (logits and gradients).
    """
    return KVScaleRecorder(model, group=group)
