"""Checkpoint KV-scale names -> host parameter names.

The built-in rules below are an ordinary pluggy plugin of the ``kvscale``
project (see ``hookspecs.py``); third-party rule packages found under the
entry-point group ``kvscale_plugin`` are registered next to them and are asked
first. Both hosts (vLLM, SGLang) name the attention layer's scales
``<attention module>.attn.{k,v,q}_scale``.

Only tensor *names* are mapped here. The ``kv_cache_scheme`` dict is never
passed through this mapping: its keys are field names, not module paths.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import pluggy

from kvscale_plugin import hookspecs
from kvscale_plugin._log import warn_once

ENTRY_POINT_GROUP = "kvscale_plugin"
HOSTS = ("vllm", "sglang")

# Attention module names in the wild; MTP / draft layers (``mtp.layers.N``,
# ``model.layers.{num_layers}``, ``model.mtp_layers.N``) only change the prefix,
# which every rule keeps as it is (``mtp_layer_ordinal`` tells which MTP layer).
_ATTN = r"(?:self_attn|self_attention|attention|mixer)"
# k_proj / v_proj (ModelOpt, Llama), qkv_proj (Qwen2 / Qwen3-MoE fused), q_proj (q scales).
_PROJ = r"(?:[qkv]|qkv)_proj"

_RULES: list[tuple[re.Pattern[str], str]] = [
    # Already in host form.
    (
        re.compile(rf"^(?P<base>.+\.{_ATTN}\.attn)\.(?P<kind>[qkv])_scale$"),
        r"\g<base>.\g<kind>_scale",
    ),
    # self_attn.k_scale, self_attn.k_proj.k_scale (ModelOpt), self_attn.qkv_proj.k_scale (Qwen)
    (
        re.compile(rf"^(?P<base>.+\.{_ATTN})\.(?:{_PROJ}\.)?(?P<kind>[qkv])_scale$"),
        r"\g<base>.attn.\g<kind>_scale",
    ),
    # Older llm-compressor: the k/v projection's output activation scale is the cache scale.
    (
        re.compile(rf"^(?P<base>.+\.{_ATTN})\.(?P<kind>[qkv])_proj\.output_scale$"),
        r"\g<base>.attn.\g<kind>_scale",
    ),
    # Symmetric schemes only: zero points are accepted (and dropped by the KV method).
    (
        re.compile(
            rf"^(?P<base>.+\.{_ATTN})\.(?:{_PROJ}\.)?(?:attn\.)?(?P<kind>[qkv])_zero_point$"
        ),
        r"\g<base>.attn.\g<kind>_zero_point",
    ),
    (
        re.compile(rf"^(?P<base>.+\.{_ATTN})\.(?P<kind>[qkv])_proj\.output_zero_point$"),
        r"\g<base>.attn.\g<kind>_zero_point",
    ),
]

# Legacy single scale for k and v: loaded as k, duplicated to v by the scale rules.
_LEGACY_KV_SCALE = re.compile(rf"^(?P<base>.+\.{_ATTN})(?:\.{_PROJ}|\.attn)?\.kv_scale$")


class BuiltinRules:
    """The plugin's own naming rules, registered through the public hook."""

    @hookspecs.hookimpl(trylast=True)
    def kvscale_map_scale_name(self, name: str, host: str, model_type: str | None) -> str | None:
        if host not in HOSTS:
            return None
        if (match := _LEGACY_KV_SCALE.match(name)) is not None:
            warn_once(
                "legacy-kv_scale",
                "kvscale: checkpoint tensor '%s' uses the deprecated single 'kv_scale' "
                "convention; it is loaded as k_scale and duplicated to v_scale. Re-export "
                "the checkpoint with separate k_scale/v_scale tensors.",
                name,
            )
            return f"{match['base']}.attn.k_scale"
        for pattern, replacement in _RULES:
            if pattern.match(name):
                return pattern.sub(replacement, name)
        return None


#: This process's plugin manager, built on first use (``get_plugin_manager``); a test
#: that installs None has the installed rule packages discovered again.
plugin_manager: pluggy.PluginManager | None = None
_manager_lock = threading.Lock()


def _load_third_party(pm: pluggy.PluginManager) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if pm.get_plugin(ep.name) is not None or pm.is_blocked(ep.name):
            continue
        try:
            plugin = ep.load()
            pm.register(plugin, name=ep.name)
        except Exception as exc:  # a broken rule package must not take the server down
            warn_once(
                f"third-party:{ep.name}",
                "kvscale: name-mapping rule package '%s' (entry point '%s' in group '%s') "
                "failed to load and is ignored: %s: %s. Fix or uninstall that package.",
                ep.name,
                ep.value,
                ENTRY_POINT_GROUP,
                type(exc).__name__,
                exc,
            )


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager: built-in rules plus installed rule packages."""
    global plugin_manager
    with _manager_lock:
        if plugin_manager is None:
            pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
            pm.add_hookspecs(hookspecs)
            pm.register(BuiltinRules(), name="kvscale-builtin")
            _load_third_party(pm)
            plugin_manager = pm
        return plugin_manager


def map_scale_name(name: str, host: str, model_type: str | None = None) -> str | None:
    """Host parameter name for checkpoint tensor ``name``; None if it is not a KV scale."""
    return get_plugin_manager().hook.kvscale_map_scale_name(
        name=name, host=host, model_type=model_type
    )


# Multi-token-prediction (MTP) layers: a checkpoint's speculative-decoding draft layers.
# Their own prefixes (MiMo ``model.mtp_layers.N.``, Qwen3-Next / Qwen3.5 ``mtp.layers.N.``)
# count from 0; GLM-4-MoE and DeepSeek-V3 continue the main stack
# (``model.layers.{num_hidden_layers + N}.``), with the prefixes vLLM 0.32 recognises.
_MTP_OWN_PREFIX = re.compile(r"(?:^|\.)(?:mtp_layers|mtp\.layers)\.(?P<n>\d+)\.")
_MAIN_STACK_PREFIX = re.compile(r"^(?:model\.(?:language_model\.)?)?layers\.(?P<n>\d+)\.")


def main_stack_index(name: str) -> int | None:
    """``model.layers.3.self_attn`` (or ``model.language_model.layers.3...``) -> 3."""
    stack = _MAIN_STACK_PREFIX.match(name)
    return int(stack["n"]) if stack is not None else None


def mtp_layer_ordinal(name: str, num_hidden_layers: int | None) -> int | None:
    """Which MTP layer (counted from 0) checkpoint tensor ``name`` belongs to, or None.

    ``num_hidden_layers`` is the main stack's depth (the model config's
    ``num_hidden_layers``): a ``layers.N`` name with N at or beyond it is MTP layer
    ``N - num_hidden_layers``. Whether the model has that many MTP layers is the
    caller's question (``declared_mtp_layers``).
    """
    if (own := _MTP_OWN_PREFIX.search(name)) is not None:
        return int(own["n"])
    if num_hidden_layers is None or (index := main_stack_index(name)) is None:
        return None
    return index - num_hidden_layers if index >= num_hidden_layers else None


#: Where HF configs declare their MTP layer count (Qwen3.5: ``mtp_num_hidden_layers``).
MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def declared_mtp_layers(*configs: Any) -> int:
    """How many MTP layers the given HF config objects (e.g. a model's config and its
    text config) declare: the largest positive count in ``MTP_COUNT_FIELDS``, else 0."""
    counts = [
        value
        for config in configs
        for field in MTP_COUNT_FIELDS
        if isinstance(value := getattr(config, field, None), int) and not isinstance(value, bool)
    ]
    return max([0, *counts])


_LAYER_TAIL = re.compile(r"(?:^|\.)(layers\.\d+\..+)$")


def names_attention_layer(target: str, layer_names: Iterable[str]) -> bool:
    """Whether host parameter name ``target`` (``<layer>.k_scale``) can belong to one of
    the host's attention layers ``layer_names``.

    Compared on the ``layers.N....`` tail: the mapping runs on checkpoint names, before a
    model's own prefix renames (``model.language_model.`` -> ``language_model.model.``),
    so only a name whose layer tail matches nothing is known not to load. A name without
    such a tail cannot be judged here: True (the host's loader decides).
    """
    layer = target.rsplit(".", 1)[0]
    tail = _LAYER_TAIL.search(layer)
    if tail is None:
        return True
    return any(
        (m := _LAYER_TAIL.search(name)) is not None and m.group(1) == tail.group(1)
        for name in layer_names
    )


# --- Judging a scale name by where the model's own translation takes it --------------

#: The per-layer tensors a host's KV method creates (the landings a scale name can reach).
SCALE_KINDS = frozenset(
    ("q_scale", "k_scale", "v_scale", "prob_scale", "k_zero_point", "v_zero_point", "q_zero_point")
)


def scale_kind(name: str) -> str | None:
    """``k_scale`` for ``...k_scale`` (a name that looks like a KV scale), else None."""
    kind = name.rsplit(".", 1)[-1]
    return kind if kind in SCALE_KINDS else None


@dataclass(frozen=True)
class Landing:
    """Where a checkpoint KV-scale tensor goes: ``emit`` is the name handed to the host's
    loader (before the model's own renames), ``target`` the parameter path it reaches
    (``<attention module path>.<kind>``), ``layer`` that attention module's path."""

    emit: str
    target: str
    layer: str

    @property
    def kind(self) -> str:
        return self.target.rsplit(".", 1)[1]


def land_scale_name(
    name: str,
    mapped: str | None,
    translate: Callable[[str], str | None],
    layer_paths: Collection[str],
) -> Landing | None:
    """Where checkpoint scale ``name`` lands in a model whose attention modules sit at
    ``layer_paths`` (full parameter paths, as the model's ``named_parameters`` spell
    them), or None when it lands nowhere.

    ``translate`` is the model's own translation of a name (its weights mapper and the
    host's stock scale mapper: what the host does to the name after kvscale); ``mapped``
    is what the name-mapping hook (third-party rules, then kvscale's) answered. Tried in
    this order, each judged by the parameter path it actually reaches:

    1. the name as written, through the model's translation (what stock would load);
    2. the hook's answer, through the same translation;
    3. the one attention module under the module the name designates (``P.k_scale``
       with an attention module at ``P.attn`` or deeper: GPT-BigCode's ``h.N.attn``,
       Falcon-H1's ``self_attn``), when there is exactly one.
    """
    layers = set(layer_paths)

    def reaches(candidate: str) -> Landing | None:
        target = translate(candidate)
        if target is None or "." not in target:
            return None
        layer, kind = target.rsplit(".", 1)
        if kind in SCALE_KINDS and layer in layers:
            return Landing(candidate, target, layer)
        return None

    for candidate in (name, mapped):
        if candidate is not None and (landing := reaches(candidate)) is not None:
            return landing
    base = mapped if mapped is not None else name
    if "." not in base:
        return None
    module, kind = base.rsplit(".", 1)
    if kind not in SCALE_KINDS:
        return None
    if mapped is not None and module.endswith(".attn"):
        module = module[: -len(".attn")]  # the hook's form: <attention module>.attn.<kind>
    translated = translate(f"{module}.{kind}")
    if translated is None or "." not in translated:
        return None
    where = translated.rsplit(".", 1)[0]
    under = [path for path in layers if path == where or path.startswith(where + ".")]
    if len(under) != 1:
        return None
    layer = under[0]
    for candidate in (f"{module}{layer[len(where) :]}.{kind}", f"{layer}.{kind}"):
        if (landing := reaches(candidate)) is not None and landing.layer == layer:
            return landing
    return None


def is_loaded_form(name: str, layer_paths: Collection[str]) -> bool:
    """Whether ``name`` already is a landing, or the tail of one (a nested loader sees the
    names relative to its module: ``model.layers.0.self_attn.attn.k_scale`` inside a
    multimodal model's ``language_model``)."""
    if "." not in name:
        return False
    layer, kind = name.rsplit(".", 1)
    if kind not in SCALE_KINDS:
        return False
    return any(path == layer or path.endswith("." + layer) for path in layer_paths)
