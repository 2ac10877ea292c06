"""Which of a layer's checkpoint KV heads one tensor-parallel rank serves (per-head
``attn_head`` schemes), for every host: placed once when the layer is built, read by the
scale loaders (``loadcycle.read_scale``) to keep this rank's heads of a full tensor.

The rule is vLLM's and SGLang's (``scales.rank_kv_heads``): heads are partitioned over
ranks when there are at least as many as ranks, replicated below that. A host may know
several layouts a layer can have been split by (SGLang: the attention TP group, or the
full TP group): the first one that gives the layer its head count is the one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvscale_plugin.scales import rank_kv_heads


@dataclass(frozen=True)
class HeadLayout:
    """Where this rank's KV heads sit among a layer's ``total_kv`` checkpoint KV heads.

    ``heads``: the indices of the per-head scales this rank serves, or ``None`` with
    ``problem`` saying why they cannot be placed. ``total_q``: the query heads (a per-head
    q scale, as llm-compressor writes one, has one value per query head). ``placed_by``:
    the ``(tp_rank, tp_size)`` layout ``place`` found them under (what a fingerprint of
    this rank's heads is computed at)."""

    total_kv: int
    total_q: int
    heads: tuple[int, ...] | None
    problem: str | None = None
    placed_by: tuple[int, int] | None = None

    @classmethod
    def place(
        cls, total_kv: int, local: int, layouts: Iterable[tuple[int, int]], total_q: int = 0
    ) -> HeadLayout:
        """This rank's heads under the first ``(tp_rank, tp_size)`` layout that gives the
        layer its ``local`` KV heads."""
        tried = []
        for rank, size in layouts:
            try:
                heads = rank_kv_heads(total_kv, rank, size)
            except ValueError:
                continue
            if len(heads) == local:
                return cls(total_kv, total_q or total_kv, heads, placed_by=(rank, size))
            tried.append(f"rank {rank} of {size}")
        return cls(
            total_kv,
            total_q or total_kv,
            None,
            f"cannot place {total_kv} per-head scales onto this layer's {local} KV head(s) "
            f"on this rank ({', '.join(tried) or 'no TP layout'})",
        )

    @property
    def local(self) -> int:
        """How many heads this rank serves (0 when they cannot be placed)."""
        return len(self.heads or ())

    def expected_heads(self, shape: tuple[int, ...], *, is_query: bool) -> int:
        """How many per-head values a tensor of ``shape`` must hold: the KV heads, or for a
        q scale that is not one per KV head, one per query head."""
        from kvscale_plugin.scales import per_head_shape_ok

        if is_query and not per_head_shape_ok(shape, self.total_kv):
            return self.total_q
        return self.total_kv

    def take(self, values: torch.Tensor, *, is_query: bool = False) -> tuple[float, ...]:
        """This rank's heads of a flattened, validated per-head vector (a per-query-head q
        scale is first reduced by max over each KV head's group of query heads)."""
        if is_query and values.numel() == self.total_q != self.total_kv:
            values = values.reshape(self.total_kv, -1).amax(dim=1)
        flat = values.tolist()
        return tuple(float(flat[h]) for h in self.heads or ())
