"""Checking the vLLM internals the adapter touches (listed in ``catalogue``), and the one
reversible way features change vLLM.

vLLM ships a release a month and moves internals between them. A plugin that imports a
moved name at registration stops *every* vLLM start (``load_general_plugins`` calls each
plugin without a try/except). So the adapter never imports vLLM blindly: every target in
``catalogue.INTERNALS`` is resolved here before its feature goes in.

Every vLLM process checks the core's targets (``scales``, which every other feature needs)
silently as it registers; a process that builds a ``-q kvscale`` engine checks every
feature's (``activation.activate``): live (imported, resolved, signatures and call sites
read), except ``lazy`` ones, whose modules are heavy or platform-specific and are
imported by vLLM later (the worker, the Triton backend): those are checked where they are
used, and statically against every supported release's sources by the test suite
(``make check-vllm VERSION=...`` does it for any release).

Installers change vLLM only through ``replace`` / ``replace_item`` inside
``transaction``: a feature whose installation fails half way is rolled back, so a retry in
the same process (a notebook cell run twice) behaves like the first attempt. ``PATCHED``
lists every place a kvscale engine replaces. Imports no vLLM at import time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvscale_plugin.hosts._common import base_version, parameter_names, resolve_attribute
from kvscale_plugin.hosts.vllm.callsites import calls_problem, live_calls
from kvscale_plugin.hosts.vllm.catalogue import (  # noqa: F401 - read here by all
    FEATURES,
    INTERNALS,
    MIN_VERSION,
    PATCHED,
    RUN_TESTED,
    STATIC_TESTED,
    SUPPORTED_RANGE,
    Feature,
    Internal,
)
from kvscale_plugin.hosts.vllm.patching import replace, replace_item, transaction  # noqa: F401
from kvscale_plugin.hosts.vllm.runtime import on_cpu


def resolve(internal: Internal) -> Any:
    """Import ``internal``'s module (or the first of ``moved`` that has it) and follow its
    attribute chain (``_common.resolve_attribute``; raises the first module's error when
    none has it)."""
    first: Exception | None = None
    for module in internal.modules:
        try:
            return resolve_attribute(module, internal.attr)
        except Exception as exc:  # noqa: BLE001 - try the next place it may have moved to
            first = first or exc
    assert first is not None
    raise first


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
    try:
        found = parameter_names(obj)
    except (TypeError, ValueError):
        found = None  # no readable signature: nothing to compare
    return params_problem(internal.params, found) or calls_problem(
        internal.calls, live_calls(obj) if internal.calls else None
    )


@dataclass
class Report:
    """What ``check`` found: per feature, the problems of its required targets."""

    problems: dict[str, list[str]]

    def available(self, feature: str) -> bool:
        return not self.problems.get(feature)


def check(internals: Iterable[Internal] | None = None) -> Report:
    """Resolve every non-lazy target; a feature is unavailable when a required one fails.

    Every feature needs ``scales``; without it all are reported lost."""
    problems: dict[str, list[str]] = {f: [] for f in FEATURES}
    cpu: bool | None = None
    for internal in INTERNALS if internals is None else internals:
        if internal.lazy or not internal.required:
            continue
        if internal.cpu_only:
            cpu = on_cpu() if cpu is None else cpu
            if not cpu:
                continue
        if (why := problem(internal)) is not None:
            problems[internal.feature].append(f"{internal.target} ({internal.purpose}): {why}")
    if problems["scales"]:
        for feature in FEATURES:
            if feature != "scales" and not problems[feature]:
                problems[feature].append("needs the 'scales' feature")
    return Report(problems)


def host_version() -> str:
    """The installed vLLM's release (``0.32.0+cpu`` -> ``0.32.0``), or ``unknown``."""
    try:
        import vllm

        return base_version(str(getattr(vllm, "__version__", "unknown")))
    except Exception:  # noqa: BLE001 - an unreadable version is reported, not fatal
        return "unknown"
