"""What both host adapters decide the same way (imports no host engine): which
checkpoints kvscale claims, what a missing quantization config is told, how an untested
host version is reported, and how a host internal kvscale patches is resolved and checked.
What they tell the user about a load cycle is worded once in ``kvscale_plugin.notices``;
the scale loaders are the load cycle's (``loadcycle``).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Collection
from types import ModuleType
from typing import Any

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once


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
