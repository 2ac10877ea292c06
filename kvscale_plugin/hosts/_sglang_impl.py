"""SGLang classes and hooks for ``--quantization kvscale`` (imported only by
``hosts.sglang.register``).

Thin translation from SGLang's quantization API to the host-independent core:
``scheme.judge_kv_cache_scheme`` decides, ``names.map_scale_name`` maps,
``scales.resolve_kv_scales`` resolves. Nothing here decides policy.

What SGLang 0.5.23 gets from here, beyond its own compressed-tensors support:

* ``KVScaleConfig``: SGLang's ``CompressedTensorsConfig`` (linear / MoE weight
  schemes unchanged) whose ``RadixAttention`` layers get ``KVScaleKVCacheMethod``.
* Name mapping (``HookRegistry``): checkpoint scale names are mapped through the
  pluggy hook before a model's ``load_weights`` sees them, and
  ``maybe_remap_kv_scale_name`` (where SGLang's loaders look scale names up)
  passes mapped names through instead of appending a second ``.attn``.
* Attention modules that build ``RadixAttention`` without ``quant_config``
  (dense Qwen3, Qwen3-MoE) get the KV method attached after ``__init__``.
* Mixtral keeps its native model class under ``--quantization kvscale`` (SGLang
  routes Mixtral with an unknown quantization name to ``QuantMixtralForCausalLM``).
* Per-head scales (``strategy: attn_head``, ``[num_kv_heads, 1, 1]`` per layer):
  SGLang 0.5.23 has no per-head KV scale path (``BaseKVCacheMethod`` makes a scalar
  ``k_scale`` and refuses non-scalar values; its compressed-tensors config ignores
  ``attn_head``; cache writes and attention backends take one scale per layer). kvscale
  validates every head, keeps this TP rank's heads (``layer.kvscale_k_heads`` /
  ``kvscale_v_heads``) and serves each layer with the max over them, so nothing clips.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import pkgutil
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from sglang.kernels.ops.quantization.fp8_kernel import is_fp8_fnuz
from sglang.srt.layers import quantization as sgl_quantization
from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
    CompressedTensorsConfig,
)
from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.plugins.hook_registry import HookRegistry, HookType, _current_plugin_source

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts._common import (
    announce_verdict,
    check_zero_point,
    claims_checkpoint,
    no_checkpoint_config_error,
    warn_missing_scales,
    warn_unmapped_scales,
)
from kvscale_plugin.names import map_scale_name, names_attention_layer
from kvscale_plugin.scales import (
    SENTINEL,
    CorruptScaleError,
    ResolvedScales,
    ScaleSource,
    format_corrupt_scales,
    resolve_kv_scales,
    scale_problems,
    unscaled,
)
from kvscale_plugin.scheme import SchemeVerdict

HOST = "sglang"
_SCALE_NAMES = ("k_scale", "v_scale")
_ZERO_POINT_NAMES = ("q_zero_point", "k_zero_point", "v_zero_point")
#: Attribute set on every parameter this method creates (loaders and hooks key on it).
PLACEHOLDER_ATTR = "kvscale_placeholder"

# The kvscale config of the model whose load_weights is running (gives the name
# hooks the checkpoint's model_type; None outside a kvscale model's load).
_ACTIVE_CONFIG: contextvars.ContextVar[KVScaleConfig | None] = contextvars.ContextVar(
    "kvscale_active_config", default=None
)


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
        # Checkpoint tensors whose loaded value cannot be served: name -> why.
        self.corrupt_scales: dict[str, str] = {}
        # How many times the model's load_weights ran (0 after a dummy load).
        self.weight_loads = 0
        self._layer_states: weakref.WeakValueDictionary[str, _LayerState] = (
            weakref.WeakValueDictionary()
        )

    @property
    def kv_cache_quant_algo(self) -> str | None:  # type: ignore[override]
        # Read by SGLang's configure_kv_cache_dtype: "FP8" turns auto into fp8_e4m3.
        return "FP8" if self.kv_verdict.supported else None

    @classmethod
    def override_quantization_method(
        cls, hf_quant_cfg: dict[str, Any], user_quant: str | None
    ) -> str | None:
        return claims_checkpoint(hf_quant_cfg, user_quant)

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> Any:
        if isinstance(layer, RadixAttention):
            if not self.kv_verdict.declared:
                return None  # no scheme: no scale parameters, exactly as without the plugin
            return KVScaleKVCacheMethod(self, prefix or f"layer_{layer.layer_id}.attn")
        return super().get_quant_method(layer, prefix)


@dataclass(frozen=True)
class HeadPlacement:
    """Where this rank's KV heads sit among the model's ``total`` KV heads (attn_head).

    ``heads`` are the indices of the checkpoint's per-head scales this rank serves, or
    ``None`` with ``problem`` saying why they cannot be placed.
    """

    total: int
    heads: tuple[int, ...] | None
    problem: str | None = None


def rank_kv_heads(total_kv_heads: int, tp_rank: int, tp_size: int) -> tuple[int, ...]:
    """The KV heads one attention TP rank holds (SGLang's and vLLM's rule): partitioned
    when ``total_kv_heads >= tp_size``, else each head replicated on
    ``tp_size // total_kv_heads`` consecutive ranks."""
    if total_kv_heads <= 0 or tp_size <= 0 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"bad layout: {total_kv_heads} KV heads, rank {tp_rank} of {tp_size}")
    if total_kv_heads >= tp_size:
        per_rank = total_kv_heads // tp_size
        return tuple(range(tp_rank * per_rank, (tp_rank + 1) * per_rank))
    return (tp_rank // (tp_size // total_kv_heads),)


def place_kv_heads(
    total_kv_heads: int, rank_kv_heads_count: int, layouts: Iterable[tuple[int, int]]
) -> HeadPlacement:
    """This rank's heads under the first ``(tp_rank, tp_size)`` layout that gives the
    attention layer its ``rank_kv_heads_count`` heads (SGLang models split heads over
    the attention TP group or the full TP group, depending on the model)."""
    tried = []
    for rank, size in layouts:
        try:
            heads = rank_kv_heads(total_kv_heads, rank, size)
        except ValueError:
            continue
        if len(heads) == rank_kv_heads_count:
            return HeadPlacement(total_kv_heads, heads)
        tried.append(f"rank {rank} of {size}")
    return HeadPlacement(
        total_kv_heads,
        None,
        f"cannot place {total_kv_heads} per-head scales onto this layer's "
        f"{rank_kv_heads_count} KV head(s) on this rank ({', '.join(tried) or 'no TP layout'})",
    )


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


def _tp_layouts() -> list[tuple[int, int]]:
    """(rank, size) of the attention TP group, then of the TP group."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        layouts = []
        for rank_attr, size_attr in (("attn_tp_rank", "attn_tp_size"), ("tp_rank", "tp_size")):
            try:
                rank, size = int(getattr(parallel, rank_attr)), int(getattr(parallel, size_attr))
            except (AttributeError, RuntimeError, ValueError, TypeError):
                continue
            layouts.append((rank, size))
        return layouts or [(0, 1)]
    except ImportError:
        return [(0, 1)]


def _head_placement(cfg: KVScaleConfig, layer: torch.nn.Module) -> HeadPlacement | None:
    """None for per-tensor schemes; else which checkpoint heads this layer serves here."""
    if not cfg.kv_verdict.per_head:
        return None
    per_rank = getattr(layer, "tp_k_head_num", None)
    layouts = _tp_layouts()
    total = _total_kv_heads(cfg.hf_config)
    if total is None:
        # No HF config: the partitioned layout (exact whenever total >= tp size).
        total = int(per_rank or 1) * max(size for _, size in layouts)
    if not isinstance(per_rank, int) or per_rank <= 0:
        return HeadPlacement(total, tuple(range(total)))
    return place_kv_heads(total, per_rank, layouts)


@dataclass(eq=False)
class _LayerState:
    """What one attention layer's scales came from, across loads and reloads."""

    name: str
    # attn_head schemes: where this rank's heads sit in the checkpoint's per-head scales.
    placement: HeadPlacement | None = None
    # Scales written by the checkpoint in the current load cycle (name -> value; a
    # tuple of this rank's heads for per-head schemes).
    pending: dict[str, float | tuple[float, ...]] = field(default_factory=dict)
    # The last checkpoint values, re-resolved when a reload carries no scales.
    raw: dict[str, float | tuple[float, ...]] | None = None
    # Host-side copies kept equal to the served scales (e.g. Qwen3's fused CPU scales).
    mirrors: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


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
        state = _LayerState(self.layer_name, placement=_head_placement(cfg, layer))
        layer.kvscale_state = state
        cfg._layer_states[self.layer_name] = state
        for name in _SCALE_NAMES:
            # float32 explicitly: SGLang builds layers under the model's default
            # dtype (bf16), which would round a calibrated 3.8649 to 3.8594.
            param = torch.nn.Parameter(
                torch.tensor(SENTINEL, dtype=torch.float32), requires_grad=False
            )
            param.weight_loader = _scale_loader(
                state, cfg.corrupt_scales, f"{self.layer_name}.{name}", name
            )
            # One number per layer even for per-head schemes: SGLang's cache writes
            # divide by it and its backends broadcast it (see the module docstring).
            param._skip_weight_check = True  # SGLang's weight checker: not a model weight
            setattr(param, PLACEHOLDER_ATTR, True)
            setattr(layer, name, param)
        for name in _ZERO_POINT_NAMES:
            # Accepted so that loaders do not trip over them, then dropped (symmetric only).
            param = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
            param.weight_loader = _zero_point_loader(f"{self.layer_name}.{name}")
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
        state: _LayerState | None = getattr(layer, "kvscale_state", None)
        if state is None:
            return
        state.pending.clear()
        for name in _SCALE_NAMES:
            _forget_problems(self.quant_config.corrupt_scales, f"{state.name}.{name}")

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        state: _LayerState | None = getattr(layer, "kvscale_state", None)
        if state is None:
            return
        cfg = self.quant_config
        if state.pending:
            loaded = dict(state.pending)
            state.pending.clear()
            state.raw = loaded
        else:
            # A reload that carried no scales (partial update) keeps the last ones.
            loaded = dict(state.raw or {})

        applies = cfg.kv_verdict.supported and _cache_may_be_fp8()
        if applies and cfg.corrupt_scales:
            raise CorruptScaleError(format_corrupt_scales(cfg.corrupt_scales))
        if applies:
            resolved = resolve_kv_scales(
                loaded.get("k_scale"), loaded.get("v_scale"), fnuz=is_fp8_fnuz()
            )
            # No load through load_weights yet (dummy load, e.g. for RL: the real
            # weights come with a later reload): no checkpoint to miss scales from.
            if resolved.source is ScaleSource.DEFAULT and cfg.weight_loads > 0:
                _warn_missing_scales(cfg)
            if resolved.per_head:
                _announce_per_layer_max()
        else:
            resolved = unscaled()

        _write_scales(layer, state, resolved)
        layer.kvscale_source = resolved.source.value


def _announce_per_layer_max() -> None:
    warn_once(
        "sglang-per-head-max",
        "kvscale: the checkpoint has per-head KV scales (attn_head), but SGLang 0.5.23 "
        "takes one k/v scale per attention layer (its cache writes and attention backends "
        "have no per-head path); each layer is served in FP8 with the max of its heads' "
        "scales, so no head clips (heads with smaller scales get coarser FP8 steps). The "
        "per-head values are kept in each RadixAttention's kvscale_k_heads/kvscale_v_heads.",
    )


def _write_scales(layer: torch.nn.Module, state: _LayerState, resolved: ResolvedScales) -> None:
    """Update the served tensors in place (backends and CUDA graphs hold them), then copies."""
    k, v = resolved.k, resolved.v
    with torch.no_grad():
        layer.k_scale.data.fill_(k)
        layer.v_scale.data.fill_(v)
        for k_copy, v_copy in state.mirrors:
            k_copy.fill_(k)
            v_copy.fill_(v)
    layer.k_scale_float = k
    layer.v_scale_float = v
    layer.kvscale_k_heads = resolved.k_heads
    layer.kvscale_v_heads = resolved.v_heads


def _forget_problems(corrupt: dict[str, str], tensor_name: str) -> None:
    """Drop what an earlier load said about ``tensor_name`` (and each of its heads)."""
    for key in [k for k in corrupt if k == tensor_name or k.startswith(f"{tensor_name}[")]:
        del corrupt[key]


def _scale_loader(
    state: _LayerState, corrupt: dict[str, str], tensor_name: str, kind: str
) -> Callable[..., None]:
    def load_kv_scale(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        placement = state.placement
        _forget_problems(corrupt, tensor_name)
        # Every element of the full tensor (all heads, not only this rank's) is checked.
        problems = scale_problems(
            tensor_name, loaded_weight, num_heads=None if placement is None else placement.total
        )
        if not problems and placement is not None and placement.heads is None:
            problems = {tensor_name: str(placement.problem)}
        if problems:
            corrupt.update(problems)  # reported, with every other bad tensor, after loading
            return
        values = loaded_weight.detach().float().reshape(-1).tolist()
        value: float | tuple[float, ...]
        if placement is None:
            value = float(values[0])
            served = value
        else:
            value = tuple(float(values[h]) for h in placement.heads or ())
            served = max(value)
        state.pending[kind] = value
        with torch.no_grad():
            param.data.fill_(served)

    return load_kv_scale


def _zero_point_loader(tensor_name: str) -> Callable[..., None]:
    def load_kv_zero_point(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        check_zero_point(tensor_name, loaded_weight)

    return load_kv_zero_point


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
    """False when the user explicitly asked for a non-FP8 KV cache (it wins over the scheme)."""
    requested = _requested_kv_cache_dtype()
    return requested is None or requested == "auto" or requested.startswith("fp8")


def _warn_missing_scales(cfg: KVScaleConfig) -> None:
    warn_missing_scales(
        name for name, state in cfg._layer_states.items() if not state.pending and not state.raw
    )


# --- name mapping -------------------------------------------------------------------


def _map_weight_names(
    weights: Iterable[tuple[str, torch.Tensor]], targets: set[str], model_type: str | None,
    unmapped: set[str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename checkpoint KV-scale tensors to this model's placeholders, lazily."""
    if not targets:  # no KV scheme: nothing to map onto, names stay as they are
        yield from weights
        return
    for name, tensor in weights:
        # Every name is asked (third-party rules may map names without "scale" in them),
        # but only a placeholder this model owns is mapped onto: other names (e.g.
        # another PP rank's layers) stay as they are, for the model's loader to decide.
        mapped = map_scale_name(name, HOST, model_type)
        if mapped is not None and mapped != name and mapped in targets:
            name = mapped
        elif (
            mapped is not None
            and unmapped is not None
            and mapped not in targets
            and not names_attention_layer(mapped, _placeholder_layers(targets))
        ):
            unmapped.add(name)  # SGLang's loader skips it: say so, once, after the load
        yield name, tensor


def _placeholder_layers(targets: set[str]) -> set[str]:
    return {t.rsplit(".", 1)[0] for t in targets}


def _install_name_mapping(model: torch.nn.Module, cfg: KVScaleConfig) -> None:
    """Wrap this model instance's ``load_weights``: every load path (startup,
    update_weights_from_disk / _tensor / _distributed) goes through it."""
    original = model.load_weights
    if getattr(original, "_kvscale_wrapped", False):
        return
    model_ref = weakref.ref(model)

    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any):
        owner = model_ref()
        targets = (
            {n for n, p in owner.named_parameters() if getattr(p, PLACEHOLDER_ATTR, False)}
            if owner is not None
            else set()
        )
        cfg.weight_loads += 1
        token = _ACTIVE_CONFIG.set(cfg)
        try:
            unmapped: set[str] = set()
            result = original(
                _map_weight_names(weights, targets, cfg.model_type, unmapped), *args, **kwargs
            )
            if unmapped:
                warn_unmapped_scales(unmapped)
            return result
        finally:
            _ACTIVE_CONFIG.reset(token)

    load_weights._kvscale_wrapped = True  # type: ignore[attr-defined]
    model.load_weights = load_weights


def _hook_initialize_model(model: torch.nn.Module, *args: Any, **kwargs: Any) -> None:
    """AFTER ``model_loader.loader._initialize_model``: set up kvscale models only."""
    quant_config = args[2] if len(args) > 2 else kwargs.get("quant_config")
    if quant_config is None:
        quant_config = getattr(model, "quant_config", None)
    if isinstance(quant_config, KVScaleConfig) and hasattr(model, "load_weights"):
        if quant_config.model_type is None:
            quant_config.model_type = getattr(getattr(model, "config", None), "model_type", None)
        _install_name_mapping(model, quant_config)
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


def _hook_model_architecture(original: Callable[..., Any], model_config: Any, *args: Any,
                             **kwargs: Any) -> Any:
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


# Attention modules of SGLang 0.5.23 that build RadixAttention without quant_config,
# so compressed-tensors KV scales are silently dropped for them.
ATTENTION_WITHOUT_QUANT_CONFIG = (
    "sglang.srt.models.qwen3.Qwen3Attention",
    "sglang.srt.models.qwen3_moe.Qwen3MoeAttention",
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
            attn.kvscale_state.mirrors.append(fused)  # type: ignore[union-attr]
        return None

    attach_kv_method.__qualname__ = f"kvscale_attach_kv_method[{class_path}]"
    return attach_kv_method


def _hooks() -> list[tuple[str, Callable[..., Any], HookType]]:
    hooks: list[tuple[str, Callable[..., Any], HookType]] = [
        ("sglang.srt.model_loader.loader._initialize_model", _hook_initialize_model,
         HookType.AFTER),
        ("sglang.srt.model_loader.weight_utils.maybe_remap_kv_scale_name",
         _hook_remap_kv_scale_name, HookType.AROUND),
        ("sglang.srt.model_loader.utils.get_model_architecture", _hook_model_architecture,
         HookType.AROUND),
    ]
    hooks += [
        (f"{path}.__init__", _ATTACH_HOOKS[path], HookType.AFTER)
        for path in ATTENTION_WITHOUT_QUANT_CONFIG
    ]
    return hooks


# One hook object per target, so that "already registered" is an identity check.
_ATTACH_HOOKS = {path: _attach_kv_method_hook(path) for path in ATTENTION_WITHOUT_QUANT_CONFIG}


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


def register_hooks() -> None:
    """Register the HookRegistry hooks (each exactly once)."""
    for target, hook, kind in _hooks():
        if any(h is hook for _, h, _ in HookRegistry._hooks.get(target, ())):
            continue
        HookRegistry.register(target, hook, kind)
    if _current_plugin_source.get() is None:
        # Called outside load_plugins() (which applies hooks itself once every plugin
        # ran): apply now so that a direct register() call takes effect.
        HookRegistry.apply_hooks()
