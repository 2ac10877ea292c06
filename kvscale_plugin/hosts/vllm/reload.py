"""In-place reloads (``collective_rpc("reload_weights")``, RL weight sync): what vLLM's
layerwise reload gives no per-layer hook for (imported by
``method.register_quantization``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from vllm.utils.torch_utils import is_quantized_kv_cache

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts._common import shorten
from kvscale_plugin.hosts.vllm.method import KVScaleConfig, KVScaleKVCacheMethod
from kvscale_plugin.scales import CorruptScaleError, format_corrupt_scales


def _kvscale_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, KVScaleConfig]]:
    """(engine name, layer, config) of every attention layer of ``model`` served by
    kvscale's KV method."""
    for name, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if isinstance(method, KVScaleKVCacheMethod):
            yield getattr(module, "layer_name", name), module, method.quant_config


def _layers_reloaded_without_scales(model: torch.nn.Module) -> dict[str, KVScaleConfig]:
    """kvscale attention layers that the reload in progress gave no tensor at all
    (vLLM then puts their old tensors back and never calls the KV method)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return {
        name: cfg
        for name, layer, cfg in _kvscale_layers(model)
        if cfg.kv_verdict.supported
        and is_quantized_kv_cache(layer.kv_cache_dtype)
        and get_layerwise_info(layer).load_numel <= 0
    }


def _kvscale_configs(model: torch.nn.Module) -> list[KVScaleConfig]:
    """The kvscale configs (normally one) whose KV method serves a layer of ``model``."""
    found = {id(cfg): cfg for _, _, cfg in _kvscale_layers(model)}
    return list(found.values())


def _corrupt_scales(model: torch.nn.Module) -> dict[str, str]:
    """Corrupt scales recorded in this load cycle for layers of ``model`` whose FP8 cache
    uses the checkpoint's scales -- also those of a layer whose every scale tensor was
    refused: it loaded nothing, so vLLM put its old tensors back and never called the
    KV method."""
    corrupt: dict[str, str] = {}
    for _, layer, cfg in _kvscale_layers(model):
        verdict = cfg.kv_verdict
        if (verdict.supported or not verdict.declared) and is_quantized_kv_cache(
            layer.kv_cache_dtype
        ):
            corrupt.update(cfg.corrupt_scales)
    return corrupt


def _warn_draft_not_reloaded(configs: Iterable[KVScaleConfig]) -> None:
    """vLLM 0.32's ``reload_weights`` reloads the target model only (the model runner
    passes ``get_model()``; the drafter is never given the weights). When the reload
    carried MTP-layer KV scales and an MTP draft served by kvscale is alive, say that the
    draft keeps the scales it started with -- once per engine."""
    from vllm.config import get_current_vllm_config_or_none

    cfg = next((c for c in configs if c.mtp_scales_seen), None)
    current = get_current_vllm_config_or_none()
    if cfg is None or current is None:
        return
    # The worker reloads under its engine's config; the draft's attention layers are
    # registered in the same forward context as the target's.
    context = current.compilation_config.static_forward_context
    drafts = [m for m in context.values() if getattr(m, "kvscale_draft", False)]
    if not drafts:
        return
    held = ", ".join(
        f"{getattr(layer, 'layer_name', '?')} k={layer._k_scale_float:g} v={layer._v_scale_float:g}"
        for layer in drafts[:4]
    )
    warn_once(
        f"{cfg.warn_scope}reload-mtp-draft",
        "kvscale: the reloaded weights carry KV scales for MTP layers (%s), but vLLM's "
        "reload_weights reloads the target model only: the MTP draft keeps the scales "
        "(and weights) it started with (%s). Restart the engine to serve the draft "
        "with the new checkpoint's scales.",
        shorten(cfg.mtp_scales_seen, "tensors"),
        held,
    )


_RELOAD_WRAPPED = "__kvscale_reload_check__"


def install_reload_check() -> None:
    """Idempotent: wrap vLLM's in-place reload (``collective_rpc("reload_weights")``, RL
    weight sync) at both ends of a load cycle. At the start, forget the corrupt scales an
    earlier cycle recorded (a layer that gets no tensor now would keep them for good).
    While vLLM finalizes, layers keep their scales instead of raising (an exception there
    leaves vLLM's reload half done); at the end, refuse the reload if any scale was
    corrupt, and report the layers whose reloaded weights carried no k/v scales while the
    checkpoint declares a scheme -- vLLM gives no per-layer hook for either."""
    from vllm.model_executor.model_loader.reload import inplace

    original_init = inplace.initialize_layerwise_reload
    if not getattr(original_init, _RELOAD_WRAPPED, False):

        def initialize_layerwise_reload(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            for cfg in _kvscale_configs(model):
                cfg.corrupt_scales.clear()
                cfg.mtp_scales_seen.clear()
            return original_init(model, *args, **kwargs)

        setattr(initialize_layerwise_reload, _RELOAD_WRAPPED, True)
        initialize_layerwise_reload.__wrapped__ = original_init  # type: ignore[attr-defined]
        inplace.initialize_layerwise_reload = initialize_layerwise_reload

    original = inplace.finalize_layerwise_reload
    if getattr(original, _RELOAD_WRAPPED, False):
        return

    def finalize_layerwise_reload(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        silent = _layers_reloaded_without_scales(model)
        configs = _kvscale_configs(model)
        for cfg in configs:
            cfg.reload_in_progress = True
        try:
            result = original(model, *args, **kwargs)
        finally:
            for cfg in configs:
                cfg.reload_in_progress = False
        if corrupt := _corrupt_scales(model):
            raise CorruptScaleError(
                format_corrupt_scales(corrupt)
                + "\nThe reload is refused: every attention layer keeps the KV scales it "
                "had (the reload's other weights are in place)."
            )
        _warn_draft_not_reloaded(configs)
        if silent:
            cfg = next(iter(silent.values()))
            warn_once(
                f"{cfg.warn_scope}reload-without-scales",
                "kvscale: the reloaded weights carry no k_scale/v_scale tensors for %s, "
                "although the checkpoint declares a kv_cache_scheme; those layers keep the "
                "scales they had (1.0 after a dummy start). Reload a checkpoint with "
                "calibrated KV scales (kvscale calibrate), or serve with a bf16 KV cache.",
                shorten(silent),
            )
        return result

    setattr(finalize_layerwise_reload, _RELOAD_WRAPPED, True)
    finalize_layerwise_reload.__wrapped__ = original  # type: ignore[attr-defined]
    inplace.finalize_layerwise_reload = finalize_layerwise_reload
