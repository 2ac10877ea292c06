"""What kvscale changed in the vLLM loaded in this process, counted the way an operator
would: every attribute of every loaded ``vllm`` module, and of every class defined in one,
whose function code lives in ``kvscale_plugin``, plus every entry keyed ``kvscale`` in a
module-level dict of vLLM's. Registrations through vLLM's public registries
(``register_quantization_config``, ``register_backend``) are not counted."""

from __future__ import annotations

import os
import sys
import types
from typing import Any

import kvscale_plugin

QUANTIZATION_METHOD = "kvscale"
#: Code whose file lies here is kvscale's (a wrapper's ``__module__`` may say vLLM's).
_PACKAGE_DIR = os.path.dirname(os.path.abspath(kvscale_plugin.__file__)) + os.sep
#: vLLM's public registries (what ``register_quantization_config`` / ``register_backend``
#: write): registering there is using an extension point, not patching.
PUBLIC_REGISTRIES = frozenset(
    {
        "vllm.model_executor.layers.quantization._CUSTOMIZED_METHOD_TO_QUANT_CONFIG",
        "vllm.v1.attention.backends.registry._ATTN_OVERRIDES",
    }
)


def _is_kvscale_code(value: Any) -> bool:
    # Only functions are looked into: a getattr on an arbitrary module attribute may run
    # code (lazy loaders).
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    elif isinstance(value, property):
        value = value.fget
    if isinstance(value, types.MethodType):
        value = value.__func__
    if not isinstance(value, types.FunctionType):
        return False
    return value.__code__.co_filename.startswith(_PACKAGE_DIR)


def patched_places() -> list[str]:
    """Every place of the loaded vLLM whose code is kvscale's (see the module docstring)."""
    found: set[str] = set()
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "vllm" or name.startswith("vllm.")):
            continue
        for attr, value in list(vars(module).items()):
            if _is_kvscale_code(value):
                found.add(f"{name}.{attr}")
            elif isinstance(value, type) and value.__module__ == name:
                for member, inner in list(vars(value).items()):
                    if _is_kvscale_code(inner):
                        found.add(f"{name}.{value.__name__}.{member}")
            elif (
                isinstance(value, dict)
                and f"{name}.{attr}" not in PUBLIC_REGISTRIES
                and QUANTIZATION_METHOD in [key for key in list(value) if isinstance(key, str)]
            ):
                found.add(f"{name}.{attr}[{QUANTIZATION_METHOD!r}]")
    return sorted(found)


def patched_places_of(_model: Any) -> list[str]:
    """``patched_places`` as an ``LLM.apply_model`` target (run in each worker)."""
    return patched_places()
