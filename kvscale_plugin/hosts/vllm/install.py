"""Registration in every vLLM process (``hosts.vllm.register``): check the core's
targets without a word and register ``--quantization kvscale`` through vLLM's quantization
registry -- or, where the core cannot work, a method that refuses to start naming why.
Nothing else: a stock engine runs vLLM's own code and logs nothing from kvscale. What a
kvscale engine adds is in ``activation``.
"""

from __future__ import annotations

from typing import Any

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm import internals
from kvscale_plugin.hosts.vllm.internals import host_version
from kvscale_plugin.hosts.vllm.process import HOST

__all__ = ["host_version", "register_method", "register_unavailable", "unavailable_message"]


def _scales() -> None:
    """Register ``KVScaleConfig`` as ``--quantization kvscale``."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from kvscale_plugin.hosts.vllm.method import KVScaleConfig

    register_quantization_config(QUANTIZATION_METHOD)(KVScaleConfig)


def register_method() -> None:
    """Every vLLM process: register ``--quantization kvscale`` (or, where the core cannot
    work, a method that refuses to start naming why). Logs nothing, patches nothing."""
    if "scales" in HOST.installed:
        return
    report = internals.check([i for i in internals.INTERNALS if i.feature == "scales"])
    if not report.available("scales"):
        register_unavailable(host_version(), "; ".join(report.problems["scales"]))
        return
    with internals.transaction():
        _scales()
    HOST.installed.add("scales")


def unavailable_message(version: str, why: str) -> str:
    return (
        f"kvscale: --quantization kvscale cannot work on vLLM {version}: {why}. "
        f"kvscale-plugin supports vLLM {internals.SUPPORTED_RANGE}: install one of those "
        "(or a kvscale-plugin release for this vLLM), or start without --quantization kvscale."
    )


def register_unavailable(version: str, why: str) -> None:
    """``kvscale`` as a method that refuses to start, saying why; every other engine is
    untouched (its ``override_quantization_method`` claims nothing)."""
    from vllm.model_executor.layers.quantization import register_quantization_config
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

    message = unavailable_message(version, why)

    def refuse() -> None:
        # Said only where kvscale was asked for: a stock engine hears nothing of it.
        warn_once(
            "vllm-scales-unavailable",
            "kvscale: vLLM %s lacks what --quantization kvscale needs (%s); kvscale stays "
            "out of the way: engines without --quantization kvscale start as if it were "
            "not installed.",
            version,
            why,
        )

    class KVScaleUnavailableConfig(QuantizationConfig):  # type: ignore[misc]
        """``--quantization kvscale`` on a vLLM kvscale cannot serve: refused at start."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            refuse()
            raise RuntimeError(message)

        @classmethod
        def get_name(cls) -> str:
            return QUANTIZATION_METHOD

        @classmethod
        def get_supported_act_dtypes(cls) -> list[Any]:
            import torch

            return [torch.bfloat16, torch.float16, torch.float32]

        @classmethod
        def get_min_capability(cls) -> int:
            return 0

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict[str, Any]) -> Any:
            raise RuntimeError(message)

        @classmethod
        def override_quantization_method(
            cls, hf_quant_cfg: Any, user_quant: str | None, hf_config: Any = None
        ) -> str | None:
            if user_quant == QUANTIZATION_METHOD:
                refuse()
                raise ValueError(message)
            return None

        def get_quant_method(self, layer: Any, prefix: str) -> Any:
            raise RuntimeError(message)

    register_quantization_config(QUANTIZATION_METHOD)(KVScaleUnavailableConfig)
