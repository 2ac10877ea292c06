"""Query scales (``q_scale``) in a checkpoint: whether the attention in use reads them, and
the warning for corrupt ones that nothing reads (refused, with the k/v scales, where
something does: ``loadcycle.Cycle.judge``)."""

from __future__ import annotations

import torch
from vllm.platforms import current_platform

from kvscale_plugin._log import warn_once
from kvscale_plugin.scales import CorruptScales


def reads_q_scale(layer: torch.nn.Module) -> bool:
    """Whether this layer's attention may read its q scale: it quantizes queries
    (``query_quant``, FP8 attention), or it runs on a GPU platform, where some backends
    (FlashInfer, FlashMLA, ROCm AITER) read ``_q_scale`` by themselves. vLLM's CPU
    attention never reads it."""
    return getattr(layer, "query_quant", None) is not None or not current_platform.is_cpu()


def warn_unread_q_scales(corrupt_q: CorruptScales, scope: str) -> None:
    """Once per engine (``scope``): corrupt q scales (named as on disk) that no attention
    in use reads are ignored."""
    problems = corrupt_q.records()
    shown = "; ".join(f"{p.label}: {p.why}" for p in sorted(problems, key=lambda p: p.label)[:4])
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    warn_once(
        f"{scope}q-scales-unread",
        "kvscale: %d query-scale value(s) in the checkpoint cannot be used (%s%s). No "
        "attention here reads a q scale (vLLM's CPU attention, or no FP8 query "
        "quantization), so they are ignored and the engine serves; the KV cache does not "
        "use them. A backend that quantizes queries (FP8 attention on a GPU) would refuse "
        "them: re-calibrate the checkpoint's attention (llm-compressor) or drop these "
        "tensors before serving there.",
        len(problems),
        shown,
        more,
    )
