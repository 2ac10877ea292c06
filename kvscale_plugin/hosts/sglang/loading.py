"""How a kvscale model's ``load_weights`` sees checkpoint KV-scale names in SGLang 0.5.23
(installed by ``patches._hook_initialize_model`` on each kvscale model instance).

* Checkpoint scale names are mapped onto the model's placeholders (``_map_weight_names``);
  a speculative draft's MTP-layer scales are loaded straight into its attention layers
  (``_load_draft_scale``).
* A call outside SGLang's load cycles (nothing post-processes it) is a load cycle of its
  own (``live.start_standalone`` / ``live.end_standalone``): its scales are served before
  it returns, or refused whole (``CorruptScaleError``).
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from sglang.srt.layers.radix_attention import RadixAttention

from kvscale_plugin._log import logger
from kvscale_plugin.hosts.sglang import live
from kvscale_plugin.hosts.sglang.method import HOST, PLACEHOLDER_ATTR, KVScaleConfig, report_verdict
from kvscale_plugin.loadcycle import layer_record
from kvscale_plugin.names import (
    land_scale_name,
    map_scale_name,
    mtp_layer_ordinal,
    names_attention_layer,
    scale_kind,
)
from kvscale_plugin.notices import warn_unmapped_scales
from kvscale_plugin.scales import CorruptScaleError

# The kvscale config of the model whose load_weights is running (gives the name
# hooks the checkpoint's model_type; None outside a kvscale model's load).
_ACTIVE_CONFIG: contextvars.ContextVar[KVScaleConfig | None] = contextvars.ContextVar(
    "kvscale_active_config", default=None
)


@dataclass(frozen=True)
class MtpLayers:
    """How a model relates to the checkpoint's multi-token-prediction (MTP) layers.

    ``num_hidden_layers`` is the main stack's depth (``layers.N`` with N at or beyond it
    is an MTP layer, as GLM-4-MoE / DeepSeek-V3 name them). ``draft_layers`` are the
    attention layers of a speculative-decoding draft model (SGLang's ``MiMoMTP``,
    ``Glm4MoeForCausalLMNextN``, ``Qwen3NextForCausalLMMTP``, ``Qwen3_5ForCausalLMMTP``,
    ...) in build order, MTP layer ``i`` served by ``draft_layers[i]``; None for the
    target model, which builds no MTP layer.
    """

    num_hidden_layers: int | None
    draft_layers: tuple[torch.nn.Module, ...] | None = None
    # How many MTP layers the checkpoint's config declares (0: none, so a ``layers.N``
    # beyond the stack is a stray name, reported as such in the target model).
    declared: int = 0


def _load_draft_scale(
    name: str, tensor: torch.Tensor, mapped: str, ordinal: int, mtp: MtpLayers
) -> bool:
    """Load MTP layer ``ordinal``'s KV-scale tensor ``name`` straight into the draft's
    attention layer; False when the draft's layer is not kvscale's (left to SGLang).

    Straight into the placeholder, because SGLang 0.5.23's draft loaders translate
    checkpoint names each their own way and lose or trip over scale names: MiMoMTP
    raises ``KeyError: 'model.mtp_block.self_attn.k_scale'``, Qwen3NextForCausalLMMTP
    asserts ``Expected 1.0, got ... in skipped model.layers.0.k_scale``, GLM-4-MoE's NextN
    draft drops them.
    """
    layers = mtp.draft_layers or ()
    if ordinal >= len(layers):
        # SGLang's drafts build one MTP layer (num_nextn_predict_layers is forced to 1)
        # and reuse it for every draft step: later MTP layers are not served.
        logger.debug("kvscale: %s is MTP layer %d's; the draft does not build it", name, ordinal)
        return True
    layer = layers[ordinal]
    kind = mapped.rsplit(".", 1)[-1]
    param = getattr(layer, kind, None)
    if not getattr(param, PLACEHOLDER_ATTR, False):
        if not getattr(getattr(layer, "k_scale", None), PLACEHOLDER_ATTR, False):
            return False  # a draft layer kvscale does not serve: SGLang's loader decides
        # A scale SGLang keeps no parameter for (q_scale: SGLang quantizes no query with
        # a checkpoint scale). The main stack's loaders skip it; a draft's would raise
        # (MiMoMTP: KeyError 'model.mtp_block.self_attn.q_scale').
        logger.debug("kvscale: %s has no SGLang parameter; not loaded", name)
        return True
    layer_record(layer).checkpoint_names[kind] = name  # type: ignore[union-attr]
    param.weight_loader(param, tensor)
    return True


def _map_weight_names(
    weights: Iterable[tuple[str, torch.Tensor]],
    targets: set[str],
    model_type: str | None,
    unmapped: set[str] | None = None,
    mtp: MtpLayers | None = None,
    on_disk: dict[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename checkpoint KV-scale tensors to this model's placeholders, lazily (a draft
    model's MTP-layer scales are loaded into its attention layers instead)."""
    if not targets:  # no KV scheme: nothing to map onto, names stay as they are
        yield from weights
        return
    for name, tensor in weights:
        # Every name is asked (third-party rules may map names without "scale" in them),
        # but only a placeholder this model owns is mapped onto: other names (e.g.
        # another PP rank's layers) stay as they are, for the model's loader to decide.
        mapped = map_scale_name(name, HOST, model_type)
        if mapped is not None and mtp is not None:
            ordinal = mtp_layer_ordinal(name, mtp.num_hidden_layers)
            if ordinal is not None and mtp.draft_layers is not None:
                # A draft loads an MTP layer's scales itself.
                if not _load_draft_scale(name, tensor, mapped, ordinal, mtp):
                    yield name, tensor
                continue
            if ordinal is not None and ordinal < mtp.declared:
                yield name, tensor  # the draft model's, not a layer this model lacks
                continue
        landing = (
            land_scale_name(name, mapped, _as_named, _placeholder_layers(targets))
            if name not in targets and (mapped is not None or scale_kind(name) is not None)
            else None
        )
        if landing is not None and landing.target in targets:
            # The hook's answer, or the one attention layer under the module the name
            # designates (SGLang's models translate scale names in their loaders, each its
            # own way: a placeholder's own path is one every loader takes as it is).
            if on_disk is not None:
                on_disk[landing.target] = name  # errors name the checkpoint's tensor
            name = landing.target
        elif (
            mapped is not None
            and unmapped is not None
            # A draft built from the target's checkpoint sees the target's scales too.
            and (mtp is None or mtp.draft_layers is None)
            and mapped not in targets
            and not names_attention_layer(mapped, _placeholder_layers(targets))
        ):
            unmapped.add(name)  # SGLang's loader skips it: say so, once, after the load
        yield name, tensor


def _as_named(name: str) -> str:
    return name


def _placeholder_layers(targets: set[str]) -> set[str]:
    return {t.rsplit(".", 1)[0] for t in targets}


def _install_name_mapping(
    model: torch.nn.Module,
    cfg: KVScaleConfig,
    num_hidden_layers: int | None = None,
    draft: bool = False,
    declared_mtp: int = 0,
) -> None:
    """Wrap this model instance's ``load_weights``: every load path (startup,
    update_weights_from_disk / _tensor / _distributed) goes through it. SGLang's loaders
    know only their own KV-scale names, so scales named otherwise (other checkpoint
    layouts, third-party name-mapping rules) would be skipped: they are mapped onto the
    placeholders first (``_map_weight_names``), and names that fit no layer are reported
    once. ``draft``: the model is a speculative-decoding draft built from the checkpoint's
    MTP layers (``_load_draft_scale``)."""
    original = model.load_weights
    if getattr(original, "_kvscale_wrapped", False):
        return
    model_ref = weakref.ref(model)

    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any):
        owner = model_ref()
        targets = (
            {n for n, p in owner.named_parameters() if getattr(p, PLACEHOLDER_ATTR, False)}
            if owner is not None
            else set()
        )
        draft_layers = (
            tuple(
                m
                for m in owner.modules()
                if isinstance(m, RadixAttention) and layer_record(m) is not None
            )
            if draft and owner is not None
            else None
        )
        mtp = MtpLayers(num_hidden_layers, draft_layers, declared_mtp)
        # Outside SGLang's load cycles nothing post-processes this call: it is its own.
        own = (
            live.start_standalone(cfg, owner)
            if owner is not None and not live.in_load_cycle(cfg)
            else None
        )
        cfg.cycle.weight_loads += 1
        token = _ACTIVE_CONFIG.set(cfg)
        done = False
        refused = None
        try:
            unmapped: set[str] = set()
            result = original(
                _map_weight_names(
                    weights, targets, cfg.model_type, unmapped, mtp, cfg.checkpoint_names
                ),
                *args,
                **kwargs,
            )
            done = True
            if unmapped:
                warn_unmapped_scales(unmapped)
        finally:
            _ACTIVE_CONFIG.reset(token)
            if own is not None:
                # The call's own cycle always ends; a call that failed takes no scale.
                live.end_standalone(cfg, own, failed=not done)
                refused = report_verdict(cfg)
        if refused:
            raise CorruptScaleError(refused)
        return result

    load_weights._kvscale_wrapped = True  # type: ignore[attr-defined]
    model.load_weights = load_weights
