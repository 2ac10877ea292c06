"""Activation: what a process that builds a ``-q kvscale`` engine adds -- the front end
that claims the checkpoint, each engine-core / worker process that holds the config.
``activate`` checks every feature's targets, installs feature by feature (each all or
nothing, through ``patching``), and says once what this vLLM gets (and, on a release
kvscale was not tested with, that it was not). Imported lazily, by the config.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm import internals
from kvscale_plugin.hosts.vllm.internals import host_version
from kvscale_plugin.hosts.vllm.process import HOST


def installer(feature: str) -> Callable[[], Any] | None:
    """What installs ``feature`` up front (``catalogue.Feature.install``), or None."""
    path = internals.FEATURES[feature].install
    if not path:
        return None
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(f"{__package__}.{module}"), name)


def layer_built() -> None:
    """As kvscale's KV method builds each layer (a worker process by then; idempotent,
    cheap): the reload check's worker entry points, the Gemma-4 assistant drafter following
    its target's layers, and (multi-node engines) every rank serves with kvscale."""
    from kvscale_plugin.hosts.vllm.deployment import check_deployment
    from kvscale_plugin.hosts.vllm.reload import ensure_worker_wrappers
    from kvscale_plugin.hosts.vllm.shared import ensure_assistant_sync

    ensure_worker_wrappers()
    ensure_assistant_sync()
    check_deployment()


def activate(report: internals.Report | None = None) -> dict[str, str]:
    """In a process that builds a ``-q kvscale`` engine: install every feature whose
    targets hold (once per process; idempotent) and say what is lost. Returns feature ->
    why it is lost (empty when all hold). Never raises."""
    with HOST.lock:
        if HOST.lost is not None and report is None:
            return HOST.lost
        try:
            HOST.lost = install_all(report)
        except Exception as exc:  # noqa: BLE001 - never break the engine's start for this
            lost = {f: f"{type(exc).__name__}: {exc}" for f in internals.FEATURES if f != "scales"}
            HOST.lost = lost
            _announce(host_version(), lost)
        return HOST.lost


def install_all(report: internals.Report | None = None) -> dict[str, str]:
    """Check, then install every feature (but the core, registered in every process by
    ``install.register_method``) whose targets hold. Returns feature -> why it is lost,
    for the features that are (empty when all hold)."""
    version = host_version()
    report = internals.check() if report is None else report
    lost: dict[str, str] = {}
    for feature in internals.FEATURES:
        if feature == "scales" or feature in HOST.installed:
            continue
        if not report.available(feature):
            lost[feature] = "; ".join(report.problems[feature])
            continue
        try:
            with internals.transaction():
                install = installer(feature)
                applied = None if install is None else install()
        except Exception as exc:  # noqa: BLE001 - costs this feature only (rolled back)
            lost[feature] = f"{type(exc).__name__}: {exc}"
            continue
        if applied is not False:
            HOST.installed.add(feature)
    if not report.available("scales"):
        lost = {"scales": "; ".join(report.problems["scales"]), **lost}
    _announce(version, lost)
    return lost


def _announce(version: str, lost: dict[str, str]) -> None:
    tested = version in internals.RUN_TESTED + internals.STATIC_TESTED
    if not tested:
        held = [f for f in internals.FEATURES if f in HOST.installed]
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
            internals.FEATURES[feature].what,
            why,
        )
