"""Every vLLM internal the adapter touches, in one checked list, and the features they carry.

vLLM ships a release a month and moves internals between them. A plugin that imports a
moved name at registration stops *every* vLLM start (``load_general_plugins`` calls each
plugin without a try/except). So the adapter never imports vLLM blindly: ``INTERNALS``
names each target (module, attribute, the parameters kvscale's code passes or reads), the
feature that needs it and what it is for; ``check`` resolves them on the installed vLLM
before anything is registered, and a missing or changed target disables only its own
feature, with one line saying what is lost (``hosts.vllm.register``).

Features (``FEATURES``), each all or nothing:

* ``scales`` -- the core: ``--quantization kvscale`` loads, validates and serves the
  checkpoint's per-layer / per-head k/v scales through vLLM's quantization registry and
  KV-cache method (its public extension points). Every other feature needs it.
* ``name-parity`` -- decisions vLLM makes by the method's *name* answered for ``kvscale``
  as for ``compressed-tensors`` (NVFP4 fusion pass, metrics byte size).
* ``reload-check`` -- a reload with corrupt scales is refused after vLLM finishes it; a
  reload without scales is reported.
* ``mtp-drafts`` -- MTP draft layers get their own checkpoint scales.
* ``cpu-write`` -- round-to-nearest-even FP8 cache write on vLLM's CPU platform.
* ``custom-backend`` -- ``--attention-backend CUSTOM``: the fused Triton FP8 cache write.
* ``deployment-check`` -- an engine spanning several nodes starts only when every rank
  serves with kvscale, of one version.

Targets are checked live (imported, resolved, signatures read) when registering, except
``lazy`` ones, whose modules are heavy or platform-specific and are imported by vLLM later
(the worker, the Triton backend): those are checked where they are used, and statically
against every supported release's sources by the test suite.

Installers change vLLM only through ``replace`` inside ``transaction``: a feature whose
installation fails half way is rolled back, so a retry in the same process (a notebook
cell run twice) behaves like the first attempt.

This module imports no vLLM at import time.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

#: Feature -> what a user gets from it (and loses without it).
FEATURES: dict[str, str] = {
    "scales": "checkpoint k/v scales served under --quantization kvscale (per tensor, per head)",
    "name-parity": "vLLM's by-name decisions answered for kvscale as for compressed-tensors "
    "(NVFP4 fusion pass, metrics weight size)",
    "reload-check": "in-place reloads with corrupt KV scales refused, reloads without scales "
    "reported",
    "mtp-drafts": "MTP draft layers served with their own checkpoint KV scales",
    "cpu-write": "round-to-nearest-even FP8 cache write on vLLM's CPU platform (vLLM's own "
    "write truncates)",
    "custom-backend": "--attention-backend CUSTOM: the fused Triton FP8 cache write",
    "deployment-check": "a multi-node engine whose ranks do not all serve with kvscale (of "
    "one version) refuses to start, naming them",
}

#: vLLM releases the adapter is tested with: run in CI (CPU builds) ...
RUN_TESTED = ("0.30.0", "0.31.0", "0.32.0")
#: ... and checked statically (every target below against the release's sources).
STATIC_TESTED = ("0.33.0",)
#: The oldest release the adapter supports (older ones: the core is not offered).
MIN_VERSION = "0.30.0"
SUPPORTED_RANGE = f">={MIN_VERSION} (tested: {', '.join(RUN_TESTED + STATIC_TESTED)})"

_Q = "vllm.model_executor.layers.quantization"
_CT = f"{_Q}.compressed_tensors.compressed_tensors"
_RELOAD = "vllm.model_executor.model_loader.reload"
_UPDATE = ("layer", "key", "value", "kv_cache", "slot_mapping")


@dataclass(frozen=True)
class Internal:
    """One vLLM internal: ``module``.``attr`` (``attr`` may be dotted, or empty for the
    module itself).

    ``params``: parameters kvscale passes or reads by name, in order as the target's first
    parameters (``self`` / ``cls`` not counted). ``required``: the feature needs it (else it
    is wrapped where present: a call site that exists in some releases only). ``lazy``:
    not imported at registration (see the module docstring). ``cpu_only``: checked only on
    vLLM's CPU platform.
    """

    module: str
    attr: str
    feature: str
    purpose: str
    params: tuple[str, ...] = ()
    required: bool = True
    lazy: bool = False
    cpu_only: bool = False

    @property
    def target(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


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
    # -- name-parity
    _i(
        "vllm.config.model",
        "ModelConfig.is_nvfp4_quantized",
        "name-parity",
        "wrapped: answered for kvscale as for compressed-tensors",
    ),
    _i(
        "vllm.v1.metrics.perf",
        "_QUANT_WEIGHT_BYTE_SIZE",
        "name-parity",
        "metrics byte size per method name",
        required=False,
    ),
    # -- reload-check
    _i(
        _RELOAD,
        "initialize_layerwise_reload",
        "reload-check",
        "wrapped: forget an earlier cycle's corrupt scales",
        params=("model",),
    ),
    _i(
        _RELOAD,
        "finalize_layerwise_reload",
        "reload-check",
        "wrapped: refuse a corrupt reload after vLLM finishes it",
        params=("model",),
    ),
    _i(
        f"{_RELOAD}.layerwise",
        "get_layerwise_info",
        "reload-check",
        "which layers a reload gave no tensor",
    ),
    # Call sites of reload_weights: ``reload.inplace`` (vLLM >= 0.32) or the model runner,
    # which binds both functions by name (0.30-0.31; imported later: lazy).
    *(
        _i(
            site,
            name,
            "reload-check",
            f"call site of reload_weights ({since})",
            params=("model",),
            required=False,
            lazy=lazy,
        )
        for site, since, lazy in (
            (f"{_RELOAD}.inplace", "vLLM >= 0.32", False),
            ("vllm.v1.worker.gpu_model_runner", "vLLM 0.30-0.31", True),
        )
        for name in ("initialize_layerwise_reload", "finalize_layerwise_reload")
    ),
    _i(
        "vllm.v1.worker.gpu_worker",
        "Worker.reload_weights",
        "reload-check",
        "wrapped: raises a refused reload after the worker's own after-reload steps",
        lazy=True,
    ),
    _i(
        "vllm.v1.worker.gpu_worker",
        "Worker.finish_weight_update",
        "reload-check",
        "wrapped: raises a refused weight sync after the session ends",
        lazy=True,
    ),
    # -- mtp-drafts
    _i(
        "vllm.model_executor.model_loader.default_loader",
        "DefaultModelLoader.get_all_weights",
        "mtp-drafts",
        "wrapped: MTP-layer scales routed to the draft's layers",
        params=("model_config", "model"),
    ),
    # -- cpu-write
    _i(
        "vllm.v1.attention.backends.cpu_attn",
        "CPUAttentionBackendImpl.do_kv_cache_update",
        "cpu-write",
        "wrapped: kvscale layers' FP8 cache write",
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
        "vLLM's write, the reference of the layout check",
        lazy=True,
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
        "points CUSTOM at kvscale's backend",
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


# ----------------------------------------------------------------------------- checking


def _lookup(owner: Any, name: str) -> Any:
    """``getattr`` for classes without triggering descriptors (a method stays a function)."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name]
    return getattr(owner, name)


def resolve(internal: Internal) -> Any:
    """Import ``internal``'s module and follow its attribute chain (raises when moved)."""
    obj: Any = importlib.import_module(internal.module)
    for part in filter(None, internal.attr.split(".")):
        obj = _lookup(obj, part)
    return obj


def _param_names(obj: Any) -> list[str] | None:
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return None  # takes anything positionally
    return [p for p in params if p not in ("self", "cls")]


def params_problem(expected: tuple[str, ...], found: list[str] | None) -> str | None:
    """Why ``found`` (a target's parameter names) does not start with ``expected``."""
    if not expected or found is None:
        return None
    if tuple(found[: len(expected)]) != expected:
        return (
            f"parameters changed: expected ({', '.join(expected)}, ...), found ({', '.join(found)})"
        )
    return None


def problem(internal: Internal) -> str | None:
    """Why ``internal`` does not resolve on the installed vLLM (None: it does)."""
    try:
        obj = resolve(internal)
    except Exception as exc:  # noqa: BLE001 - any failure to import / resolve is "moved"
        return f"{type(exc).__name__}: {exc}"
    return params_problem(internal.params, _param_names(obj))


def _on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return bool(current_platform.is_cpu())
    except Exception:  # noqa: BLE001 - no platform: nothing CPU-only is checked
        return False


@dataclass
class Report:
    """What ``check`` found: per feature, the problems of its required targets."""

    problems: dict[str, list[str]]
    checked: dict[str, int]

    def available(self, feature: str) -> bool:
        return not self.problems.get(feature)

    def lost(self) -> list[str]:
        return [f for f in FEATURES if self.problems.get(f)]

    def held(self) -> list[str]:
        return [f for f in FEATURES if not self.problems.get(f)]


def check(internals: Iterable[Internal] | None = None) -> Report:
    """Resolve every non-lazy target; a feature is unavailable when a required one fails.

    Every feature needs ``scales``; without it all are reported lost."""
    problems: dict[str, list[str]] = {f: [] for f in FEATURES}
    checked: dict[str, int] = {f: 0 for f in FEATURES}
    on_cpu: bool | None = None
    for internal in INTERNALS if internals is None else internals:
        if internal.lazy or not internal.required:
            continue
        if internal.cpu_only:
            on_cpu = _on_cpu() if on_cpu is None else on_cpu
            if not on_cpu:
                continue
        checked[internal.feature] += 1
        if (why := problem(internal)) is not None:
            problems[internal.feature].append(f"{internal.target} ({internal.purpose}): {why}")
    if problems["scales"]:
        for feature in FEATURES:
            if feature != "scales" and not problems[feature]:
                problems[feature].append("needs the 'scales' feature")
    return Report(problems, checked)


#: Features installed in this process (by ``hosts.vllm.register``).
installed: set[str] = set()

# ------------------------------------------------------------------------ transactions

_MISSING = object()
_journal = threading.local()
_patch_lock = threading.RLock()


def replace(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, undone if the enclosing ``transaction`` fails."""
    with _patch_lock:
        original = (
            owner.__dict__.get(name, _MISSING)
            if isinstance(owner, type)
            else getattr(owner, name, _MISSING)
        )
        setattr(owner, name, value)
        log = getattr(_journal, "entries", None)
        if log is not None:
            log.append((owner, name, original))


def _undo(entries: list[tuple[Any, str, Any]]) -> None:
    for owner, name, original in reversed(entries):
        with contextlib.suppress(Exception):
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def transaction() -> Iterator[None]:
    """Every ``replace`` inside is rolled back if the block raises (then re-raised)."""
    outer = getattr(_journal, "entries", None)
    entries: list[tuple[Any, str, Any]] = []
    _journal.entries = entries
    try:
        yield
    except BaseException:
        _undo(entries)
        raise
    finally:
        _journal.entries = outer
    if outer is not None:
        outer.extend(entries)


def loaded(module: str) -> Any:
    """The module if the process has imported it (lazy targets), else None."""
    return sys.modules.get(module)
