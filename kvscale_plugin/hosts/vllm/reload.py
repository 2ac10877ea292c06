"""In-place reloads (``collective_rpc("reload_weights")``, and the weight-transfer
engines' ``start_weight_update`` / ``finish_weight_update`` used for RL weight sync):
what vLLM's layerwise reload gives no per-layer hook for (the ``reload-check``
feature, installed by ``hosts.vllm.register``).
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts._common import shorten
from kvscale_plugin.hosts.vllm.internals import replace
from kvscale_plugin.hosts.vllm.layers import kvscale_config
from kvscale_plugin.scales import CorruptScaleError, CorruptScales

if TYPE_CHECKING:
    from kvscale_plugin.hosts.vllm.method import KVScaleConfig


@dataclass(frozen=True)
class _Served:
    """One attention layer served by kvscale's KV method, as a reload step sees it."""

    name: str  # the engine's layer name
    layer: torch.nn.Module
    cfg: KVScaleConfig


_Layers = list[_Served]


def _kvscale_layers(model: torch.nn.Module) -> _Layers:
    """Every attention layer of ``model`` served by
    kvscale's KV method (collected once per reload step, read by the checks below)."""
    found = []
    for name, module in model.named_modules():
        cfg = kvscale_config(module)
        if cfg is not None:
            found.append(_Served(getattr(module, "layer_name", name), module, cfg))
    return found


def _layers_reloaded_without_scales(layers: _Layers) -> dict[str, KVScaleConfig]:
    """kvscale attention layers that the reload in progress gave no tensor at all
    (vLLM then puts their old tensors back and never calls the KV method)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return {
        s.name: s.cfg
        for s in layers
        if s.cfg.kv_verdict.supported
        and is_quantized_kv_cache(s.layer.kv_cache_dtype)
        and get_layerwise_info(s.layer).load_numel <= 0
    }


def _is_draft(layers: _Layers) -> bool:
    """Whether these are an MTP draft's layers (a draft weight-sync session)."""
    return any(getattr(s.layer, "kvscale_draft", False) for s in layers)


def _kvscale_configs(layers: _Layers) -> list[KVScaleConfig]:
    """The kvscale configs (normally one) whose KV method serves one of ``layers``."""
    found = {id(s.cfg): s.cfg for s in layers}
    return list(found.values())


def _corrupt_scales(layers: _Layers) -> CorruptScales:
    """Corrupt scales recorded in this load cycle for ``layers`` whose FP8 cache
    uses the checkpoint's scales -- also those of a layer whose every scale tensor was
    refused: it loaded nothing, so vLLM put its old tensors back and never called the
    KV method."""
    corrupt = CorruptScales()
    for served in layers:
        verdict = served.cfg.kv_verdict
        if (verdict.supported or not verdict.declared) and is_quantized_kv_cache(
            served.layer.kv_cache_dtype
        ):
            corrupt.update(served.cfg.on_disk(served.cfg.corrupt_scales))
    return corrupt


def _warn_draft_not_reloaded(configs: Iterable[KVScaleConfig]) -> None:
    """vLLM 0.32's ``reload_weights`` reloads the target model only (the model runner
    passes ``get_model()``; the drafter is never given the weights). When an MTP draft
    served by kvscale is alive, say that it keeps the weights and scales it started
    with -- once per engine, also for a reload without MTP-layer scales (the draft's
    weights are then as stale), naming the reload's MTP-layer scale tensors if any."""
    from vllm.config import get_current_vllm_config_or_none

    configs = list(configs)
    current = get_current_vllm_config_or_none()
    if not configs or current is None:
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
    seen = set().union(*(c.mtp_scales_seen for c in configs))
    carried = (
        f" The reload's MTP-layer KV scales ({shorten(seen, 'tensors')}) are not used."
        if seen
        else ""
    )
    warn_once(
        f"{configs[0].warn_scope}reload-mtp-draft",
        "kvscale: this reload updated the target model only (vLLM's reload_weights "
        "reloads the target model only; a weight-sync session reaches the draft through "
        "start_draft_weight_update alone): the MTP draft keeps the weights and KV scales "
        "it started with (%s).%s Sync the draft as well, or restart the engine, to serve "
        "the draft from the new checkpoint.",
        held,
        carried,
    )


_RELOAD_WRAPPED = "__kvscale_reload_check__"

# A corrupt reload found while a worker's reload entry point runs is raised by that entry
# point after vLLM's own after-reload steps (cache resets, ending a weight update), not
# from inside the layerwise reload, which would skip them.
_deferred = threading.local()


def _refusal(corrupt: CorruptScales) -> CorruptScaleError:
    return CorruptScaleError(
        corrupt.message()
        + "\nThe reload's KV scales are refused: every attention layer keeps the KV scales "
        "it had. The reload's other weights are in place (vLLM loads them layer by layer, "
        "before the scales can be checked): reload a checkpoint with valid KV scales "
        "(check it with `kvscale inspect`) before relying on this engine's outputs."
    )


def _initialize_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def initialize_layerwise_reload(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        for cfg in _kvscale_configs(_kvscale_layers(model)):
            cfg.corrupt_scales.clear()
            cfg.corrupt_q_scales.clear()
            cfg.mtp_scales_seen.clear()
        return original(model, *args, **kwargs)

    return initialize_layerwise_reload


def _finalize_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def finalize_layerwise_reload(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        layers = _kvscale_layers(model)
        silent = _layers_reloaded_without_scales(layers)
        configs = _kvscale_configs(layers)
        for cfg in configs:
            cfg.reload_in_progress = True
        try:
            result = original(model, *args, **kwargs)
        finally:
            for cfg in configs:
                cfg.reload_in_progress = False
        if corrupt := _corrupt_scales(layers):
            if getattr(_deferred, "depth", 0):
                _deferred.error = _refusal(corrupt)
                return result
            raise _refusal(corrupt)
        if not _is_draft(layers):
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

    return finalize_layerwise_reload


def _wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(owner, name, None)
    if original is None or getattr(original, _RELOAD_WRAPPED, False):
        return
    wrapper = make(original)
    setattr(wrapper, _RELOAD_WRAPPED, True)
    replace(owner, name, wrapper)


def install_reload_check() -> None:
    """Idempotent: wrap vLLM's layerwise reload at both ends of a load cycle, where
    ``reload_weights`` calls it and where the weight-transfer engines import it from
    (``model_loader.reload``). At the start, forget the corrupt scales an earlier cycle
    recorded (a layer that gets no tensor now would keep them for good). While vLLM
    finalizes, layers keep their scales instead of raising (an exception there leaves
    vLLM's reload half done); at the end, refuse the reload if any scale was corrupt, and
    report the layers whose reloaded weights carried no k/v scales while the checkpoint
    declares a scheme -- vLLM gives no per-layer hook for either.

    The call site moved: vLLM >= 0.32 calls the functions from ``reload.inplace``; 0.30 and
    0.31 from the model runner module, which binds them by name when it is imported
    (wrapped here if it already is, else it imports the wrapped package's names; see
    ``install_worker_wrappers`` for a model runner imported before this ran)."""
    from vllm.model_executor.model_loader import reload

    _wrap_layerwise(reload)
    inplace = _import_optional("vllm.model_executor.model_loader.reload.inplace")
    if inplace is not None:
        _wrap_layerwise(inplace)
    install_worker_wrappers()


def _wrap_layerwise(module: Any) -> None:
    for name, make in (
        ("initialize_layerwise_reload", _initialize_wrapper),
        ("finalize_layerwise_reload", _finalize_wrapper),
    ):
        if hasattr(module, name):
            _wrap(module, name, make)


def _import_optional(name: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _raising_after(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def entry_point(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_deferred, "depth", 0)
        _deferred.depth = outer + 1
        try:
            result = original(self, *args, **kwargs)
        finally:
            _deferred.depth = outer
            error = getattr(_deferred, "error", None) if outer == 0 else None
            if outer == 0:
                _deferred.error = None
        if error is not None:
            raise error
        return result

    return entry_point


def ensure_worker_wrappers() -> None:
    """Called by the KV method as each attention layer is built (in an engine's worker
    process, by then): ``install_worker_wrappers`` where the ``reload-check`` feature is
    installed. Never raises: a failure costs the reload check only, never the load."""
    from kvscale_plugin.hosts.vllm import internals

    if "reload-check" not in internals.installed:
        return
    try:
        install_worker_wrappers()
    except Exception as exc:  # noqa: BLE001 - costs the reload check only, never the load
        warn_once(
            "vllm-reload-worker",
            "kvscale: the reload check could not hook into this vLLM's worker (%s: %s); "
            "a reload with corrupt KV scales is not refused.",
            type(exc).__name__,
            exc,
        )


def install_worker_wrappers() -> None:
    """Idempotent: a worker's reload entry points (``reload_weights``, which resets the
    LoRA / encoder / multimodal caches after the reload, and ``finish_weight_update``,
    which ends the weight-update session) raise a corrupt reload's error after their own
    steps ran; a model runner that bound the layerwise functions by name (vLLM 0.30 /
    0.31) gets the wrapped ones. Only once vLLM's worker modules are loaded -- in an
    engine's worker process; called again from the KV method as the model is built (the
    API server process never imports them, so neither does kvscale). A missing target
    here costs only this check (one warning)."""
    runner = sys.modules.get("vllm.v1.worker.gpu_model_runner")
    if runner is not None:
        _wrap_layerwise(runner)
    worker = getattr(sys.modules.get("vllm.v1.worker.gpu_worker"), "Worker", None)
    if worker is None:
        return
    for name in ("reload_weights", "finish_weight_update"):
        if getattr(worker, name, None) is None:
            warn_once(
                f"reload-entry-{name}",
                "kvscale: this vLLM's Worker has no %s; a reload refused by kvscale is "
                "raised from inside vLLM's reload instead of after it.",
                name,
            )
            continue
        _wrap(worker, name, _raising_after)
