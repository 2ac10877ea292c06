"""How a kvscale attention layer holds its served scales in vLLM: which checkpoint heads
a tensor-parallel rank keeps (``head_layout``) and the in-place update of the tensors
vLLM's kernels read (``write_scales``). Used by ``method`` (start-up loads and reloads)."""

from __future__ import annotations

import torch

from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.hosts.vllm.backendcopies import refresh as refresh_impl_copies
from kvscale_plugin.hosts.vllm.layers import EngineConfig
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.scales import ResolvedScales


def head_layout(cfg: EngineConfig, layer: torch.nn.Module) -> HeadLayout:
    """Which checkpoint KV heads this tensor-parallel rank serves for ``layer`` (per-head
    schemes), by the rule stock vLLM partitions KV heads with; raises where they cannot be
    placed (the model could not be built with a per-head scheme).

    The model's KV-head count comes from where vLLM sets it: the quantization config's
    ``total_num_kv_heads`` (vLLM fills it only for a config with ``config_groups``), else
    the model config vLLM partitions heads by (``ModelConfig.get_total_num_kv_heads``).
    Local heads x TP size is only the last resort (a layer whose head count differs from
    the model's): it overcounts KV heads that TP replicates (TP size > KV heads)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed import (
        get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size,
    )

    local = int(layer.num_kv_heads)
    size = get_tensor_model_parallel_world_size()
    model = getattr(get_current_vllm_config_or_none(), "model_config", None)
    counts = (cfg.total_num_kv_heads, model and model.get_total_num_kv_heads())
    # The model's count, where vLLM's rule (``ModelConfig.get_num_kv_heads``) gives this
    # layer its heads from it.
    total_kv = next((n for n in counts if n and max(1, n // size) == local), local * size)
    total_q = cfg.total_num_heads or int(layer.num_heads) * size
    layout = HeadLayout.place(
        total_kv, local, [(get_tensor_model_parallel_rank(), size)], total_q=total_q
    )
    if layout.problem is not None:
        raise ValueError(f"kvscale: {layout.problem}")
    return layout


def write_scales(
    layer: torch.nn.Module, resolved: ResolvedScales, q_heads: tuple[float, ...], prob: float
) -> None:
    """Update device tensors in place (kernels and CUDA graphs hold them), then host copies.

    Per-head layers hold one value per local KV head in ``_k_scale`` / ``_v_scale`` /
    ``_q_scale`` (as stock vLLM lays them out); the Python floats and CPU copies hold
    the per-layer max, which is what one-scale paths (CPU attention) read."""
    _fill_device(layer, "_q_scale", q_heads)
    layer._prob_scale.fill_(prob)
    layer._q_scale_float = max(q_heads)
    layer._prob_scale_float = prob
    write_kv_scales(layer, resolved)


def write_kv_scales(layer: torch.nn.Module, resolved: ResolvedScales) -> None:
    """The k/v part of ``write_scales`` (also what a layer that reads another layer's
    cache is given: the target's), in place, device tensors first."""
    _fill_device(layer, "_k_scale", resolved.k_heads)
    _fill_device(layer, "_v_scale", resolved.v_heads)
    if _local_heads(layer) is not None:
        # Device copies of the per-layer max, for one-scale GPU paths (kvscale's CUSTOM
        # backend writes and reads a per-head layer's cache with them).
        _fill_device(layer, "_kvscale_k_max", (resolved.k,), scalar=True)
        _fill_device(layer, "_kvscale_v_max", (resolved.v,), scalar=True)
    layer._k_scale_float = resolved.k
    layer._v_scale_float = resolved.v
    record = layer_record(layer)
    if record is not None:
        record.resolved = resolved
    for name, value in (("_k_scale_cpu", resolved.k), ("_v_scale_cpu", resolved.v)):
        host = getattr(layer, name, None)
        if isinstance(host, torch.Tensor):
            host.fill_(value)
        else:
            setattr(layer, name, torch.tensor(value, dtype=torch.float32))
    # Last: what a GPU backend's impl computed from the floats (FlashInfer's bmm scales).
    refresh_impl_copies(layer)


def _fill_device(
    layer: torch.nn.Module, name: str, values: tuple[float, ...], *, scalar: bool = False
) -> None:
    current: torch.Tensor | None = getattr(layer, name, None)
    if current is None:  # first load: a new buffer beside _k_scale, on its device
        layer.register_buffer(
            name, torch.tensor(values[0], dtype=torch.float32, device=layer._k_scale.device)
        )
        return
    heads = None if scalar else _local_heads(layer)
    if heads is None:
        current.fill_(values[0] if len(values) == 1 else max(values))
        return
    target = torch.tensor(values, dtype=torch.float32).expand(heads)
    if tuple(current.shape) == (heads,):
        current.copy_(target)  # reloads: same buffer, new values
    else:
        # First load of a per-head layer: the scalar default becomes one per head.
        layer.register_buffer(name, target.to(current.device).clone())


def _local_heads(layer: torch.nn.Module) -> int | None:
    """How many KV heads a per-head layer serves on this rank (None: per-tensor)."""
    record = layer_record(layer)
    heads = record.heads if record is not None else None
    return heads.local if heads is not None else None
