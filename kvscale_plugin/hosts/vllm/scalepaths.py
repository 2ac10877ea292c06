"""Where a checkpoint scale name lands in the model vLLM built (the model's own translation).

vLLM registers hundreds of architectures and each renames its checkpoint's modules its own
way: in its weights mapper (GPT-OSS ``.self_attn.`` -> ``.attn.``, Jamba ``.self_attn.`` ->
``.``, the Transformers backend's base-model prefixes), or by building its attention module
somewhere its ``layer_name`` does not say (Falcon-H1: ``model.layers.N.attn`` lives at
``model.layers.N.self_attn.attn``). kvscale therefore judges a scale name by the parameter
path it reaches: the model's own weights mapper and vLLM's stock scale mapper applied to it,
compared with the paths of the attention modules the model actually has
(``names.land_scale_name``). kvscale's and third-party rules only add names the model does
not know.

The attention modules' paths: torch modules know no parent, and vLLM hands the quantization
config no model. While a kvscale engine builds a model, torch's public module-registration
hook (``register_module_module_registration_hook``) records which module each new module is
assigned to: from the kvscale config's creation (or unpickling, in a worker) or the first
attention layer built, to the model's first load (the hook is removed then), only in a
process that builds a kvscale engine.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from kvscale_plugin.hosts.vllm import process
from kvscale_plugin.hosts.vllm.layers import HOST
from kvscale_plugin.hosts.vllm.runtime import pipeline_parallel
from kvscale_plugin.names import (
    Landing,
    is_loaded_form,
    land_scale_name,
    map_scale_name,
    scale_kind,
)


def _record_parent(module: torch.nn.Module, name: str, submodule: Any) -> None:
    if not isinstance(submodule, torch.nn.Module):
        return
    process.HOST.recording.parents[submodule] = (weakref.ref(module), name)
    config = process.HOST.recording.holds.get(submodule)
    if config is None and process.HOST.recording.building is not None:
        config = _give_kv_method(submodule, process.HOST.recording.building)
    if config is None:
        return
    process.HOST.recording.holds[module] = config
    # vLLM's ``AutoWeightsLoader`` applies the quantization config's scale mapper only when
    # the module it loads (or a direct child) has a ``quant_config`` attribute; some models
    # (Jamba) never set one, so their checkpoint scales never reach a mapper (stock raises on
    # them). A module with a ``load_weights`` of its own and no such attribute gets it.
    if callable(getattr(type(module), "load_weights", None)) and not hasattr(
        module, "quant_config"
    ):
        module.quant_config = config


def _give_kv_method(layer: torch.nn.Module, config: Any) -> Any:
    """An attention layer some model builds without a quantization config (vLLM's Jamba):
    it gets the KV method its engine's config gives every other attention layer, as
    ``Attention.__init__`` would have (``quant_method`` + ``create_weights``), so that its
    checkpoint scales have parameters to land in. Its cache dtype stays what the layer
    resolved without a config (``auto``: the model's dtype). Returns the config, or None."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.layers.attention import Attention

    if type(layer) is not Attention or getattr(layer, "quant_method", None) is not None:
        return None
    building = get_current_vllm_config_or_none()
    if getattr(building, "quant_config", None) is not config:
        return None  # another engine's model (a stock one built in this process): not ours
    method = config.get_quant_method(layer, prefix=getattr(layer, "layer_name", ""))
    if method is None:
        return None
    layer.quant_config = config  # read again by ``Attention.process_weights_after_loading``
    layer.quant_method = method
    method.create_weights(layer)
    return config


def start_recording(layer: torch.nn.Module | None = None, config: Any = None) -> None:
    """Record module assignments from now on, for a model kvscale ``config`` builds;
    ``layer``: one of its attention layers being built (before it is assigned to its
    parent). Idempotent."""
    if config is not None:
        process.HOST.recording.building = config
    if layer is not None:
        process.HOST.recording.holds[layer] = config
    with process.HOST.recording.lock:
        if process.HOST.recording.handle is None:
            from torch.nn.modules.module import register_module_module_registration_hook

            process.HOST.recording.handle = register_module_module_registration_hook(_record_parent)


def stop_recording() -> None:
    """The model is built (its weights are being loaded): stop recording. Idempotent."""
    with process.HOST.recording.lock:
        process.HOST.recording.building = None
        if process.HOST.recording.handle is not None:
            process.HOST.recording.handle.remove()
            process.HOST.recording.handle = None


def module_path(module: torch.nn.Module) -> tuple[torch.nn.Module, str] | None:
    """(the model ``module`` belongs to, its path in it), from the recorded assignments;
    None when a link is missing (it was built while nothing recorded)."""
    parts: list[str] = []
    current = module
    seen: set[int] = set()
    while (link := process.HOST.recording.parents.get(current)) is not None:
        parent = link[0]()
        if parent is None or id(parent) in seen:
            return None
        seen.add(id(parent))
        parts.append(link[1])
        current = parent
    if not parts:
        return None
    return current, ".".join(reversed(parts))


class ModelPaths:
    """The attention modules' paths in each model this process built, and each model's
    translation of a weight name (its weights mapper, then vLLM's stock scale mapper)."""

    def __init__(self, layers: Iterable[torch.nn.Module]) -> None:
        by_root: dict[int, tuple[torch.nn.Module, dict[str, torch.nn.Module]]] = {}
        self.complete = True
        for layer in layers:
            found = module_path(layer)
            if found is None:
                self.complete = False
                continue
            root, path = found
            by_root.setdefault(id(root), (root, {}))[1][path] = layer
        # The most recently built model first (a draft after its target).
        self.models = [
            (_translation(root), paths) for root, paths in reversed(list(by_root.values()))
        ]

    def __bool__(self) -> bool:
        return bool(self.models)

    def land(self, name: str, mapped: str | None) -> tuple[Landing, torch.nn.Module] | None:
        """Where checkpoint tensor ``name`` lands, and on which attention layer."""
        for translate, paths in self.models:
            landing = land_scale_name(name, mapped, translate, paths)
            if landing is not None:
                return landing, paths[landing.layer]
        return None

    def loaded_form(self, name: str) -> bool:
        """A name already in its loaded form (a nested loader's relative name)."""
        return any(is_loaded_form(name, paths) for _, paths in self.models)


def _translation(root: torch.nn.Module) -> Any:
    """What vLLM does to a weight name after kvscale's renaming: the model's weights mapper
    (regexes, substrings, stacked, prefixes, suffixes; its renamings ran before kvscale's)
    and the stock scale mapper of ``QuantizationConfig``."""
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.models.utils import WeightsMapper

    model = getattr(root, "hf_to_vllm_mapper", None)
    rest = QuantizationConfig.get_cache_scale_mapper()
    if isinstance(model, WeightsMapper):
        own = copy.copy(model)
        own.orig_to_new_renaming = []  # already applied before kvscale's renaming
        rest = own | rest
    # ``map_name`` from vLLM 0.32 (``_map_name`` before, kept as an alias there).
    return getattr(rest, "map_name", None) or rest._map_name


UNMAPPED_PREFIX = "__kvscale_unmapped__."


class ScaleRenaming:
    """Duck-typed ``transformers`` ``WeightRenaming``: vLLM's ``WeightsMapper`` keeps
    renamings through ``|`` (a ``WeightsMapper`` subclass would be lost there) and
    applies them before the model's own regexes, substrings and prefixes.

    A KV-scale name is judged by the parameter path the model's own translation takes
    it to (``scalepaths``): the name as written when that lands (stock's path), else the
    rules' answer or the one attention module under the named module. A name that lands
    nowhere is renamed under ``UNMAPPED_PREFIX`` (dropped by a regex of the same mapper:
    an unknown module in a name raises in vLLM's loaders) and reported in one warning."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.paths: ModelPaths | None = None

    def rename_source_key(self, key: str) -> tuple[str, None]:
        cfg = self.config
        mapped = map_scale_name(key, HOST, cfg.model_type)
        if mapped is None and scale_kind(key) is None:
            return key, None  # not a KV scale
        if cfg.mtp_ordinal(key) is not None:
            # An MTP layer's scale: never the target model's (vLLM builds MTP layers
            # only in the draft, whose loads kvscale routes before any mapper:
            # ``_route_draft_scales``), so dropped here -- the target's own loader
            # would raise on a name it has no module for (MiMo: ``model.layers.{L}...``).
            # Noted for the reload check: vLLM's in-place reload never reaches the draft.
            cfg.mtp_scales_seen.add(key)
            return UNMAPPED_PREFIX + key, None
        if self.paths is None:
            stop_recording()  # the model is built: its first load starts
            self.paths = ModelPaths(cfg.attention_layers())
        paths = self.paths
        if paths.loaded_form(key):
            return key, None  # already a layer's parameter path (or a nested loader's tail)
        found = (
            paths.land(key, mapped)
            if paths.complete and paths and not pipeline_parallel()
            else None
        )
        if found is None:
            # Not placed by the model's mapper: judged on the layers' names (a model's
            # ``load_weights`` may rename into them, e.g. Gemma-3n's ``model.layers.N`` ->
            # ``self_decoder`` / ``cross_decoder``; or the paths are unknown, or this rank
            # holds part of the model). What the rules answered goes to the model's loader.
            if mapped is None:
                return key, None
            if not cfg.has_attention_layer_for(mapped):
                cfg.unmapped_scales.add(key)
                return UNMAPPED_PREFIX + key, None
            cfg.checkpoint_names[mapped] = key  # messages name the file's tensor
            return mapped, None
        landing, layer = found
        layer_name = getattr(layer, "layer_name", landing.layer)
        cfg.checkpoint_names[f"{layer_name}.{landing.kind}"] = key
        if landing.kind.endswith("_scale"):  # zero points are accepted and dropped
            cfg.expected[(layer_name, landing.kind)] = key
        return landing.emit, None
