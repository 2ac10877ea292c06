"""``HookRegistry`` patches that close SGLang 0.5.23's gaps for ``--quantization kvscale``.

Written against SGLang 0.5.23 (``WRITTEN_AGAINST``). The quantization method itself
(``hosts.sglang.method``) uses SGLang's documented extension point; everything here
wraps SGLang internals instead, so this is the half of the adapter that breaks when
SGLang moves code. ``PATCHES`` lists every patch: its target, its kind (``AFTER`` /
``AROUND``) and what it does; each hook's docstring says which gap of SGLang it closes:

1. ``sglang.srt.model_loader.loader._initialize_model``: checkpoint KV-scale names
   mapped onto a kvscale model's placeholders in every load path, and a draft's MTP-layer
   scales loaded into its attention layers (``loading._install_name_mapping``);
2. ``sglang.srt.model_loader.weight_utils.maybe_remap_kv_scale_name``: mapped names pass
   SGLang's remapping (``_hook_remap_kv_scale_name``);
3. ``sglang.srt.model_loader.utils.get_model_architecture``: Mixtral keeps its class
   (``_hook_model_architecture``);
4. ``sglang.srt.models.qwen3.Qwen3Attention.__init__``,
5. ``sglang.srt.models.qwen3_moe.Qwen3MoeAttention.__init__`` and
6. ``sglang.srt.models.glm4_moe.Glm4MoeAttention.__init__``: their ``RadixAttention``
   gets the KV method SGLang does not give it (``ATTENTION_WITHOUT_QUANT_CONFIG``);
7. ``sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater.
   update_weights_from_disk``: a reload kvscale refused is answered as failed
   (``_hook_update_weights_from_disk``);
8. ``sglang.srt.managers.scheduler_components.weight_updater.
   SchedulerWeightUpdaterManager.update_weights_from_disk``,
9. ``sglang.srt.managers.scheduler_components.weight_updater.
   SchedulerWeightUpdaterManager.update_weights_from_tensor``,
10. ``sglang.srt.managers.scheduler_components.weight_updater.
   SchedulerWeightUpdaterManager.update_weights_from_distributed``,
11. ``sglang.srt.managers.scheduler_components.weight_updater.
   SchedulerWeightUpdaterManager.update_weights_from_ipc`` and
12. ``sglang.srt.managers.scheduler_components.weight_updater.
   SchedulerWeightUpdaterManager.end_weight_update``:
   on an FP8 pool the radix cache is flushed when a sync changed the scales and SGLang did
   not flush it (``_hook_scheduler_sync``, ``live.after_sync``);
13. ``sglang.srt.managers.scheduler.Scheduler.get_internal_state``: the scale
   fingerprint returned by ``Engine.get_server_info()`` (``_hook_internal_state``).

Not a patch: a model's ``load_weights`` wrapper (patch 1, ``loading``) makes a call
outside SGLang's load cycles a cycle of its own, so its scales are served.

A moved target fails loudly. SGLang's ``HookRegistry.apply_hooks`` only logs a target
it cannot resolve and carries on, which would serve with stock behaviour (dropped or
unmapped scales, FP8 at scale 1.0). ``check_targets`` therefore resolves every target
itself (imports the module, follows the attribute chain, and checks the parameters
each hook reads by name or position) and raises ``RuntimeError`` naming each moved
target, what its patch does, the installed SGLang and what to install.
``hosts.sglang.register`` runs it before anything is registered, so on such a SGLang
``kvscale`` is not offered at all (``register`` catches the error and warns once, naming
the moved targets; ``--quantization kvscale`` is then an unknown choice) instead of
half-working.
"""

from __future__ import annotations

import functools
import inspect
import pkgutil
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _current_plugin_source

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts._common import parameter_names, resolve_attribute
from kvscale_plugin.hosts.sglang import live
from kvscale_plugin.hosts.sglang.loading import _ACTIVE_CONFIG, _install_name_mapping
from kvscale_plugin.hosts.sglang.method import HOST, PLACEHOLDER_ATTR, KVScaleConfig, report_verdict
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.names import declared_mtp_layers, map_scale_name
from kvscale_plugin.releases import SGLANG_RUN

#: The SGLang release these patches were written against (and tested with).
WRITTEN_AGAINST = "0.5.23"


def _hook_initialize_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    """AFTER ``model_loader.loader._initialize_model``: set up kvscale models only."""
    model_config = args[0] if args else kwargs.get("model_config")
    quant_config = args[2] if len(args) > 2 else kwargs.get("quant_config")
    if quant_config is None:
        quant_config = getattr(model, "quant_config", None)
    if isinstance(quant_config, KVScaleConfig) and hasattr(model, "load_weights"):
        if quant_config.model_type is None:
            quant_config.model_type = getattr(getattr(model, "config", None), "model_type", None)
        layers = getattr(model_config, "num_hidden_layers", None)
        _install_name_mapping(
            model,
            quant_config,
            num_hidden_layers=layers if isinstance(layers, int) else None,
            draft=bool(getattr(model_config, "is_draft_model", False)),
            declared_mtp=declared_mtp_layers(
                getattr(model_config, "hf_config", None),
                getattr(model_config, "hf_text_config", None),
            ),
        )
    return None


def _hook_remap_kv_scale_name(
    original: Callable[..., str | None], name: str, params_dict: dict, *args: Any, **kwargs: Any
) -> str | None:
    """AROUND ``weight_utils.maybe_remap_kv_scale_name``: names that map onto a kvscale
    placeholder are answered by the pluggy hook (stock would append a second ``.attn``
    to an already-mapped name, or drop ``qkv_proj.k_scale``); everything else is stock."""
    cfg = _ACTIVE_CONFIG.get()
    mapped = map_scale_name(name, HOST, cfg.model_type if cfg is not None else None)
    if mapped is not None:
        param = params_dict.get(mapped)
        if param is not None and getattr(param, PLACEHOLDER_ATTR, False):
            return mapped
    return original(name, params_dict, *args, **kwargs)


def _hook_model_architecture(
    original: Callable[..., Any], model_config: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``model_loader.utils.get_model_architecture``: architecture resolution sees
    ``compressed-tensors`` (SGLang re-routes Mixtral with an unknown quantization name to
    ``QuantMixtralForCausalLM``, which has no compressed-tensors weight handling)."""
    if getattr(model_config, "quantization", None) != QUANTIZATION_METHOD:
        return original(model_config, *args, **kwargs)
    model_config.quantization = "compressed-tensors"
    try:
        return original(model_config, *args, **kwargs)
    finally:
        model_config.quantization = QUANTIZATION_METHOD


def _hook_update_weights_from_disk(
    original: Callable[..., Any], updater: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``WeightUpdater.update_weights_from_disk``: a reload kvscale refused answers
    ``(False, message)`` once SGLang has finished it (the layers kept their scales).
    SGLang answers "Succeeded to update model weights." whatever a quant method found, and
    has no hook after a weight update (``loadcycle.decide`` keeps the scales)."""
    get_model = getattr(updater, "get_model", None)
    cfg = getattr(get_model() if callable(get_model) else None, "quant_config", None)
    if not isinstance(cfg, KVScaleConfig):
        return original(updater, *args, **kwargs)
    cfg.cycle.caller_reports = True
    live.state(cfg).label = "update_weights_from_disk"
    try:
        result = original(updater, *args, **kwargs)
    finally:
        cfg.cycle.caller_reports = False
        live.state(cfg).label = None
    refused = report_verdict(cfg)
    if refused and isinstance(result, tuple) and result and result[0]:
        return False, refused
    return result


def _hook_scheduler_sync(
    original: Callable[..., Any], manager: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND ``SchedulerWeightUpdaterManager``'s sync entry points: on an FP8 pool, a
    sync that changed the scales in force flushes the radix cache when SGLang did not
    (``flush_cache=False``; ``end_weight_update``, where a session's scales are served,
    flushes nothing), so no KV is read under other scales than it was written with."""
    found = live.manager_config(manager)
    if found is None or not found[1]:
        return original(manager, *args, **kwargs)
    cfg = found[0]
    before = live.scale_epoch(cfg)
    output = original(manager, *args, **kwargs)
    recv_req = args[0] if args else kwargs.get("recv_req")
    return live.after_sync(manager, recv_req, before, cfg, output)


def _hook_internal_state(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER ``Scheduler.get_internal_state``: the answer (``Engine.get_server_info()``'s
    ``internal_states``) carries kvscale's fingerprint and update counter under
    ``"kvscale"`` (SGLang 0.5.23's ``collective_rpc`` returns no value; this is the one
    request that returns a scheduler's state as a dict)."""
    runner = getattr(getattr(scheduler, "tp_worker", None), "model_runner", None)
    cfg = getattr(getattr(runner, "model", None), "quant_config", None)
    state_dict = getattr(result, "internal_state", None)
    if isinstance(cfg, KVScaleConfig) and isinstance(state_dict, dict):
        try:
            state_dict["kvscale"] = live.server_info(cfg)
        except Exception as exc:  # noqa: BLE001 - never break the request
            state_dict["kvscale"] = {"error": f"{type(exc).__name__}: {exc}"}
    return result


#: The scheduler's weight-sync entry points (``SchedulerWeightUpdaterManager``).
SCHEDULER_SYNCS = (
    "update_weights_from_disk",
    "update_weights_from_tensor",
    "update_weights_from_distributed",
    "update_weights_from_ipc",
    "end_weight_update",
)

# Attention modules of SGLang 0.5.23 that build RadixAttention without quant_config,
# so compressed-tensors KV scales are silently dropped for them.
ATTENTION_WITHOUT_QUANT_CONFIG = (
    "sglang.srt.models.qwen3.Qwen3Attention",
    "sglang.srt.models.qwen3_moe.Qwen3MoeAttention",
    # GLM-4-MoE's stack and its NextN (MTP) draft, Glm4MoeForCausalLMNextN.
    "sglang.srt.models.glm4_moe.Glm4MoeAttention",
)


@functools.cache
def _init_signature(class_path: str) -> inspect.Signature:
    # signature() follows HookRegistry's __wrapped__ to the original __init__.
    return inspect.signature(pkgutil.resolve_name(class_path).__init__)


def _attach_kv_method_hook(class_path: str) -> Callable[..., None]:
    def attach_kv_method(_result: None, module: torch.nn.Module, *args: Any, **kwargs: Any):
        """AFTER ``<attention>.__init__``: give its RadixAttention our KV method."""
        try:
            bound = _init_signature(class_path).bind(module, *args, **kwargs)
        except TypeError:
            return None
        quant_config = bound.arguments.get("quant_config")
        attn = getattr(module, "attn", None)
        if not isinstance(quant_config, KVScaleConfig) or not isinstance(attn, RadixAttention):
            return None
        if attn.quant_method is not None:
            return None  # a later SGLang passes quant_config itself
        prefix = bound.arguments.get("prefix") or ""
        method = quant_config.get_quant_method(attn, prefix=f"{prefix}.attn" if prefix else "attn")
        if method is None:
            return None
        attn.quant_method = method
        method.create_weights(attn)
        fused = (getattr(module, "_fused_k_scale", None), getattr(module, "_fused_v_scale", None))
        if all(isinstance(t, torch.Tensor) for t in fused):
            # Qwen3's fused qk-norm/rope cache write reads these CPU copies.
            layer_record(attn).mirrors.append(fused)  # type: ignore[union-attr]
        return None

    attach_kv_method.__qualname__ = f"kvscale_attach_kv_method[{class_path}]"
    return attach_kv_method


@dataclass(frozen=True)
class Patch:
    """One ``HookRegistry`` hook on ``module``.``attr`` (``attr`` may be dotted).

    ``params`` are the target's parameters the hook reads: by name, or, when
    ``leading``, positionally as the target's first parameters in that order.
    """

    module: str
    attr: str
    hook: Callable[..., Any]
    kind: HookType
    does: str
    params: tuple[str, ...] = ()
    leading: bool = False

    @property
    def target(self) -> str:
        """The dotted path ``HookRegistry`` is given."""
        return f"{self.module}.{self.attr}"


# One hook object per target, so that "already registered" is an identity check.
_ATTACH_HOOKS = {path: _attach_kv_method_hook(path) for path in ATTENTION_WITHOUT_QUANT_CONFIG}

#: Every patch, in registration order (see the module docstring for the gaps).
PATCHES: tuple[Patch, ...] = (
    Patch(
        "sglang.srt.model_loader.loader",
        "_initialize_model",
        _hook_initialize_model,
        HookType.AFTER,
        "maps checkpoint KV-scale names onto kvscale's placeholders before a model's "
        "load_weights sees them (without it, scales in other naming layouts are not loaded)",
        params=("model_config", "load_config", "quant_config"),
        leading=True,
    ),
    Patch(
        "sglang.srt.model_loader.weight_utils",
        "maybe_remap_kv_scale_name",
        _hook_remap_kv_scale_name,
        HookType.AROUND,
        "passes already-mapped KV-scale names through SGLang's name remapping (without it, "
        "mapped scales are renamed away and not loaded)",
        params=("name", "params_dict"),
        leading=True,
    ),
    Patch(
        "sglang.srt.model_loader.utils",
        "get_model_architecture",
        _hook_model_architecture,
        HookType.AROUND,
        "keeps Mixtral's native model class under --quantization kvscale (without it, "
        "SGLang picks QuantMixtralForCausalLM, which cannot load compressed-tensors weights)",
        params=("model_config",),
        leading=True,
    ),
    *(
        Patch(
            path.rsplit(".", 1)[0],
            f"{path.rsplit('.', 1)[1]}.__init__",
            _ATTACH_HOOKS[path],
            HookType.AFTER,
            f"attaches the kvscale KV method to {path.rsplit('.', 1)[1]}'s RadixAttention, "
            "which SGLang builds without quant_config (without it, that model's KV scales "
            "are dropped)",
            params=("quant_config", "prefix"),
        )
        for path in ATTENTION_WITHOUT_QUANT_CONFIG
    ),
    Patch(
        "sglang.srt.model_executor.model_runner_components.weight_updater",
        "WeightUpdater.update_weights_from_disk",
        _hook_update_weights_from_disk,
        HookType.AROUND,
        "answers a weight update from disk whose KV scales kvscale refused with failure "
        "and the bad tensors (without it, SGLang reports success and the refusal is only "
        "logged)",
        params=("model_path", "load_format"),
        leading=True,
    ),
    *(
        Patch(
            "sglang.srt.managers.scheduler_components.weight_updater",
            f"SchedulerWeightUpdaterManager.{method}",
            _hook_scheduler_sync,
            HookType.AROUND,
            f"flushes the radix cache after {method} when it changed the KV scales an FP8 "
            "cache is written with and SGLang did not flush it (without it, KV cached under "
            "the old scales is read under the new ones)",
            params=("recv_req",),
            leading=True,
        )
        for method in SCHEDULER_SYNCS
    ),
    Patch(
        "sglang.srt.managers.scheduler",
        "Scheduler.get_internal_state",
        _hook_internal_state,
        HookType.AFTER,
        "returns kvscale's scale fingerprint and update counter in get_server_info's "
        "internal_states (without it, they are only logged)",
        params=("recv_req",),
        leading=True,
    ),
)


def target_problem(patch: Patch) -> str | None:
    """Why ``patch`` cannot be applied as written on the installed SGLang, or None."""
    try:
        obj = resolve_attribute(patch.module, patch.attr)
    except Exception as exc:  # any failure to import or resolve: the target moved
        return f"{type(exc).__name__}: {exc}"
    if not callable(obj):
        return f"it is no longer a function (found {type(obj).__name__})"
    if not patch.params:
        return None
    try:
        names = parameter_names(obj)
    except (TypeError, ValueError) as exc:
        return f"its signature cannot be read ({exc})"
    if names is None:
        return None  # takes anything positionally
    if patch.leading:
        ok = names[: len(patch.params)] == list(patch.params)
    else:
        ok = set(patch.params) <= set(names)
    if ok:
        return None
    expected = ", ".join(patch.params)
    return (
        f"its parameters changed: the patch reads ({expected})"
        f"{' as its first parameters' if patch.leading else ''}, SGLang has ({', '.join(names)})"
    )


def _installed_sglang() -> str:
    try:
        import sglang

        return str(getattr(sglang, "__version__", "unknown"))
    except ImportError:
        return "unknown"


def moved_targets_error(problems: Iterable[tuple[Patch, str]]) -> RuntimeError:
    """The error for patches whose target moved: each target, what it does, what to do."""
    found = _installed_sglang()
    lines = [
        f"kvscale: cannot patch SGLang {found}: what kvscale's patches for SGLang "
        f"{WRITTEN_AGAINST} hook into has moved, so --quantization kvscale is not registered."
    ]
    for patch, problem in problems:
        lines.append(f"  - {patch.target}: {problem}. This patch {patch.does}.")
    lines.append(
        "SGLang's HookRegistry would only log this and serve with stock behaviour "
        f"(KV scales dropped or unmapped). Install a tested SGLang "
        f"({', '.join(SGLANG_RUN)}), "
        f"or a kvscale-plugin release for SGLang {found}."
    )
    return RuntimeError("\n".join(lines))


def check_targets(patches: Iterable[Patch] | None = None) -> None:
    """Raise ``RuntimeError`` (``moved_targets_error``) unless every patch's target
    resolves on the installed SGLang with the parameters its hook reads."""
    problems = [
        (patch, problem)
        for patch in (PATCHES if patches is None else patches)
        if (problem := target_problem(patch)) is not None
    ]
    if problems:
        raise moved_targets_error(problems)


def register_hooks() -> None:
    """Check every target (``check_targets``), then register each patch exactly once.

    SGLang 0.5.23's ``HookRegistry.apply_hooks`` skips a target it patched before: a hook
    registered on a target another plugin's hooks were applied to (``load_plugins`` applies
    them before kvscale's go in, when a model claims kvscale) would never run, without a
    word. Those are applied here, on top of what is there."""
    check_targets()
    late = []
    for patch in PATCHES:
        if any(h is patch.hook for _, h, _ in HookRegistry._hooks.get(patch.target, ())):
            continue
        if patch.target in HookRegistry._patched:
            late.append(patch)
        HookRegistry.register(patch.target, patch.hook, patch.kind)
    if _current_plugin_source.get() is None:
        # Called outside load_plugins() (which applies hooks itself once every plugin
        # ran): apply now so that a direct register() call takes effect.
        HookRegistry.apply_hooks()
    for patch in late:
        apply_target = getattr(HookRegistry, "_apply_target", None)
        if apply_target is None:
            warn_once(
                f"sglang-late-hook-{patch.target}",
                "kvscale: another SGLang plugin patched %s first, and this SGLang cannot "
                "add kvscale's hook there: it %s is not in effect.",
                patch.target,
                patch.does.split(" (without it", 1)[0],
            )
            continue
        apply_target(patch.target, [(patch.kind, patch.hook, None)])
