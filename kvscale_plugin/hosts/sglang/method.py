"""The ``kvscale`` quantization method for SGLang: config, KV-cache method, scale loaders.

This is SGLang's documented extension point (a quantization config registered by
name, whose ``get_quant_method`` gives each ``RadixAttention`` a KV-cache method); it
is imported only by ``hosts.sglang.register``. The ``HookRegistry`` patches for
SGLang 0.5.23's gaps live apart, in ``hosts.sglang.patches``.

Thin translation from SGLang's quantization API to the host-independent core:
``scheme.judge_kv_cache_scheme`` judges the scheme, ``loadcycle`` reads each loaded tensor
and judges what a load or reload serves (``Cycle.judge``, the same rule as vLLM's adapter);
this module passes it SGLang's facts (the requested cache dtype, a dummy load) and
reports the cycle's verdict. The one decision of its own: an attention backend that would
ignore the scales is refused (``hosts.sglang.backends``).

* ``KVScaleConfig``: SGLang's ``CompressedTensorsConfig`` (linear / MoE weight
  schemes unchanged) whose ``RadixAttention`` layers get ``KVScaleKVCacheMethod``.
* ``KVScaleKVCacheMethod``: float32 sentinel placeholders for ``k_scale`` /
  ``v_scale``, parameter loaders that validate and record each load cycle's
  checkpoint values, checkpoint-first resolution after loading.
* Per-head scales (``strategy: attn_head``, ``[num_kv_heads, 1, 1]`` per layer):
  SGLang 0.5.23 has no per-head KV scale path (``BaseKVCacheMethod`` makes a scalar
  ``k_scale`` and refuses non-scalar values; its compressed-tensors config ignores
  ``attn_head``; cache writes and attention backends take one scale per layer). kvscale
  validates every head, keeps this TP rank's heads (``layer.kvscale_k_heads`` /
  ``kvscale_v_heads``, placed by ``heads.HeadLayout``) and serves each layer with the max
  over them, so nothing clips.
* Per-load state: one ``loadcycle.LayerRecord`` per ``RadixAttention``
  (``layer.kvscale_record``), the same as vLLM's, in the config's ``loadcycle.Cycle``.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from sglang.kernels.ops.quantization.fp8_kernel import is_fp8_fnuz
from sglang.srt.layers import quantization as sgl_quantization
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
from sglang.srt.layers.radix_attention import RadixAttention

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import logger, warn_once
from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.hosts._common import claims_checkpoint, no_checkpoint_config_error
from kvscale_plugin.hosts.sglang import live, state
from kvscale_plugin.hosts.sglang.backends import (
    BackendAction,
    BackendVerdict,
    configured_attention_backends,
    judge_attention_backends,
)
from kvscale_plugin.hosts.sglang.shared import sharing_target
from kvscale_plugin.loadcycle import (
    ZERO_POINT_NAMES,
    Action,
    Cycle,
    layer_record,
    scale_loader,
    serve_target,
    serves_checkpoint_scales,
    zero_point_loader,
)
from kvscale_plugin.notices import announce_verdict, refused_reload_message, warn_verdict
from kvscale_plugin.scales import SENTINEL, CorruptScaleError
from kvscale_plugin.scheme import SchemeVerdict
from kvscale_plugin.sharing import SHARED_SOURCE, SharedLayers

#: The host name the pluggy name-mapping hook is asked with.
HOST = "sglang"
_SCALE_NAMES = ("k_scale", "v_scale")
#: Attribute set on every parameter this method creates (the patches key on it).
PLACEHOLDER_ATTR = "kvscale_placeholder"


def activate() -> None:
    """Install what a kvscale model needs in this process (idempotent): the registered
    host's patches (``state.host``); a process that never builds a kvscale model
    keeps SGLang's own code."""
    quiet_unoptimized_notice()
    if state.host is not None:
        state.host.activate()


class _NotWeightQuantization(logging.Filter):
    """SGLang's ``ModelConfig._verify_quantization`` warns "<method> quantization is not
    fully optimized yet. The speed can be slower than non-quantized models." for every
    method missing from a list local to that function (no way to add one). kvscale
    quantizes no weights (they run on SGLang's compressed-tensors code, which is on that
    list), so for kvscale the line is false: this drops exactly that record."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            "quantization is not fully optimized yet" in str(record.msg)
            and record.args
            and record.args[0] == QUANTIZATION_METHOD
        )


def quiet_unoptimized_notice() -> None:
    """On SGLang's model-config logger, in a process that builds a kvscale model (the
    override runs before that warning); idempotent."""
    target = logging.getLogger("sglang.srt.configs.model_config")
    if not any(isinstance(f, _NotWeightQuantization) for f in target.filters):
        target.addFilter(_NotWeightQuantization())


class KVScaleConfig(CompressedTensorsConfig):
    """compressed-tensors config whose attention layers get calibrated FP8 KV scales.

    ``get_name()`` stays SGLang's ``"compressed_tensors"`` on purpose: SGLang's model
    and MoE code switch weight handling on that name, and the weights *are*
    compressed-tensors weights. The method is registered as ``kvscale``.
    ``kv_cache_quant_algo`` says FP8 only for a supported scheme, which is what
    makes ``--kv-cache-dtype auto`` pick an FP8 pool exactly then.
    """

    is_kvscale = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if not args and not kwargs:
            # get_quant_config calls Cls() when the checkpoint has no quantization config.
            raise no_checkpoint_config_error("SGLang")
        super().__init__(*args, **kwargs)
        self.kv_verdict: SchemeVerdict = announce_verdict(self.kv_cache_scheme)
        if not self.kv_verdict.supported:
            # Nothing in SGLang may treat an unsupported scheme as servable.
            self.kv_cache_scheme = None
        # get_quant_config passes the model's HF config inside the quantization dict.
        hf_config = self.config.get("hf_config") if isinstance(self.config, dict) else None
        self.hf_config: Any = hf_config
        self.model_type: str | None = getattr(hf_config, "model_type", None)
        # SGLang parameter name -> the checkpoint tensor it was loaded from (as on disk):
        # errors name the file's tensor (filled by patches' name mapping).
        self.checkpoint_names: dict[str, str] = {}
        # Layers that read another layer's cache: what their own checkpoint scales were.
        self.shared = SharedLayers()
        # The layers' records (what each cycle loaded, refused and serves), the INFO line
        # of each cycle, and the layers themselves (sharers are re-synced at its end).
        self.cycle = Cycle(on_disk=self.checkpoint_names)
        self._layers: weakref.WeakValueDictionary[str, torch.nn.Module] = (
            weakref.WeakValueDictionary()
        )

    @property
    def kv_cache_quant_algo(self) -> str | None:  # type: ignore[override]
        # Read by SGLang's configure_kv_cache_dtype: "FP8" turns auto into fp8_e4m3 --
        # unless the attention backend would ignore the scales (hosts.sglang.backends).
        if not self.kv_verdict.supported:
            return None
        return None if _backend_verdict().action is BackendAction.MODEL_DTYPE else "FP8"

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        claimed = claims_checkpoint(hf_quant_cfg, user_quant)
        if claimed is not None:
            # ModelConfig verifies the quantization before the model is built, in every
            # process that builds one: this process serves with kvscale.
            activate()
        return claimed

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if isinstance(layer, RadixAttention):
            if not self.kv_verdict.declared:
                return None  # no scheme: no scale parameters, exactly as without the plugin
            return KVScaleKVCacheMethod(self, prefix or f"layer_{layer.layer_id}.attn")
        return super().get_quant_method(layer, prefix)


def _total_kv_heads(hf_config: Any) -> int | None:
    if hf_config is None:
        return None
    text_config = getattr(hf_config, "get_text_config", None)
    config = text_config() if callable(text_config) else hf_config
    for attr in ("num_key_value_heads", "num_attention_heads"):
        value = getattr(config, attr, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _head_placement(cfg: KVScaleConfig, layer: torch.nn.Module) -> HeadLayout | None:
    """None for per-tensor schemes; else which checkpoint heads this layer serves here
    (SGLang models split heads over the attention TP group or the full TP group, depending
    on the model: the layout that gives the layer its head count is the one)."""
    if not cfg.kv_verdict.per_head:
        return None
    per_rank = getattr(layer, "tp_k_head_num", None)
    layouts = live.tp_layouts()
    total = _total_kv_heads(cfg.hf_config)
    if total is None:
        # No HF config: the partitioned layout (exact whenever total >= tp size).
        total = int(per_rank or 1) * max(size for _, size in layouts)
    if not isinstance(per_rank, int) or per_rank <= 0:
        return HeadLayout(total, total, tuple(range(total)))
    return HeadLayout.place(total, per_rank, layouts)


class KVScaleKVCacheMethod(BaseKVCacheMethod):
    """Per-layer KV scales: sentinel placeholders, checkpoint-first resolution.

    ``layer.k_scale`` / ``v_scale`` are both what SGLang's loaders write into and
    what its attention backends read, so the checkpoint values of each load cycle
    are recorded by the parameter loaders, and post-processing always resolves
    from those raw values (never from the served, already-resolved tensors): a
    reload cannot compound fnuz x2 or keep a stale duplicated v_scale.
    """

    is_kvscale = True

    def __init__(self, quant_config: KVScaleConfig, layer_name: str) -> None:
        super().__init__(quant_config)
        self.quant_config: KVScaleConfig = quant_config
        self.layer_name = layer_name

    def create_weights(self, layer: torch.nn.Module) -> None:
        cfg = self.quant_config
        record = cfg.cycle.record(self.layer_name, layer, heads=_head_placement(cfg, layer))
        record.target = sharing_target(self.layer_name, layer, cfg.cycle.records)
        cfg._layers[self.layer_name] = layer
        cfg.cycle.built(self.layer_name)
        for name in _SCALE_NAMES:
            # float32 explicitly: SGLang builds layers under the model's default
            # dtype (bf16), which would round a calibrated 3.8649 to 3.8594.
            param = torch.nn.Parameter(
                torch.tensor(SENTINEL, dtype=torch.float32), requires_grad=False
            )
            param.weight_loader = scale_loader(record, name, record.heads)
            # One number per layer even for per-head schemes: SGLang's cache writes
            # divide by it and its backends broadcast it (see the module docstring).
            param._skip_weight_check = True  # SGLang's weight checker: not a model weight
            setattr(param, PLACEHOLDER_ATTR, True)
            setattr(layer, name, param)
        for name in ZERO_POINT_NAMES:
            # Accepted so that loaders do not trip over them, then dropped (symmetric only).
            param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            param.weight_loader = zero_point_loader(f"{self.layer_name}.{name}")
            param._skip_weight_check = True
            setattr(param, PLACEHOLDER_ATTR, True)
            setattr(layer, name, param)
        layer.k_scale_float = None
        layer.v_scale_float = None
        # This rank's per-head scales as served before the per-layer max (read-only view).
        layer.kvscale_k_heads = ()
        layer.kvscale_v_heads = ()

    def restore_weights_before_loading(self, layer: torch.nn.Module) -> None:
        # SGLang calls this before every update_weights_from_disk / weight sync: a new
        # load cycle starts. Served tensors keep their values until post-processing.
        record = layer_record(layer)
        if record is not None:
            record.start()
            self.quant_config.cycle.built(record.name)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        record = layer_record(layer)
        if record is None:
            return
        cfg = self.quant_config
        if record.name not in cfg.cycle.pending and record.resolved is not None:
            # Post-processing outside a load cycle (checkpoint-engine's post hook after
            # update_weights_from_ipc): the model.load_weights calls before it were cycles
            # of their own (live.standalone), which served and checked their scales.
            return
        loaded = dict(record.loaded)

        # The one policy (loadcycle.py); SGLang builds no KV method without a scheme.
        requested = _requested_kv_cache_dtype() or "auto"
        applies = serves_checkpoint_scales(cfg.kv_verdict, requested, quantized=_cache_may_be_fp8())
        if applies:
            verdict = _backend_verdict()
            if verdict.action is BackendAction.REFUSE:
                raise ValueError(verdict.message)
        pool = "fp8" if applies else requested
        target = cfg.cycle.records.get(record.target) if record.target else None
        if target is not None:  # reads the target's cache: serves the target's scales
            own = (loaded.get("k_scale"), loaded.get("v_scale"))
            resolved = serve_target(cfg.shared, record, target.resolved, own, cfg.checkpoint_names)
            record.loaded.clear()
            _write_scales(layer, record, resolved)
            record.served(resolved, SHARED_SOURCE)
            if cfg.cycle.done(record, pool):
                _end_cycle(cfg)
            return
        # The one rule for both hosts (loadcycle.decide), judged with the whole model's
        # refusals. No load through load_weights yet (a dummy load, e.g. for RL: the real
        # weights come with a later reload): no checkpoint to miss scales from.
        outcome = cfg.cycle.judge(
            record, serves=applies, dummy_load=cfg.cycle.weight_loads == 0, fnuz=is_fp8_fnuz()
        )
        if outcome.action is Action.REFUSE:
            raise CorruptScaleError(cfg.cycle.verdict.refused.message())
        record.loaded.clear()
        # KEEP never raises in a reload: SGLang post-processes layer by layer and its
        # weight-update paths have no rollback that could survive it (the disk update
        # "rolls back" by loading the same new checkpoint again). The layer keeps its
        # scales; the reload is refused once SGLang has finished (``_end_cycle``).
        if outcome.action is Action.SERVE:
            resolved = outcome.resolved
            assert resolved is not None
            if loaded and not outcome.unused_corrupt:
                record.raw = loaded  # a cycle with a corrupt tensor never becomes the record
            if resolved.per_head:
                _announce_per_layer_max()
            _write_scales(layer, record, resolved)
            record.served(resolved)
        if cfg.cycle.done(record, pool):
            _end_cycle(cfg)


def _end_cycle(cfg: KVScaleConfig) -> None:
    """Every layer of the cycle processed: sharing layers re-synced with their targets and
    what they shipped said once; the cycle's verdict reported (by the caller, where it
    answers the reload itself: ``patches._hook_update_weights_from_disk``). Then the
    served copies are checked, the update counted and the fingerprint logged
    (``live.after_cycle``)."""
    for record, resolved in cfg.cycle.sharing_records():
        layer = cfg._layers.get(record.name)
        if layer is not None:
            _write_scales(layer, record, resolved)
    for i, message in enumerate(cfg.shared.warnings()):
        warn_once(f"sglang-shared-kv-{i}", "%s", message)
    live.after_cycle(cfg, took_scales=cfg.cycle.verdict.took_scales)
    if not cfg.cycle.caller_reports:
        refused = report_verdict(cfg)
        if refused:
            # A weight-update session (update_weights_from_tensor / _distributed, closed by
            # end_weight_update): SGLang's session answers "Success" whatever its quant
            # methods found, so the refusal can only be logged.
            logger.error("%s", refused)


def report_verdict(cfg: KVScaleConfig) -> str | None:
    """Take the cycle's verdict: its warnings, once per cause; returns the error of a
    refused reload (None: not refused) for the caller to answer or log."""
    verdict = cfg.cycle.take_verdict()
    warn_verdict(verdict)
    return refused_reload_message(verdict.refused, "SGLang") if verdict.refused else None


def _announce_per_layer_max() -> None:
    warn_once(
        "sglang-per-head-max",
        "kvscale: the checkpoint has per-head KV scales (attn_head), but SGLang 0.5.23 "
        "takes one k/v scale per attention layer (its cache writes and attention backends "
        "have no per-head path); each layer is served in FP8 with the max of its heads' "
        "scales, so no head clips (heads with smaller scales get coarser FP8 steps). The "
        "per-head values are kept in each RadixAttention's kvscale_k_heads/kvscale_v_heads.",
    )


#: Update the served tensors in place, then every copy (``live.write_scales``).
_write_scales = live.write_scales


def _requested_kv_cache_dtype() -> str | None:
    # --kv-cache-dtype, published by SGLang's process entry before the model loads;
    # None when the model is built outside a server (then "auto" is assumed).
    try:
        from sglang.srt.runtime_context import get_context

        ctx = get_context()
        if not ctx.is_config_namespace_published("model"):
            return None
        return str(ctx.config_bag("model").kv_cache_dtype)
    except (ImportError, ValueError, AttributeError, RuntimeError):
        return None


def _cache_may_be_fp8() -> bool:
    """False when the user explicitly asked for a non-FP8 KV cache (it wins over the
    scheme), or asked for ``auto`` on an attention backend that ignores KV scales (kvscale
    then keeps the model dtype: hosts.sglang.backends)."""
    requested = _requested_kv_cache_dtype()
    if not (requested is None or requested == "auto" or requested.startswith("fp8")):
        return False
    return _backend_verdict().action is not BackendAction.MODEL_DTYPE


def _backend_verdict() -> BackendVerdict:
    """kvscale's decision for this process's attention backends (warned about once)."""
    verdict = judge_attention_backends(_requested_kv_cache_dtype(), configured_attention_backends())
    if verdict.action is BackendAction.MODEL_DTYPE:
        warn_once("sglang-scale-blind-backend", "%s", verdict.message)
    return verdict


def register_quantization() -> None:
    """Add ``kvscale`` to SGLang's registries and CLI choices (each exactly once)."""
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.server_args import add_quantization_method_choices

    # QUANTIZATION_METHODS is the live copy every lookup reads (never the BASE dict);
    # CPU_QUANTIZATION_METHODS is consulted instead on AMX CPUs.
    for registry in (
        sgl_quantization.QUANTIZATION_METHODS,
        sgl_quantization.CPU_QUANTIZATION_METHODS,
    ):
        registry[QUANTIZATION_METHOD] = KVScaleConfig
    # add_quantization_method_choices is list.extend: it does not de-duplicate.
    if QUANTIZATION_METHOD not in QUANTIZATION_CHOICES:
        add_quantization_method_choices([QUANTIZATION_METHOD])
