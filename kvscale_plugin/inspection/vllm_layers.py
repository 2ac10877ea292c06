"""Where vLLM serves a checkpoint's attention module, per release and architecture: data.

A running vLLM engine judges each scale name by the path the model's own translation takes
it to (``hosts/vllm/scalepaths``). ``kvscale inspect`` runs without vLLM (for other
releases, on Hub checkpoints, in well under a second), so what it knows of each
architecture's translation is this table, ``data/vllm_layers.json``:
``{release: {architecture: [[checkpoint module regex, parameter path, layer name], ...]}}``
with the layer index as ``(\\d+)`` in the regex and ``{}`` in the two templates. The layer
name is what the engine calls the layer (its static forward context, its messages); the
parameter path is where its scale parameters live in the model.

The table is measured, not written: ``scripts/gen_vllm_layer_table.py`` starts a kvscale
engine of each architecture of the family sweep and records which layer serves each
checkpoint module's (distinct) scales; the sweep (tests/e2e/_family_sweep.py) fails when
the table and the live engine disagree. An architecture or release not in the table gets
kvscale's own rules (``names.map_scale_name``), as the report says.
"""

from __future__ import annotations

import functools
import json
import re
from importlib import resources
from typing import NamedTuple

TABLE = "vllm_layers.json"


class ServedOn(NamedTuple):
    """Where vLLM serves one checkpoint attention module's scales."""

    parameter: str  # the attention module's path in the model (its scales' parent)
    layer: str  # the engine's name for the layer


@functools.cache
def table() -> dict[str, dict[str, list[list[str]]]]:
    text = resources.files("kvscale_plugin").joinpath("data", TABLE).read_text(encoding="utf-8")
    return json.loads(text)


@functools.cache
def _rules(release: str, architecture: str) -> tuple[tuple[re.Pattern[str], str, str], ...]:
    rows = table().get(release, {}).get(architecture, [])
    return tuple((re.compile(pattern), param, layer) for pattern, param, layer in rows)


def measured(release: str | None, architecture: str | None) -> bool:
    """Whether the table has ``architecture`` on vLLM ``release``."""
    return bool(release and architecture and _rules(release, architecture))


def served_on(release: str | None, architecture: str | None, module: str) -> ServedOn | None:
    """Where vLLM ``release`` serves checkpoint attention module ``module`` of a model of
    ``architecture`` (None: not in the table)."""
    if not release or not architecture:
        return None
    for pattern, param, layer in _rules(release, architecture):
        if (match := pattern.fullmatch(module)) is not None:
            return ServedOn(param.format(*match.groups()), layer.format(*match.groups()))
    return None


_MODULE = re.compile(
    r"^(?P<module>.+?)(?P<proj>\.(?:[qkv]|qkv|qkqkv)_proj|\.attn)?"
    r"\.(?:[qkv]_scale|kv_scale|[qkv]_zero_point|output_scale|output_zero_point)$"
)


def checkpoint_modules(name: str, mapped: str | None) -> tuple[str, ...]:
    """The checkpoint attention modules a scale tensor may belong to, most likely first:
    what the name-mapping rules answered (``<module>.attn.<kind>``), the module the name
    itself ends in, and that module's parent when the name ends in ``.attn`` or a
    projection (``<module>.attn.k_scale``, ``<module>.k_proj.k_scale``)."""
    found: list[str] = []
    if mapped is not None and (m := re.match(r"^(?P<module>.+)\.attn\.[^.]+$", mapped)):
        found.append(m["module"])
    if (match := _MODULE.match(name)) is not None:
        if match["proj"]:
            found.append(match["module"] + match["proj"])
        found.append(match["module"])
    return tuple(dict.fromkeys(found))


def served_on_any(
    release: str | None, architecture: str | None, modules: tuple[str, ...]
) -> ServedOn | None:
    """``served_on`` for the first of ``modules`` the table places."""
    for module in modules:
        if (found := served_on(release, architecture, module)) is not None:
            return found
    return None
