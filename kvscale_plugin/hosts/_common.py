"""What both host adapters say and decide the same way (imports no host engine).

The adapters translate a host's API; the messages a user sees and the small
decisions around them (which checkpoints we claim, how an unsupported scheme is
announced, how an untested host version is reported) live here once.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Collection, Iterable
from types import ModuleType
from typing import Any

import torch

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import logger, shorten, warn_once
from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.loadcycle import (
    LayerRecord,
    read_scale,
    reload_without_scales_message,
    unused_corrupt_message,
)
from kvscale_plugin.scales import CorruptScales
from kvscale_plugin.scheme import SchemeVerdict, judge_kv_cache_scheme


def base_version(version: str) -> str:
    """``0.32.0+cpu`` -> ``0.32.0``."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).base_version
    except InvalidVersion:
        return version


def import_adapter(host: str, found: str, tested: Collection[str], module: str) -> ModuleType:
    """Import a host adapter's implementation module, or fail saying which host version
    is in use; warn once when that version is not one the adapter was tested with."""
    if found not in tested:
        warn_once(
            f"{host}-version",
            "kvscale: %s %s is not a version this plugin was tested with (%s); it relies "
            "on %s internals that change between releases. If start-up fails, install a "
            "tested %s or a kvscale-plugin release for your %s.",
            host,
            found,
            ", ".join(tested),
            host,
            host,
            host,
        )
    try:
        return importlib.import_module(module)
    except (ImportError, AttributeError) as exc:
        raise RuntimeError(
            f"kvscale: cannot hook into {host} {found} (tested: {', '.join(tested)}): "
            f"{type(exc).__name__}: {exc}. Install a tested {host} version, or uninstall "
            "kvscale-plugin."
        ) from exc


def resolve_attribute(module: str, attr: str) -> Any:
    """Import ``module`` and follow ``attr`` (dotted; empty: the module itself), as a patch
    of that host internal will. A class's attribute is read from the ``__dict__`` of the
    class that defines it (a method stays its function, a staticmethod its descriptor).
    Raises what importing raises, or ``AttributeError`` naming the path that lacks it."""
    obj: Any = importlib.import_module(module)
    path = module
    for name in filter(None, attr.split(".")):
        owner = next((k for k in getattr(obj, "__mro__", ()) if name in k.__dict__), None)
        if owner is not None:
            obj = owner.__dict__[name]
        elif hasattr(obj, name):
            obj = getattr(obj, name)
        else:
            raise AttributeError(f"'{path}' has no attribute '{name}'")
        path = f"{path}.{name}"
    return obj


def parameter_names(obj: Any) -> list[str] | None:
    """A host function's parameter names, ``self`` / ``cls`` left out; None when it takes
    anything positionally (``*args``). Raises ``TypeError`` / ``ValueError`` when its
    signature cannot be read."""
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    params = inspect.signature(func).parameters
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return None
    return [p for p in params if p not in ("self", "cls")]


def no_checkpoint_config_error(host: str) -> ValueError:
    """Hosts build the config with no arguments when config.json has no quantization_config."""
    return ValueError(
        "kvscale: --quantization kvscale needs a compressed-tensors checkpoint, but this "
        "model's config.json has no 'quantization_config' (or 'compression_config'). "
        f"Drop --quantization kvscale for an unquantized model, or point {host} at a "
        "checkpoint exported by llm-compressor with a kv_cache_scheme."
    )


def claims_checkpoint(hf_quant_cfg: dict[str, Any], user_quant: str | None) -> str | None:
    """``override_quantization_method``: ours when asked for and the checkpoint is
    compressed-tensors; otherwise the host decides as if we were not installed."""
    if user_quant == QUANTIZATION_METHOD and (
        hf_quant_cfg.get("quant_method") == "compressed-tensors"
    ):
        return QUANTIZATION_METHOD
    return None


def announce_verdict(scheme: Any, scope: str = "") -> SchemeVerdict:
    """Judge a checkpoint's ``kv_cache_scheme`` and tell the user once what it means.

    ``scope`` names the engine (its config) a warning belongs to: "once" is once per
    engine and cause, so a second engine in the same process hears about its own."""
    verdict = judge_kv_cache_scheme(scheme)
    if verdict.declared and not verdict.supported:
        warn_once(
            f"{scope}unsupported-scheme:{verdict.reason}",
            "kvscale: kv_cache_scheme %s is not supported: %s. Serving with an unscaled KV "
            "cache (checkpoint k/v scales are ignored; --kv-cache-dtype auto keeps the "
            "model dtype). To use calibrated scales, export the KV cache with a static "
            "symmetric per-tensor FP8 scheme.",
            dict(scheme) if isinstance(scheme, dict) else scheme,
            verdict.reason,
        )
    elif verdict.supported:
        logger.info("kvscale: kv_cache_scheme %s", verdict.describe())
    return verdict


def warn_missing_scales(layer_names: Iterable[str], scope: str = "") -> None:
    """One warning (per engine: ``scope``) for a declared scheme whose checkpoint has no
    scales for some layers."""
    shown = shorten(layer_names)
    warn_once(
        f"{scope}scales-missing",
        "kvscale: the checkpoint declares a kv_cache_scheme but has no k_scale/v_scale "
        "tensors for %s; those layers use scale 1.0, which clips K/V beyond +-448. "
        "Calibrate the checkpoint's KV cache with llm-compressor, or serve with a bf16 "
        "KV cache (--kv-cache-dtype bfloat16 in vLLM, bf16 in SGLang).",
        shown or "some attention layers",
    )


# Loaders are plain functions (not functools.partial): vLLM's in-place reload wraps them
# and reads their __name__; its replay binds the first argument "param". SGLang passes
# loaders extra positional arguments (shard ids), which they ignore.
def scale_loader(
    record: LayerRecord, kind: str, heads: HeadLayout | None, *, into_param: bool = False
) -> Callable[..., None]:
    """Scale ``kind``'s weight loader, the same for every host: each tensor it is given is
    read by ``loadcycle.read_scale`` (every element checked, this rank's ``heads`` kept); a
    bad one goes to the layer's record of refusals (``corrupt``, ``corrupt_q`` for a q
    scale; reported with every other after loading), a good one to ``record.loaded``. The
    served tensors change only when the cycle is processed. ``into_param``: the value is
    copied into the placeholder too (vLLM's layerwise reload counts the elements a loader
    copies to know that a layer loaded something; SGLang's placeholder is the served
    tensor, which must not change before the cycle is decided)."""
    is_query = kind == "q_scale"
    corrupt = record.corrupt_q if is_query else record.corrupt

    def load_kv_scale(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        name = record.tensor_name(kind)
        corrupt.forget(name)
        values, problems = read_scale(name, loaded_weight, heads, is_query=is_query)
        if values is None:
            corrupt.add(problems)
            return
        record.loaded[kind] = values
        if into_param:
            param.data.copy_(torch.tensor(values, dtype=torch.float32).reshape(param.shape))

    return load_kv_scale


def zero_point_loader(tensor_name: str) -> Callable[..., None]:
    """Zero points are accepted and dropped (symmetric only); a non-zero one is reported."""

    def load_kv_zero_point(param: torch.Tensor, loaded_weight: torch.Tensor, *_: Any) -> None:
        if loaded_weight.numel() and bool((loaded_weight.float() != 0).any()):
            warn_once(
                f"zero-point:{tensor_name}",
                "kvscale: checkpoint tensor '%s' holds a non-zero zero point; KV-cache "
                "quantization is symmetric here, so it is ignored. Re-export the checkpoint "
                "with a symmetric kv_cache_scheme if K/V are off-centre.",
                tensor_name,
            )

    return load_kv_zero_point


def warn_unused_corrupt(corrupt: CorruptScales, scope: str = "") -> None:
    """One warning per engine (``scope``) and set of tensors: corrupt scales that this
    engine's KV cache does not use (``loadcycle.unused_corrupt_message``)."""
    labels = ",".join(sorted(corrupt.as_mapping()))
    warn_once(f"{scope}unused-corrupt:{labels}", "%s", unused_corrupt_message(corrupt))


def warn_reload_without_scales(layer_names: Iterable[str], scope: str = "") -> None:
    """One warning per engine (``scope``): a reload carried no scale for these layers."""
    warn_once(f"{scope}reload-without-scales", "%s", reload_without_scales_message(layer_names))


def warn_unmapped_scales(names: Iterable[str], scope: str = "") -> None:
    """One warning (per engine: ``scope``) listing every checkpoint KV-scale tensor that
    names no attention layer."""
    shown = sorted(names)
    warn_once(
        f"{scope}unmapped-scales",
        "kvscale: %d KV-scale tensor(s) in the checkpoint name no attention layer of this "
        "model and were not loaded: %s. If they belong to layers this model does build, "
        "add a name-mapping rule (entry-point group 'kvscale_plugin', see the README).",
        len(shown),
        ", ".join(shown),
    )
