"""What ``hosts.vllm.register`` does: check the list of internals, then install feature by
feature (each all or nothing), and say once what this vLLM gets.

Imported only inside ``register`` (it imports vLLM lazily too: only the modules of the
features being installed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvscale_plugin import QUANTIZATION_METHOD
from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm import internals


def host_version() -> str:
    """The installed vLLM's release (``0.32.0+cpu`` -> ``0.32.0``), or ``unknown``."""
    from kvscale_plugin.hosts._common import base_version

    try:
        import vllm

        return base_version(str(getattr(vllm, "__version__", "unknown")))
    except Exception:  # noqa: BLE001 - an unreadable version is reported, not fatal
        return "unknown"


def _scales() -> None:
    """Register ``KVScaleConfig`` as ``--quantization kvscale``."""
    from vllm.model_executor.layers.quantization import register_quantization_config

    from kvscale_plugin.hosts.vllm.method import KVScaleConfig

    register_quantization_config(QUANTIZATION_METHOD)(KVScaleConfig)


def _name_parity() -> None:
    from kvscale_plugin.hosts.vllm.parity import install

    install()


def _reload_check() -> None:
    from kvscale_plugin.hosts.vllm.reload import install_reload_check

    install_reload_check()


def _mtp_drafts() -> None:
    from kvscale_plugin.hosts.vllm.mtp import install_draft_routing

    install_draft_routing()


def _cpu_write() -> bool:
    from kvscale_plugin.hosts.vllm.cpu_write import install

    return install()


def _custom_backend() -> bool:
    from kvscale_plugin.hosts.vllm.backend import register_backend

    return register_backend()


def _deployment_check() -> None:
    """Nothing to patch: the KV method runs the check (``deployment.check_deployment``)
    while this feature is installed."""


#: Installers in order; ``scales`` first (the others need its classes). One returning
#: False did not apply here (e.g. the CPU write on a GPU platform): not installed, not lost.
INSTALLERS: dict[str, Callable[[], Any]] = {
    "scales": _scales,
    "name-parity": _name_parity,
    "reload-check": _reload_check,
    "mtp-drafts": _mtp_drafts,
    "cpu-write": _cpu_write,
    "custom-backend": _custom_backend,
    "deployment-check": _deployment_check,
}


def install_all(report: internals.Report | None = None) -> dict[str, str]:
    """Check, then install every feature whose targets hold. Returns feature -> why it is
    lost, for the features that are (empty when all hold)."""
    version = host_version()
    report = internals.check() if report is None else report
    lost: dict[str, str] = {}
    for feature, installer in INSTALLERS.items():
        if feature in internals.installed:
            continue
        if not report.available(feature):
            lost[feature] = "; ".join(report.problems[feature])
            continue
        if feature != "scales" and "scales" not in internals.installed:
            lost[feature] = "needs the 'scales' feature"
            continue
        try:
            with internals.transaction():
                applied = installer()
        except Exception as exc:  # noqa: BLE001 - costs this feature only (rolled back)
            lost[feature] = f"{type(exc).__name__}: {exc}"
            continue
        if applied is not False:
            internals.installed.add(feature)
    if "scales" in lost:
        register_unavailable(version, lost["scales"])
    _announce(version, lost)
    return lost


def _announce(version: str, lost: dict[str, str]) -> None:
    tested = version in internals.RUN_TESTED + internals.STATIC_TESTED
    if not tested:
        held = [f for f in internals.FEATURES if f in internals.installed]
        warn_once(
            f"vllm-version:{version}",
            "kvscale: vLLM %s is not a version kvscale-plugin was tested with (supported: "
            "vLLM %s). Every vLLM internal it touches was checked at start-up: %s hold%s.",
            version,
            internals.SUPPORTED_RANGE,
            ", ".join(held) or "no feature",
            f"; lost: {', '.join(lost)}" if lost else "",
        )
    if "scales" in lost:
        return  # said by register_unavailable, and at the start that asks for it
    for feature, why in lost.items():
        warn_once(
            f"vllm-feature-lost:{feature}",
            "kvscale: on vLLM %s this feature is unavailable: %s. Cause: %s. Everything "
            "else kvscale does is unaffected.",
            version,
            internals.FEATURES[feature],
            why,
        )


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
    warn_once(
        "vllm-scales-unavailable",
        "kvscale: vLLM %s lacks what --quantization kvscale needs (%s); kvscale stays out of "
        "the way: engines without --quantization kvscale start as if it were not installed.",
        version,
        why,
    )

    class KVScaleUnavailableConfig(QuantizationConfig):  # type: ignore[misc]
        """``--quantization kvscale`` on a vLLM kvscale cannot serve: refused at start."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
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
                raise ValueError(message)
            return None

        def get_quant_method(self, layer: Any, prefix: str) -> Any:
            raise RuntimeError(message)

    register_quantization_config(QUANTIZATION_METHOD)(KVScaleUnavailableConfig)
