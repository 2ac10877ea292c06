"""A test-only SGLang plugin that reports what a CPU ``sglang.Engine``'s scheduler holds.

SGLang's ``Engine`` loads the model in a scheduler subprocess; nothing it offers returns
an attention layer's attributes to the caller. This plugin is discovered there like any
``sglang.srt.plugins`` entry point (tests/sglang_engine/conftest.py writes its
``.dist-info`` into a temporary folder on the Engine's path) and does nothing unless
``KVSCALE_ENGINE_PROBE`` names a JSON file. Then it adds three ``HookRegistry`` AFTER hooks
on ``ModelRunner``: after ``load_model`` it writes every ``RadixAttention``'s KV scales,
KV method and kvscale's record of the checkpoint values; after ``initialize`` it adds
the KV cache dtype SGLang resolved, after ``init_attention_backends`` the backend. Two more
on the model runner's ``WeightUpdater`` append the same layer report to ``updates`` after
each ``update_weights_from_disk`` and each ``end_weight_update`` (a session's end). Each
write replaces the file whole, so a reader never sees half of one; the first part
survives a start-up that fails after the model loaded (e.g. SGLang refusing the pool).
After the model loads it also gives SGLang's ``Scheduler`` two methods for
``Engine.collective_rpc``: ``kvscale_probe_zero_scales`` and ``kvscale_probe_set_copy``
(what a memory release or a one-copy refit does to the served scales).
"""

from __future__ import annotations

import json
import os
from typing import Any

ENV = "KVSCALE_ENGINE_PROBE"
_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hook ``ModelRunner`` when asked to."""
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{_RUNNER}.load_model", _after_load_model, HookType.AFTER)
    HookRegistry.register(f"{_RUNNER}.initialize", _after_initialize, HookType.AFTER)
    HookRegistry.register(
        f"{_RUNNER}.init_attention_backends", _after_attention_backends, HookType.AFTER
    )
    for method in ("update_weights_from_disk", "end_weight_update"):
        HookRegistry.register(f"{_UPDATER}.{method}", _after_update(method), HookType.AFTER)


def _write(update: dict[str, Any]) -> None:
    path = os.environ[ENV]
    try:
        with open(path) as f:
            report = json.load(f)
    except FileNotFoundError:
        report = {}
    report.update(update)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def _number(value: Any) -> Any:
    if value is None or isinstance(value, (int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_number(v) for v in value]
    return float(value)


def _scale(values: tuple[float, ...]) -> Any:
    return _number(values[0] if len(values) == 1 else values)


def _layers(model: Any) -> dict[str, Any]:
    from sglang.srt.layers.radix_attention import RadixAttention

    layers = {}
    for name, layer in model.named_modules():
        if not isinstance(layer, RadixAttention):
            continue
        record = getattr(layer, "kvscale_record", None)
        raw = getattr(record, "raw", None)
        layers[name] = {
            "layer_id": layer.layer_id,
            "method": None if layer.quant_method is None else type(layer.quant_method).__name__,
            "k_scale": _number(getattr(layer, "k_scale", None)),
            "v_scale": _number(getattr(layer, "v_scale", None)),
            "k_scale_float": _number(getattr(layer, "k_scale_float", None)),
            "v_scale_float": _number(getattr(layer, "v_scale_float", None)),
            "kvscale_source": getattr(record, "source", None),
            # per-tensor scales as one number, per-head ones as a list
            "kvscale_raw": None if raw is None else {k: _scale(v) for k, v in raw.items()},
        }
    return layers


def kvscale_probe_zero_scales(scheduler: Any) -> None:
    """For ``collective_rpc``: zero every attention layer's served ``k_scale`` /
    ``v_scale`` tensors, as releasing and resuming their memory would (test only)."""
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    with torch.no_grad():
        for layer in scheduler.tp_worker.model_runner.model.modules():
            if isinstance(layer, RadixAttention) and getattr(layer, "k_scale", None) is not None:
                layer.k_scale.zero_()
                layer.v_scale.zero_()


def kvscale_probe_set_copy(scheduler: Any, layer_id: int, copy: str, value: float) -> None:
    """For ``collective_rpc``: set one copy of one layer's scales behind kvscale's back."""
    from sglang.srt.layers.radix_attention import RadixAttention

    for layer in scheduler.tp_worker.model_runner.model.modules():
        if isinstance(layer, RadixAttention) and layer.layer_id == layer_id:
            setattr(layer, copy, value)


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    from sglang.srt.layers import quantization
    from sglang.srt.managers.scheduler import Scheduler

    # Scheduler methods collective_rpc can call (it looks them up by name).
    Scheduler.kvscale_probe_zero_scales = kvscale_probe_zero_scales
    Scheduler.kvscale_probe_set_copy = kvscale_probe_set_copy

    quant_config = getattr(runner.model, "quant_config", None)
    _write(
        {
            "pid": os.getpid(),
            "quant_config": None if quant_config is None else type(quant_config).__name__,
            "kvscale_registered": "kvscale" in quantization.QUANTIZATION_METHODS,
            "layers": _layers(runner.model),
        }
    )


def _after_update(method: str) -> Any:
    def after(result: Any, updater: Any, *args: Any, **kwargs: Any) -> None:
        with open(os.environ[ENV]) as f:
            updates = json.load(f).get("updates", [])
        entry = {"method": method, "layers": _layers(updater.get_model())}
        if isinstance(result, tuple):
            entry["result"] = [_number(x) if not isinstance(x, str) else x for x in result]
        _write({"updates": [*updates, entry]})

    after.__qualname__ = f"kvscale_engine_probe_after[{method}]"
    return after


def _after_initialize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    _write({"kv_cache_dtype": str(getattr(runner, "kv_cache_dtype", None))})


def _after_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    backend = getattr(runner, "attn_backend", None)
    _write({"attn_backend": None if backend is None else type(backend).__name__})
