"""Build, load and reload tiny models with SGLang's own loader; read back attention scales.

Everything goes through real SGLang code: ``ModelConfig`` on the checkpoint's
config.json, ``DefaultModelLoader.load_model`` (quant config, model class, weight
iterator, ``load_weights``, post-processing), and for reloads the same calls
``ModelRunner.update_weights_from_disk`` makes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvscale_plugin.scheme import FP8_KV_SCHEME

#: Distinct per-layer (k, v) scales, exact in float32, so equality checks are exact.
SCALES = {0: (3.25, 2.5), 1: (4.75, 2.125)}
SCALES_B = {0: (1.5, 0.75), 1: (6.5, 5.25)}
SCALES_C = {0: (2.125, 1.25), 1: (0.625, 0.375)}

#: llm-compressor's other KV recipe: one scale per KV head, stored ``[num_kv_heads, 1, 1]``.
ATTN_HEAD_SCHEME = {**FP8_KV_SCHEME, "strategy": "attn_head"}
#: The tiny models' head counts (kvscale_plugin.demo.tinymodels: 4 query heads, 2 KV heads).
NUM_HEADS, NUM_KV_HEADS = 4, 2
#: Per-layer, per-head (k heads, v heads), every value distinct and exact in float32; the
#: largest head differs between layers and between k and v, so a head or layer mix-up shows.
PER_HEAD = {0: ((3.25, 1.5), (0.75, 2.5)), 1: ((0.625, 4.75), (5.25, 2.125))}
PER_HEAD_B = {0: ((1.25, 6.5), (3.5, 0.5)), 1: ((2.75, 0.25), (1.75, 4.25))}
PER_HEAD_C = {0: ((0.375, 0.875), (1.125, 0.625)), 1: ((5.5, 3.75), (0.125, 7.5))}

#: Where a per-head checkpoint stores a layer's tensors, per naming ("{i}" = layer).
PER_HEAD_NAMINGS = {
    "self_attn": ("model.layers.{i}.self_attn.k_scale", "model.layers.{i}.self_attn.v_scale"),
    "k_proj": (
        "model.layers.{i}.self_attn.k_proj.k_scale",
        "model.layers.{i}.self_attn.v_proj.v_scale",
    ),
    "kv_scale": ("model.layers.{i}.self_attn.kv_scale", None),  # legacy: k heads only
    "k_only": ("model.layers.{i}.self_attn.k_scale", None),
    "v_only": (None, "model.layers.{i}.self_attn.v_scale"),
}


def per_head_tensor(values, shape=None) -> torch.Tensor:
    """float32 ``[H, 1, 1]`` (llm-compressor's layout) unless ``shape`` says otherwise."""
    tensor = torch.tensor(values, dtype=torch.float32)
    return tensor.reshape(shape if shape is not None else (len(values), 1, 1))


def per_head_tensors(
    scales=PER_HEAD, naming: str = "self_attn", shape=None, q_scales: bool = False
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of per-head scales ``{layer: (k heads, v heads)}``;
    ``q_scales`` adds llm-compressor's ``q_scale`` ``[num_heads, 1, 1]``."""
    k_pat, v_pat = PER_HEAD_NAMINGS[naming]
    out = {}
    for i, (k, v) in scales.items():
        if k_pat is not None:
            out[k_pat.format(i=i)] = per_head_tensor(k, shape)
        if v_pat is not None:
            out[v_pat.format(i=i)] = per_head_tensor(v, shape)
        if q_scales:
            q = [1.0 + i + h / 8 for h in range(NUM_HEADS)]
            out[f"model.layers.{i}.self_attn.q_scale"] = per_head_tensor(q)
    return out


def per_head_checkpoint(
    tiny,
    name: str,
    family: str = "llama",
    scales=PER_HEAD,
    naming: str = "self_attn",
    shape=None,
    q_scales: bool = False,
    extra_tensors=None,
    **fields: Any,
) -> Path:
    """A tiny ``strategy: attn_head`` checkpoint (TinySpec writes per-tensor scales only,
    so the per-head tensors go in as extra tensors)."""
    tensors = per_head_tensors(scales, naming, shape, q_scales) if scales is not None else {}
    tensors.update(extra_tensors or {})
    fields.setdefault("num_layers", len(scales) if scales is not None else 2)
    return tiny(
        name,
        family=family,
        kv_cache_scheme=ATTN_HEAD_SCHEME,
        write_scales=False,
        scales={i: (1.0, 1.0) for i in range(fields["num_layers"])},  # no calibration
        extra_tensors=tensors,
        **fields,
    )


@dataclass(frozen=True)
class Scales:
    k: float | None  # the served tensor layer.k_scale (None: the layer has none)
    v: float | None
    k_float: float | None
    v_float: float | None
    source: str | None
    method: str | None
    k_ptr: int | None
    # kvscale's record of this rank's per-head scales (() without kvscale's KV method).
    k_heads: tuple[float, ...] = ()
    v_heads: tuple[float, ...] = ()


def build_model(path: Path, quantization: str | None = "kvscale", **config: Any):
    """(model, model_config) loaded from ``path`` by SGLang's DefaultModelLoader on CPU."""
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    model_config = ModelConfig(str(path), quantization=quantization, dtype="bfloat16", **config)
    model = DefaultModelLoader(LoadConfig()).load_model(
        model_config=model_config, device_config=DeviceConfig("cpu")
    )
    return model, model_config


def reload(model: torch.nn.Module, model_config: Any, path: Path, name_filter=None) -> None:
    """What ``update_weights_from_disk`` does to the model: restore, load, post-process."""
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import DefaultModelLoader

    device = torch.device("cpu")
    model_config.model_path = str(path)
    loader = DefaultModelLoader(LoadConfig())
    weights = loader._get_weights_iterator(DefaultModelLoader.Source.init_new(model_config, model))
    if name_filter is not None:
        weights = ((n, w) for n, w in weights if name_filter(n))
    DefaultModelLoader.restore_weights_before_loading(model, device)
    loader.load_weights_and_postprocess(model, weights, device)


def attention_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    from sglang.srt.layers.radix_attention import RadixAttention

    return {n: m for n, m in model.named_modules() if isinstance(m, RadixAttention)}


def layer_scales(model: torch.nn.Module) -> dict[str, Scales]:
    out = {}
    for name, layer in attention_layers(model).items():
        k, v = layer.k_scale, layer.v_scale
        out[name] = Scales(
            k=None if k is None else float(k),
            v=None if v is None else float(v),
            k_float=layer.k_scale_float,
            v_float=layer.v_scale_float,
            source=getattr(getattr(layer, "kvscale_record", None), "source", None),
            method=None if layer.quant_method is None else type(layer.quant_method).__name__,
            k_ptr=None if k is None else k.data_ptr(),
            k_heads=tuple(getattr(layer, "kvscale_k_heads", ())),
            v_heads=tuple(getattr(layer, "kvscale_v_heads", ())),
        )
    return out


def layer_index(name: str) -> int:
    match = re.search(r"layers\.(\d+)\.", name)
    assert match, name
    return int(match[1])


def assert_scales(scales: dict[str, Scales], expected: dict[int, tuple[float, float]]) -> None:
    """Every layer's device tensor and Python float hold exactly the expected k / v."""
    assert len(scales) == len(expected), scales
    for name, s in scales.items():
        k, v = expected[layer_index(name)]
        assert (s.k, s.k_float) == (k, k), (name, s)
        assert (s.v, s.v_float) == (v, v), (name, s)


def resolve_kv_cache_dtype(model: torch.nn.Module, requested: str = "auto") -> tuple:
    """SGLang's own resolution of --kv-cache-dtype for this model (what sizes the pool)."""
    from sglang.srt.mem_cache.kv_cache_dtype import configure_kv_cache_dtype

    return configure_kv_cache_dtype(
        server_args_kv_cache_dtype=requested,
        model=model,
        model_dtype=torch.bfloat16,
        is_draft_worker=False,
        is_dflash=False,
        speculative_draft_attention_backend=None,
    )


def weight_updater(model: torch.nn.Module, model_config: Any) -> Any:
    """SGLang's own model-runner ``WeightUpdater`` (what the scheduler's weight-update
    requests call) for ``model`` on CPU, TP rank 0."""
    from sglang.srt.model_executor.model_runner_components.weight_updater import WeightUpdater

    return WeightUpdater(
        tp_rank=0,
        device="cpu",
        gpu_id=0,
        model_config=model_config,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=lambda *args, **kwargs: None,
        recapture_cuda_graph=lambda: None,
        get_model_runner=lambda: None,
    )


def update_weights_from_disk(model: torch.nn.Module, model_config: Any, path: Path) -> tuple:
    """``WeightUpdater.update_weights_from_disk`` (``Engine.update_weights_from_disk``)
    on ``model``: ``(success, message)``."""
    return weight_updater(model, model_config).update_weights_from_disk(str(path), "auto")
