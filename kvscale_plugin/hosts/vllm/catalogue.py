"""The vLLM host's catalogue, as data: every feature (what a user gets, what installs it)
and every vLLM internal kvscale touches (``INTERNALS``), the feature that needs it and what
it is for. ``internals`` checks it live, ``tests/compat`` and ``make check-vllm`` against
release sources; ``activation`` installs the features. Imports no vLLM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvscale_plugin.releases import VLLM_MIN, VLLM_RUN, VLLM_STATIC


@dataclass(frozen=True)
class Feature:
    """What a user gets from a feature (and loses without it), and the function of this
    package (``"module.function"``) that ``activation`` installs it with (one returning
    False does not apply here: not installed, not lost); empty where the feature is a flag
    its own code reads (``scales`` is registered by ``install.register_method``)."""

    what: str
    install: str = ""


#: Every feature, in installation order.
FEATURES: dict[str, Feature] = {
    "scales": Feature(
        "checkpoint k/v scales served under --quantization kvscale (per tensor, per head)"
    ),
    "name-parity": Feature(
        "vLLM's by-name decisions answered for kvscale as for compressed-tensors "
        "(NVFP4 fusion pass, metrics weight size)",
        "parity.install",
    ),
    "reload-check": Feature(
        "in-place reloads with corrupt KV scales refused, reloads without scales reported",
        # (else when the KV method builds a layer: ``reload.ensure_worker_wrappers``)
        "reload.install_worker_wrappers",
    ),
    # Installed once the model declares MTP layers (``mtp.ensure_draft_routing``).
    "mtp-drafts": Feature(
        "MTP draft layers served with their own checkpoint KV scales (the Gemma-4 "
        "assistant drafter's with its target layers')"
    ),
    "cpu-write": Feature(
        "round-to-nearest-even FP8 cache write on vLLM's CPU platform (vLLM's own write truncates)",
        # CPU platform only; layers take it as processed (``cpu_write.serve_layer``)
        "runtime.on_cpu",
    ),
    "custom-backend": Feature(
        "--attention-backend CUSTOM: the fused Triton FP8 cache write", "backend.register_backend"
    ),
    "rl-sync": Feature(
        "RL weight syncs: KV scales sent through model.load_weights taken, the served "
        "copies checked after every load, a scale fingerprint, the prefix cache reset "
        "when the scales an FP8 cache is written with change",
        # (the model's own load_weights is wrapped at the end of its start-up load)
        "prefixcache.install",
    ),
    # The front end of a data-parallel deployment (``vllm serve --data-parallel-size N``).
    "dp-answers": Feature(
        "kvscale's by-name checks (collective_rpc('kvscale_fingerprint') / "
        "('kvscale_check')) answered by every data-parallel engine, not engine 0 alone",
        "extension.install_all_answers",
    ),
    # Loaded by vLLM itself (kv_connector_module_path=kvscale_plugin.hosts.vllm.connectors).
    "kv-connectors": Feature(
        "KV that leaves the block pool keeps its scales: kvscale's ExampleConnector stores "
        "KV under the scale state, its NixlConnector carries the state in "
        "kv_transfer_params and recomputes a prefill written under other FP8 scales"
    ),
    # The KV method runs the check (``deployment.check_deployment``).
    "deployment-check": Feature(
        "a multi-node engine whose ranks do not all serve with kvscale (of one version) "
        "refuses to start, naming them"
    ),
}

#: vLLM releases the adapter is tested with (``kvscale_plugin.releases``): run in CI,
#: checked statically against their sources, and the oldest supported.
RUN_TESTED, STATIC_TESTED, MIN_VERSION = VLLM_RUN, VLLM_STATIC, VLLM_MIN
SUPPORTED_RANGE = f">={MIN_VERSION} (tested: {', '.join(RUN_TESTED + STATIC_TESTED)})"

_Q = "vllm.model_executor.layers.quantization"
_CT = f"{_Q}.compressed_tensors.compressed_tensors"
_RELOAD = "vllm.model_executor.model_loader.reload"
_UPDATE = ("layer", "key", "value", "kv_cache", "slot_mapping")
_SPEC = "vllm.v1.worker.gpu.spec_decode.gemma4"
_KVC_V1 = "vllm.distributed.kv_transfer.kv_connector.v1"
_KVC = f"{_KVC_V1}.base"
_ASSISTANT = (
    "the Gemma-4 assistant drafter's layers get kv_sharing_target_layer_name here, after "
    "loading, and no scale; a bf16 assistant has no KV method: no kvscale hook runs on them"
)


@dataclass(frozen=True)
class Internal:
    """One vLLM internal: ``module``.``attr`` (``attr`` may be dotted, or empty for the
    module itself).

    ``params``: parameters kvscale passes or reads by name, in order as the target's first
    parameters (``self`` / ``cls`` not counted). ``required``: the feature needs it (else it
    is used where present: a path that exists in some releases only). ``lazy``: not
    imported at start-up (see the module docstring). ``cpu_only``: checked only on vLLM's
    CPU platform. ``moved``: other modules the same ``attr`` lives in, in other releases
    (the first that resolves is the target). ``calls``: the target is a function that must
    call a function of this name -- kvscale is on the path vLLM takes only then (a name
    that still exists but is no longer called would otherwise pass). ``patch``: non-empty
    when kvscale *replaces* this target in a ``-q kvscale`` engine: the upstream limitation
    that leaves no public extension point for it (docs/compatibility.md lists these).
    """

    module: str
    attr: str
    feature: str
    purpose: str
    params: tuple[str, ...] = ()
    required: bool = True
    lazy: bool = False
    cpu_only: bool = False
    moved: tuple[str, ...] = ()
    calls: str = ""
    patch: str = ""

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module

    @property
    def modules(self) -> tuple[str, ...]:
        return (self.module, *self.moved)


def _i(module: str, attr: str, feature: str, purpose: str, **kw: Any) -> Internal:
    return Internal(module, attr, feature, purpose, **kw)


#: Every vLLM internal kvscale touches (also what ``tests/compat`` checks statically).
INTERNALS: tuple[Internal, ...] = (
    # -- scales (the core; public extension points and the classes they expect)
    _i(_Q, "register_quantization_config", "scales", "registers --quantization kvscale"),
    _i(
        f"{_Q}.base_config",
        "QuantizationConfig.get_cache_scale_mapper",
        "scales",
        "stock KV-scale name mapper, composed after kvscale's",
    ),
    _i(f"{_Q}.base_config", "QuantizeMethodBase", "scales", "type of get_quant_method"),
    _i(
        "vllm.model_executor.layers.attention.attention",
        "validate_kv_sharing_target",
        "scales",
        "layers that read another layer's KV cache name it in kv_sharing_target_layer_name "
        "(which this validates): kvscale serves them that layer's scales",
    ),
    _i(
        _CT,
        "CompressedTensorsConfig.maybe_update_config",
        "scales",
        "subclassed: linear / MoE schemes stay vLLM's; model type and MTP depth read here",
        params=("model_name", "hf_config", "revision"),
    ),
    _i(
        _CT,
        "CompressedTensorsConfig.apply_vllm_mapper",
        "scales",
        "kv_cache_scheme kept as declared",
        params=("hf_to_vllm_mapper",),
    ),
    _i(
        _CT,
        "CompressedTensorsConfig.get_quant_method",
        "scales",
        "attention layers get kvscale's KV method",
        params=("layer", "prefix"),
    ),
    _i(
        _CT,
        "CompressedTensorsKVCacheMethod",
        "scales",
        "subclassed: vLLM's attention special-cases it",
    ),
    _i(
        f"{_Q}.kv_cache",
        "BaseKVCacheMethod.process_weights_after_loading",
        "scales",
        "scale placeholders -> _k_scale/_v_scale",
        params=("layer",),
    ),
    _i(
        "vllm.model_executor.layers.attention",
        "Attention",
        "scales",
        "which layers get the KV method",
    ),
    _i(
        "vllm.model_executor.models.utils",
        "WeightsMapper",
        "scales",
        "kvscale's checkpoint-name mapping",
    ),
    _i(
        "vllm.model_executor.models.utils",
        "AutoWeightsLoader.load_weights",
        "scales",
        "applies the quantization config's KV-scale mapper only when the module it loads or a "
        "direct child has a quant_config: a model module with a load_weights and none (Jamba) "
        "is given the kvscale engine's config while it is built (hosts/vllm/scalepaths)",
    ),
    _i(
        "vllm.config.model",
        "ModelConfig.get_total_num_kv_heads",
        "scales",
        "per-head schemes: the model's KV heads, which TP partitions or replicates (read "
        "where the quantization config has no total_num_kv_heads: vLLM sets that and "
        "total_num_heads only for a compressed-tensors config with config_groups)",
    ),
    _i(
        "vllm.model_executor.utils",
        "is_weights_pre_processed",
        "scales",
        "pre-processed weights pass through",
    ),
    _i("vllm.platforms", "current_platform", "scales", "FP8 fnuz / CPU decisions"),
    _i(
        "vllm.v1.kv_cache_interface",
        "is_quantized_kv_cache",
        "scales",
        "whether a layer's cache is FP8 (moved here from vllm.utils.torch_utils in 0.33)",
        params=("kv_cache_dtype",),
    ),
    _i(
        "vllm.distributed",
        "get_tensor_model_parallel_rank",
        "scales",
        "per-head scales: this rank's heads",
    ),
    _i(
        "vllm.distributed",
        "get_tensor_model_parallel_world_size",
        "scales",
        "per-head scales: this rank's heads",
    ),
    _i("vllm.distributed", "get_pp_group", "scales", "pipeline-parallel name checks"),
    _i(
        "vllm.config",
        "get_current_vllm_config_or_none",
        "scales",
        "dummy loads and an explicit FP8 cache",
    ),
    _i(
        f"{_RELOAD}.direct",
        "direct_reload_enabled",
        "scales",
        "vLLM >= 0.34's direct reload writes into the placeholders again: they are kept",
        required=False,
    ),
    # -- name-parity
    _i(
        "vllm.config.model",
        "ModelConfig.is_nvfp4_quantized",
        "name-parity",
        "wrapped: answered for kvscale as for compressed-tensors",
        patch="VllmConfig enables the NVFP4 fusion pass by comparing "
        "ModelConfig.quantization with the string 'compressed-tensors' "
        "(config/vllm.py); a quantization method has no say in it",
    ),
    _i(
        "vllm.v1.metrics.perf",
        "_QUANT_WEIGHT_BYTE_SIZE",
        "name-parity",
        "metrics byte size per method name",
        required=False,
        patch="AttentionQuantizationConfigParser looks the method's name up in this "
        "module-level dict and raises InvalidComponent for any name it lacks; a "
        "quantization method cannot declare its weight byte size",
    ),
    # -- reload-check: the KV method refuses a corrupt reload where vLLM calls it on every
    # reload (its weight loaders, process_weights_after_loading); the worker's entry points
    # raise the refusal after vLLM's own after-reload steps.
    _i(
        f"{_RELOAD}.layerwise",
        "_reload_attention_scales",
        "reload-check",
        "the layerwise reload runs the KV method on reloaded scales",
        calls="process_weights_after_loading",
    ),
    _i(
        f"{_RELOAD}.direct",
        "finish_direct_reload",
        "reload-check",
        "the direct reload (VLLM_RELOAD_MODE=direct, vLLM >= 0.34) reruns every "
        "module's post-load processing",
        calls="process_weights_after_loading",
        required=False,
    ),
    _i(
        "vllm.v1.worker.gpu_worker",
        "Worker.reload_weights",
        "reload-check",
        "wrapped: raises a refused reload after the worker's own after-reload steps",
        calls="reload_weights",
        lazy=True,
        patch="a reload's refusal cannot be raised from the KV method: it runs inside "
        "vLLM's layerwise finalize loop (reload/layerwise.py, "
        "finalize_layerwise_processing), and an exception there leaves the later "
        "attention layers unprocessed and the reload's buffers in place; vLLM has no "
        "after-reload hook",
    ),
    _i(
        "vllm.v1.worker.gpu_worker",
        "Worker.finish_weight_update",
        "reload-check",
        "wrapped: raises a refused weight sync after the session ends",
        lazy=True,
        patch="as for reload_weights: the weight-transfer engine finalizes the reload "
        "inside finish_weight_update, which must still end the session "
        "(_weight_update_active = False) before a refusal is raised",
    ),
    # -- rl-sync: a scale change reaches the prefix cache, which lives in the engine core
    _i(
        "vllm.v1.engine.core",
        "EngineCore.collective_rpc",
        "rl-sync",
        "wrapped: after each call, asks the workers whether the scales their FP8 caches "
        "are written with changed, and if so resets the prefix cache",
        params=("method", "timeout", "args", "kwargs"),
        patch="a worker cannot reach the prefix cache (it lives in the engine core's "
        "scheduler) and vLLM has no hook after a weight update: cached blocks written "
        "under the old scales would be read under the new ones",
    ),
    _i(
        "vllm.model_executor.model_loader.default_loader",
        "DefaultModelLoader.load_weights",
        "rl-sync",
        "a checkpoint is loaded through the model's own load_weights, which kvscale wraps "
        "on the loaded model instance (RL syncs call it directly, outside any load cycle)",
        calls="load_weights",
    ),
    _i(
        f"{_RELOAD}.layerwise",
        "initialize_layerwise_reload",
        "rl-sync",
        "a reload or weight-transfer session restores the scale placeholders: a "
        "model.load_weights inside it goes to the KV method (kvscale's wrapper passes it on)",
    ),
    _i(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.schedule",
        "rl-sync",
        "wrapped: before each step, a pending prefix-cache reset runs (a scale change "
        "in this process's workers, or one the engine core saw across processes), "
        "retried until it succeeds",
        patch="a scale change made by a direct call (an in-process or colocated SPMD "
        "engine: model.load_weights, worker.reload_weights) passes no engine-core RPC, "
        "and a reset that fails (blocks held for a remote decode side) must be retried: "
        "vLLM has no hook after a weight update nor before a step",
    ),
    _i(
        "vllm.v1.core.sched.scheduler",
        "Scheduler.reset_prefix_cache",
        "rl-sync",
        "resets the prefix cache, preempting running requests (recomputed) the first time, "
        "and the store of a KV connector of vLLM's that implements reset_cache",
        params=("reset_running_requests", "reset_connector"),
    ),
    _i(
        "vllm.v1.engine.core_client",
        "DPLBAsyncMPClient.collective_rpc_async",
        "dp-answers",
        "wrapped on the data-parallel client: a call of kvscale's by-name methods gathers "
        "every engine's answers (any other call is vLLM's)",
        params=("method", "timeout", "args", "kwargs"),
        patch="vLLM's data-parallel client sends a utility call to every engine and returns "
        "engine 0's answer only (call_utility_async), with no way to ask for all of them: "
        "a check of what every replica serves would be heard from replica 0 alone",
    ),
    _i(
        "vllm.v1.engine.core_client",
        "AsyncMPClient._call_utility_async",
        "dp-answers",
        "one engine's answer to a utility call (engine=: one of the client's core_engines)",
        params=("method",),
    ),
    _i(
        _KVC,
        "KVConnectorBase_V1.get_handshake_metadata",
        "kv-connectors",
        "worker side: the worker's part of the scale state rides along the wrapped "
        "connector's own handshake metadata (worker -> scheduler at start-up)",
    ),
    _i(
        _KVC,
        "KVConnectorBase_V1.set_xfer_handshake_metadata_pp_aware",
        "kv-connectors",
        "scheduler side: the engine's scale state; the wrapped connector gets its own metadata",
        params=("metadata",),
    ),
    _i(
        f"{_KVC_V1}.example_connector",
        "ExampleConnector._generate_foldername_debug",
        "kv-connectors",
        "subclassed: the folder of a prompt's KV gains a folder of the scale state (vLLM's "
        "store is keyed by the prompt's token ids only)",
        params=("token_ids", "mm_hashes", "create_folder"),
        lazy=True,
    ),
    _i(
        f"{_KVC_V1}.nixl.connector",
        "NixlBaseConnector.update_state_after_alloc",
        "kv-connectors",
        "subclassed: 0 external tokens takes NIXL's full-local-hit path, which tells the "
        "producer to free the request's blocks",
        params=("request", "blocks", "num_external_tokens"),
        lazy=True,
    ),
    _i(
        "vllm.v1.executor.multiproc_executor",
        "MultiprocExecutor.collective_rpc",
        "rl-sync",
        "reads the ranks' answers in order and stops at the first failure: after a "
        "refusal every rank made, kvscale reads the other ranks' answers to that call "
        "(its response_mqs) so that the next call reads its own",
    ),
    # -- mtp-drafts
    _i(
        "vllm.model_executor.model_loader.default_loader",
        "DefaultModelLoader.get_all_weights",
        "mtp-drafts",
        "wrapped (engines with an MTP draft only): MTP-layer scales routed to the draft's layers",
        params=("model_config", "model"),
        patch="MTP drafts route checkpoint names on their own (MiMo's loader never "
        "applies a quantization config's scale-name mapper, GLM-4-MoE's looks names up "
        "in its parameters): no mapper or weight loader of the KV method sees an "
        "MTP-layer scale before the draft's own load_weights raises on it",
    ),
    _i(
        "vllm.v1.spec_decode.gemma4",
        "Gemma4Proposer._setup_gemma4_kv_sharing",
        "mtp-drafts",
        "wrapped (engines drafting with Gemma-4's assistant only): the drafter's layers "
        "hold their target layers' scales",
        params=("target_attn_layer_names",),
        required=False,
        lazy=True,
        patch=_ASSISTANT,
    ),
    _i(
        f"{_SPEC}.speculator",
        "Gemma4Speculator._setup_gemma4_kv_sharing",
        "mtp-drafts",
        "as Gemma4Proposer's (vLLM 0.34)",
        required=False,
        lazy=True,
        patch=_ASSISTANT,
    ),
    # -- cpu-write (per kvscale layer: its attention impl gets kvscale's write; vLLM's
    # class is untouched)
    _i(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl.do_kv_cache_update",
        "cpu-write",
        "kvscale layers' impl is a subclass overriding it (vLLM's CPU platform ignores "
        "--attention-backend, so no registered backend can be selected there)",
        params=_UPDATE,
        cpu_only=True,
    ),
    _i(
        "vllm.forward_context",
        "get_forward_context",
        "cpu-write",
        "one write plan per forward step",
        cpu_only=True,
    ),
    _i(
        "vllm.forward_context",
        "is_forward_context_available",
        "cpu-write",
        "one write plan per forward step",
        cpu_only=True,
    ),
    _i(
        "vllm.v1.attention.backend",
        "AttentionType",
        "cpu-write",
        "encoder layers keep vLLM's write",
        cpu_only=True,
    ),
    _i(
        "vllm._custom_ops",
        "cpu_attn_reshape_and_cache",
        "cpu-write",
        "vLLM's write, the reference of the layout check (vllm._cpu_ops from 0.34)",
        lazy=True,
        moved=("vllm._cpu_ops",),
    ),
    # -- custom-backend
    _i(
        "vllm.v1.attention.backends.registry",
        "AttentionBackendEnum.CUSTOM",
        "custom-backend",
        "the slot --attention-backend CUSTOM selects",
    ),
    _i(
        "vllm.v1.attention.backends.registry",
        "register_backend",
        "custom-backend",
        "points CUSTOM at kvscale's backend (in kvscale engines only)",
    ),
    _i(
        "vllm.v1.attention.backends.triton_attn",
        "TritonAttentionBackend",
        "custom-backend",
        "subclassed (built on first use)",
        lazy=True,
    ),
    _i(
        "vllm.v1.attention.backends.triton_attn",
        "TritonAttentionImpl.do_kv_cache_update",
        "custom-backend",
        "overridden: the fused FP8 write",
        params=_UPDATE,
        lazy=True,
    ),
    _i(
        "vllm.v1.attention.backends.triton_attn",
        "TritonAttentionImpl.forward",
        "custom-backend",
        "per-head layers read with the per-layer max",
        params=("layer",),
        lazy=True,
    ),
    _i(
        "vllm.v1.kv_cache_interface",
        "KVQuantMode",
        "custom-backend",
        "per-tensor FP8 caches only",
        lazy=True,
    ),
    # -- deployment-check
    _i(
        "vllm.config", "ParallelConfig.nnodes", "deployment-check", "whether the engine spans nodes"
    ),
    _i("vllm.config", "ParallelConfig.node_rank", "deployment-check", "names a rank's node"),
)

#: The places a ``-q kvscale`` engine may patch (each with its reason in ``patch``).
PATCHED: tuple[Internal, ...] = tuple(i for i in INTERNALS if i.patch)
