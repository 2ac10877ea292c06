"""vLLM classes for ``--quantization kvscale`` (imported only by ``hosts.vllm.register``).

Thin translation from vLLM's quantization API to the host-independent core:
``scheme.judge_kv_cache_scheme`` judges the scheme, ``scalepaths`` maps names,
``loadcycle`` reads each loaded tensor and judges what a load or reload serves
(``Cycle.judge``, the same rule as SGLang's adapter); this module passes it vLLM's facts
(the layer's cache, q scales read, a dummy load) and writes what the layer serves. A
start-up load's verdict is reported at the cycle's end, a reload's by ``reload.check_reload``.
"""

from __future__ import annotations

import re
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.quantization.base_config import (
    QuantizationConfig,
    QuantizeMethodBase,
)
from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
    CompressedTensorsKVCacheMethod,
)
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.models.utils import WeightsMapper
from vllm.model_executor.utils import is_weights_pre_processed
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import info_once, warn_once
from kvscale_plugin.hosts._common import claims_checkpoint, no_checkpoint_config_error
from kvscale_plugin.hosts.vllm.activation import activate, layer_built
from kvscale_plugin.hosts.vllm.layers import (
    layer_serves_checkpoint_scales,
)
from kvscale_plugin.hosts.vllm.parity import warn_vision_tower_difference
from kvscale_plugin.hosts.vllm.platform_cache import DEGRADED, cpu_cannot_run_fp8_cache
from kvscale_plugin.hosts.vllm.process import HOST
from kvscale_plugin.hosts.vllm.qscales import reads_q_scale
from kvscale_plugin.hosts.vllm.reload import report_verdict
from kvscale_plugin.hosts.vllm.runtime import (
    explicit_fp8_cache,
    is_dummy_load,
    keeps_placeholders,
    pipeline_parallel,
    replays_full_cuda_graphs,
)
from kvscale_plugin.hosts.vllm.scalepaths import (
    UNMAPPED_PREFIX,
    ScaleRenaming,
    start_recording,
    stop_recording,
)
from kvscale_plugin.hosts.vllm.served import head_layout, write_kv_scales, write_scales
from kvscale_plugin.hosts.vllm.shared import (
    finish_load_cycle,
    serving,
    sharing_target,
)
from kvscale_plugin.loadcycle import (
    ZERO_POINT_NAMES,
    Action,
    Cycle,
    LayerRecord,
    computes_own_scales,
    layer_record,
    scale_loader,
    serve_target,
    zero_point_loader,
)
from kvscale_plugin.names import (
    declared_mtp_layers,
    mtp_layer_ordinal,
    names_attention_layer,
)
from kvscale_plugin.notices import (
    announce_verdict,
    dynamic_scales_notice,
    warn_unmapped_scales,
)
from kvscale_plugin.scales import (
    SENTINEL,
    CorruptScaleError,
    CorruptScales,
    ResolvedScales,
)
from kvscale_plugin.scheme import SchemeVerdict
from kvscale_plugin.sharing import SHARED_SOURCE, SharedLayers

_SCALE_NAMES = ("q_scale", "k_scale", "v_scale", "prob_scale")
_KV = ("k_scale", "v_scale")


class KVScaleConfig(CompressedTensorsConfig):
    """compressed-tensors config whose attention layers get calibrated FP8 KV scales.

    Linear / MoE weight schemes are handled by vLLM's compressed-tensors code as
    usual. ``kv_cache_scheme`` is exposed only when the scheme is supported, which
    is what makes ``--kv-cache-dtype auto`` pick an FP8 pool exactly then.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and not kwargs:
            # vLLM calls Cls() when the checkpoint has no quantization config.
            raise no_checkpoint_config_error("vLLM")
        super().__init__(*args, **kwargs)
        # Names this engine's config in "warn once" causes; travels with the pickled
        # config, so every process of one engine shares it and a second engine differs.
        self.warn_scope = f"engine-{uuid.uuid4().hex}:"
        self.kv_verdict: SchemeVerdict = announce_verdict(self.kv_cache_scheme, self.warn_scope)
        # Where this platform cannot run an FP8 cache, `auto` keeps the model dtype's
        # cache (platform_cache); an explicit FP8 dtype still reaches vLLM's refusal.
        self.fp8_cache_unavailable = self.kv_verdict.supported and cpu_cannot_run_fp8_cache()
        if not self.kv_verdict.supported or self.fp8_cache_unavailable:
            # Exposed only when supported: Attention flips `auto` to FP8 on it.
            self.kv_cache_scheme = None
        self.model_type: str | None = None
        # What the name mapping saw (written by ``_HookRenaming`` only; the per-load state
        # of each attention layer lives on the layer: ``loadcycle.LayerRecord``).
        # vLLM parameter name -> the checkpoint tensor it was loaded from (as on disk).
        self.checkpoint_names: dict[str, str] = {}
        # Checkpoint KV-scale tensors that name no attention layer of this model.
        self.unmapped_scales: set[str] = set()
        # (layer name, kind) -> the checkpoint tensor the name mapping sent there, and the
        # loaders this load cycle reached: a sent tensor whose loader no model code reached
        # (a model's own loop skipped it) is unmapped too.
        self.expected: dict[tuple[str, str], str] = {}
        self.reached: set[tuple[str, str]] = set()
        # The main stack's depth and the checkpoint's MTP (draft) layer count, from the
        # model config (``maybe_update_config``): which scale names are MTP layers'.
        self.num_hidden_layers: int | None = None
        self.num_mtp_layers = 0
        # MTP-layer KV-scale tensors the target model was given (until a reload check).
        self.mtp_scales_seen: set[str] = set()
        # Layers that read another layer's cache: what their own checkpoint scales were.
        self.shared = SharedLayers()
        # Whether this engine replays full CUDA graphs (read as its worker builds the
        # first layer: ``backendcopies.warn_captured_graphs``).
        self.full_cuda_graphs: bool | None = None
        self._attention_layers: weakref.WeakValueDictionary[str, torch.nn.Module] = (
            weakref.WeakValueDictionary()
        )
        self.cycle = self._new_cycle()
        activate()
        start_recording(config=self)  # the model is built next: where its attention layers go

    # The config travels to the engine-core / worker processes by pickle; the
    # registry of live attention layers is per process.
    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.pop("_attention_layers", None)
        state.pop("cycle", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._attention_layers = weakref.WeakValueDictionary()
        self.cycle = self._new_cycle()
        activate()  # an engine-core / worker process of a kvscale engine
        start_recording(config=self)
        self._route_drafts()

    def _new_cycle(self) -> Cycle:
        """This process's load cycles; a layer's cache target is read off the layer
        (vLLM sets it after the KV method built the layer's placeholders)."""
        layers = self._attention_layers
        return Cycle(
            target_of=lambda record: sharing_target(layers.get(record.name)),
            on_disk=self.checkpoint_names,
        )

    def get_name(self) -> str:  # type: ignore[override]
        return QUANTIZATION_METHOD

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None, hf_config: Any = None
    ) -> str | None:
        claimed = claims_checkpoint(hf_quant_cfg, user_quant)
        if claimed is not None:
            HOST.front_end = True
            activate()  # this process builds a kvscale engine (the front end, first)
        return claimed

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: Any = None):
        super().maybe_update_config(model_name, hf_config=hf_config, revision=revision)
        self.model_type = getattr(hf_config, "model_type", None)
        warn_vision_tower_difference(getattr(hf_config, "architectures", None))
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        layers = getattr(text, "num_hidden_layers", None)
        self.num_hidden_layers = layers if isinstance(layers, int) else None
        self.num_mtp_layers = declared_mtp_layers(hf_config, text)
        self._route_drafts()

    def _route_drafts(self) -> None:
        """Only a model that declares MTP layers gets the draft loader's routing (here, and
        in each worker that unpickles this config: it may never call
        ``maybe_update_config`` itself)."""
        if self.num_mtp_layers:
            from kvscale_plugin.hosts.vllm.mtp import ensure_draft_routing

            ensure_draft_routing()

    def mtp_ordinal(self, checkpoint_name: str) -> int | None:
        """The MTP layer (from 0) a checkpoint tensor belongs to, when the model config
        declares that many MTP layers; else None."""
        if not self.num_mtp_layers:
            return None
        ordinal = mtp_layer_ordinal(checkpoint_name, self.num_hidden_layers)
        return ordinal if ordinal is not None and ordinal < self.num_mtp_layers else None

    def apply_vllm_mapper(self, hf_to_vllm_mapper: WeightsMapper) -> None:
        # The scheme's keys are field names, never module paths: keep it as declared.
        scheme = self.kv_cache_scheme
        super().apply_vllm_mapper(hf_to_vllm_mapper)
        self.kv_cache_scheme = scheme

    def get_cache_scale_mapper(self) -> WeightsMapper:  # type: ignore[override]
        stock = QuantizationConfig.get_cache_scale_mapper()
        if not (self.kv_verdict.declared or explicit_fp8_cache()):
            return stock
        # One renaming per load (its model paths are read at the load's first scale name).
        if not self.cycle.pending:
            self.unmapped_scales.clear()  # a new load: the last one's names were reported
        ours = WeightsMapper(
            orig_to_new_renaming=[ScaleRenaming(self)],
            orig_to_new_regex={re.compile("^" + re.escape(UNMAPPED_PREFIX)): None},
        )
        return ours | stock

    def on_disk(self, corrupt: CorruptScales) -> CorruptScales:
        """``corrupt`` with every tensor named as the checkpoint writes it (where the
        name mapping saw it), so a user can find it in the file."""
        return corrupt.renamed(self.checkpoint_names)

    def attention_layers(self) -> list[torch.nn.Module]:
        """The attention layers this config's KV method built in this process."""
        return list(self._attention_layers.values())

    def attention_layer(self, name: str) -> torch.nn.Module | None:
        """The attention layer called ``name`` this process built, if any."""
        return self._attention_layers.get(name)

    def has_attention_layer_for(self, param_name: str) -> bool:
        """Whether a mapped ``<layer>.{k,v,q}_scale`` name targets an attention layer
        this process built."""
        layers = list(self._attention_layers)
        if not layers or pipeline_parallel():
            return True  # cannot tell here: leave the name to vLLM's loader
        return names_attention_layer(param_name, layers)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        if isinstance(layer, Attention):
            if (
                self.fp8_cache_unavailable
                and getattr(layer, "kv_cache_dtype", None) == "auto"
                and not explicit_fp8_cache()
            ):
                warn_once(self.warn_scope + "fp8-cache-unavailable", DEGRADED)
            if not self.kv_verdict.declared and not is_quantized_kv_cache(
                getattr(layer, "kv_cache_dtype", "auto")
            ):
                return None  # no scheme: no scale parameters, exactly as without the plugin
            # No scheme but an FP8 cache the user asked for: like stock, the checkpoint's
            # per-tensor scales (if any) are used.
            return KVScaleKVCacheMethod(self)
        return super().get_quant_method(layer, prefix)


class KVScaleKVCacheMethod(CompressedTensorsKVCacheMethod):
    """Per-layer KV scales: sentinel placeholders, checkpoint-first resolution.

    Subclasses ``CompressedTensorsKVCacheMethod`` because vLLM's attention layer
    special-cases it, but skips its constructor (which raises on unsupported
    schemes); the weights follow ``BaseKVCacheMethod``.
    """

    is_kvscale = True

    def __init__(self, quant_config: KVScaleConfig) -> None:
        BaseKVCacheMethod.__init__(self, quant_config)
        self.quant_config: KVScaleConfig = quant_config

    def create_weights(self, layer: torch.nn.Module) -> None:
        # Called again on every in-place reload: build fresh placeholders each time.
        cfg = self.quant_config
        layer_built()  # the features that go in as the worker builds its layers
        if cfg.full_cuda_graphs is None:
            cfg.full_cuda_graphs = replays_full_cuda_graphs()
        layer_name = getattr(layer, "layer_name", type(layer).__name__)
        if layer_name not in cfg._attention_layers:
            start_recording(layer, cfg)  # where the model puts this layer (``scalepaths``)
        cfg._attention_layers[layer_name] = layer
        record = layer_record(layer)
        if record is None:  # the layer's record, for its lifetime
            heads = head_layout(cfg, layer) if cfg.kv_verdict.per_head else None
            record = cfg.cycle.record(layer_name, layer, heads=heads)
        # A new load cycle for this layer (vLLM's layerwise reload replays the loaders
        # after this). Records the MTP routing filed under a checkpoint name stay until
        # the reload check reads them.
        record.start()
        for name in _SCALE_NAMES:
            cfg.reached.discard((layer_name, name))
            cfg.expected.pop((layer_name, name), None)
        cfg.cycle.built(layer_name)
        heads = record.heads
        for name in _SCALE_NAMES:
            per_head = heads is not None and name != "prob_scale"
            # float32 explicitly: vLLM builds layers under the model's default dtype
            # (bf16), which would round a calibrated 3.8649 to 3.8594.
            param = torch.nn.Parameter(
                torch.full((heads.local,) if per_head else (), SENTINEL, dtype=torch.float32),
                requires_grad=False,
            )
            param.weight_loader = _reached(
                cfg,
                (layer_name, name),
                scale_loader(record, name, heads if per_head else None, into_param=True),
            )
            # A dummy load must leave the placeholder, not tiny random "scales".
            param.dummy_weight_value = SENTINEL
            setattr(layer, name, param)
        for name in ZERO_POINT_NAMES:
            param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            param.weight_loader = zero_point_loader(f"{layer_name}.{name}")
            param.dummy_weight_value = 0.0
            setattr(layer, name, param)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        record = layer_record(layer)
        if is_weights_pre_processed() or record is None:
            BaseKVCacheMethod.process_weights_after_loading(self, layer)
            return
        cfg = self.quant_config
        record.target = sharing_target(layer)
        if record.target is not None:
            # Reads another layer's cache: serves that layer's scales (sharing.py), also
            # in a reload that re-created nothing here (the target's may have changed).
            built = hasattr(layer, "k_scale")
            own = (record.value("k_scale"), record.value("v_scale"))
            target = serving(cfg.attention_layer(record.target))
            resolved = serve_target(cfg.shared, record, target, own, cfg.checkpoint_names)
            write_kv_scales(layer, resolved)
            self._finish(layer, record, resolved, SHARED_SOURCE, counted=built)
            return
        if not hasattr(layer, "k_scale"):
            return  # placeholders already consumed (e.g. a reload that carried no scales)

        stop_recording()
        unmapped = cfg.unmapped_scales | {
            tensor for key, tensor in cfg.expected.items() if key not in cfg.reached
        }
        if unmapped:
            warn_unmapped_scales(unmapped, cfg.warn_scope)
        loaded = {name: record.value(name) for name in _SCALE_NAMES}
        applies = layer_serves_checkpoint_scales(cfg.kv_verdict, layer)
        if computes_own_scales(layer.kv_cache_dtype):
            info_once(f"{cfg.warn_scope}dynamic", dynamic_scales_notice(layer.kv_cache_dtype))
        fnuz = current_platform.is_fp8_fnuz()
        # The one rule for both hosts, judged with the whole model's refusals (every layer
        # loaded before any is processed: one error names every bad tensor).
        outcome = cfg.cycle.judge(
            record,
            serves=applies,
            reads_q=reads_q_scale(layer),
            declared=cfg.kv_verdict.declared,
            dummy_load=is_dummy_load(),
            fnuz=fnuz,
        )
        if outcome.action is Action.REFUSE:
            raise CorruptScaleError(cfg.cycle.verdict.refused.message())
        if outcome.action is Action.KEEP:
            # A reload refused for corrupt scales, or one that carried none for this layer:
            # the layer keeps the scales it had. Never raises here: that would leave vLLM's
            # layerwise reload half done (later layers unprocessed); the worker's reload
            # entry point reports the cycle's verdict once vLLM has finished
            # (``reload.check_reload``).
            self._drop_placeholders(layer, record)
            return

        resolved = outcome.resolved
        assert resolved is not None
        if applies:
            # As stock vLLM: a q scale only when the checkpoint has one, else 1.0.
            factor = 2.0 if fnuz else 1.0
            q = loaded["q_scale"]
            q_heads = tuple(x * factor for x in q) if q is not None else (1.0,)
            # Read by no attention backend of vLLM 0.32; kept like BaseKVCacheMethod does.
            prob = loaded["prob_scale"][0] * factor if loaded["prob_scale"] else 1.0
            if resolved.per_head and current_platform.is_cpu():
                info_once(
                    "per-head-cpu",
                    "kvscale: per-head KV scales: vLLM's CPU attention takes one scale per "
                    "layer, so the FP8 cache is written and read with each layer's max over "
                    "its heads (nothing clips).",
                )
        else:
            q_heads = (1.0,)
            prob = 1.0

        write_scales(layer, resolved, q_heads, prob)
        self._finish(layer, record, resolved, resolved.source.value)

    def _finish(
        self,
        layer: torch.nn.Module,
        record: LayerRecord,
        resolved: ResolvedScales,
        source: str,
        counted: bool = True,
    ) -> None:
        cfg = self.quant_config
        record.served(resolved, source)
        if "cpu-write" in HOST.installed:
            from kvscale_plugin.hosts.vllm.cpu_write import serve_layer

            serve_layer(layer)
        # Built in this load cycle: its INFO line counts it; the last one ends the cycle.
        pool = str(layer.kv_cache_dtype)
        if counted and cfg.cycle.done(record, pool, prefix="(MTP draft) " if record.draft else ""):
            cfg.cycle.begin(loading=False)
            finish_load_cycle(cfg)
            if not cfg.cycle.verdict.reload:
                # A start-up load's verdict (a reload's is the reload check's to report).
                report_verdict(cfg, cfg.cycle.take_verdict())
                if "rl-sync" in HOST.installed:
                    from kvscale_plugin.hosts.vllm import live, update

                    update.wrap_loaded_models(cfg)
                    live.after_load(cfg, "start-up load", took_scales=True)
        self._drop_placeholders(layer, record)

    @staticmethod
    def _drop_placeholders(layer: torch.nn.Module, record: LayerRecord) -> None:
        """What the cycle loaded is consumed. Like vLLM's own KV method of the same
        release: up to 0.33 the placeholders go (a layerwise reload re-creates them); from
        0.34 they stay, because its direct reload (``VLLM_RELOAD_MODE=direct``) loads the
        checkpoint into them again."""
        record.loaded.clear()
        if keeps_placeholders():
            return
        for name in (*_SCALE_NAMES, *ZERO_POINT_NAMES):
            if hasattr(layer, name):
                delattr(layer, name)


def _reached(
    cfg: KVScaleConfig, key: tuple[str, str], loader: Callable[..., None]
) -> Callable[..., None]:
    """``loader``, noting that model code reached it (``unmapped`` is judged from that)."""

    def load(param: torch.Tensor, loaded_weight: torch.Tensor, *args: Any) -> None:
        cfg.reached.add(key)
        loader(param, loaded_weight, *args)

    return load
