"""What both hosts tell the user about a load cycle, worded once: the scheme's verdict
(``announce_verdict``), scales a declared scheme's checkpoint lacks, scale tensors that name
no attention layer, corrupt scales a cache does not use, a reload that carried no scales
or was refused, and caches that compute their own scales. Warnings are once per engine
(``scope``: a prefix naming the engine's config) and cause.

Imports no host engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from kvscale_plugin._log import logger, shorten, warn_once
from kvscale_plugin.scales import CorruptScales
from kvscale_plugin.scheme import SchemeVerdict, judge_kv_cache_scheme

if TYPE_CHECKING:
    from kvscale_plugin.loadcycle import Verdict


def announce_verdict(scheme: Any, scope: str = "") -> SchemeVerdict:
    """Judge a checkpoint's ``kv_cache_scheme`` and tell the user once what it means.

    ``scope`` names the engine (its config) a warning belongs to: "once" is once per
    engine and cause, so a second engine in the same process hears about its own."""
    verdict = judge_kv_cache_scheme(scheme)
    if verdict.declared and not verdict.supported:
        warn_once(
            f"{scope}unsupported-scheme:{verdict.reason}",
            "kvscale: kv_cache_scheme %s is not supported: %s. Serving with an unscaled KV "
            "cache (checkpoint k/v scales are ignored; --kv-cache-dtype auto keeps the "
            "model dtype). To use calibrated scales, export the KV cache with a static "
            "symmetric per-tensor FP8 scheme.",
            dict(scheme) if isinstance(scheme, dict) else scheme,
            verdict.reason,
        )
    elif verdict.supported:
        logger.info("kvscale: kv_cache_scheme %s", verdict.describe())
    return verdict


def dynamic_scales_notice(cache_dtype: str) -> str:
    """The one line said (once per engine) for a cache that computes its own scales."""
    return (
        f"kvscale: --kv-cache-dtype {cache_dtype} computes its k/v scales per token and head "
        "as it writes the cache: the checkpoint's k/v scales are not used (nor checked)."
    )


def unused_corrupt_message(corrupt: CorruptScales) -> str:
    """The warning for corrupt scales a cache does not use (a bf16 cache: an FP8 start
    would refuse them)."""
    return (
        "kvscale: the KV cache does not use the checkpoint's k/v scales (it is not FP8), "
        "so these corrupt ones are not served, and the engine goes on as before; an FP8 "
        "KV cache would refuse this checkpoint:\n"
        + corrupt.message()
        + "\nFix or re-calibrate them (check with `kvscale inspect`)."
    )


def reload_without_scales_message(layer_names: Iterable[str]) -> str:
    """The warning for a reload that gave layers that serve checkpoint scales none."""
    return (
        "kvscale: the reloaded weights carry no k_scale/v_scale tensors for "
        f"{shorten(layer_names)}, although the checkpoint declares a kv_cache_scheme; those "
        "layers keep the scales they had (1.0 after a dummy start). Reload a checkpoint with "
        "calibrated KV scales (kvscale calibrate), or serve with a bf16 KV cache."
    )


def refused_reload_message(corrupt: CorruptScales, host: str) -> str:
    """The error of a reload refused for corrupt scales (``corrupt``: named as on disk)."""
    return (
        corrupt.message()
        + "\nThe reload's KV scales are refused: every attention layer keeps the KV scales "
        f"it had. The reload's other weights are in place ({host} loads them before the "
        "scales can be checked): reload a checkpoint with valid KV scales (check it with "
        "`kvscale inspect`) before relying on this engine's outputs."
    )


def warn_missing_scales(layer_names: Iterable[str], scope: str = "") -> None:
    """One warning (per engine: ``scope``) for a declared scheme whose checkpoint has no
    scales for some layers."""
    shown = shorten(layer_names)
    warn_once(
        f"{scope}scales-missing",
        "kvscale: the checkpoint declares a kv_cache_scheme but has no k_scale/v_scale "
        "tensors for %s; those layers use scale 1.0, which clips K/V beyond +-448. "
        "Calibrate the checkpoint's KV cache with llm-compressor, or serve with a bf16 "
        "KV cache (--kv-cache-dtype bfloat16 in vLLM, bf16 in SGLang).",
        shown or "some attention layers",
    )


def warn_unused_corrupt(corrupt: CorruptScales, scope: str = "") -> None:
    """One warning per engine (``scope``) and set of tensors: corrupt scales that this
    engine's KV cache does not use (``unused_corrupt_message``)."""
    labels = ",".join(sorted(corrupt.as_mapping()))
    warn_once(f"{scope}unused-corrupt:{labels}", "%s", unused_corrupt_message(corrupt))


def warn_verdict(verdict: Verdict, scope: str = "", *, draft_scope: str = "") -> None:
    """The warnings of a load cycle's verdict, once per engine (``scope``) and cause: the
    corrupt scales no cache uses, the layers served 1.0 for want of scales (a draft's in
    its own warning: ``draft_scope``), the layers a reload carried no scale for. Its
    refusal and its unread q scales are the host's to report."""
    if verdict.unused:
        warn_unused_corrupt(verdict.unused, scope)
    if verdict.missing:
        warn_missing_scales(verdict.missing, scope + (draft_scope if verdict.draft else ""))
    if verdict.kept_without_scales:
        warn_reload_without_scales(verdict.kept_without_scales, scope)


def warn_reload_without_scales(layer_names: Iterable[str], scope: str = "") -> None:
    """One warning per engine (``scope``): a reload carried no scale for these layers."""
    warn_once(f"{scope}reload-without-scales", "%s", reload_without_scales_message(layer_names))


def warn_unmapped_scales(names: Iterable[str], scope: str = "") -> None:
    """One warning (per engine: ``scope``) listing every checkpoint KV-scale tensor that
    names no attention layer."""
    shown = sorted(names)
    warn_once(
        f"{scope}unmapped-scales",
        "kvscale: %d KV-scale tensor(s) in the checkpoint name no attention layer of this "
        "model and were not loaded: %s. If they belong to layers this model does build, "
        "add a name-mapping rule (entry-point group 'kvscale_plugin', see the README).",
        len(shown),
        ", ".join(shown),
    )


def short_values(values: list[float] | None) -> str:
    """A served copy's values for a message: one number when all are equal."""
    if values is None:
        return "nothing"
    if len(set(values)) == 1:
        return f"{values[0]:g}"
    return "[" + ", ".join(f"{x:g}" for x in values[:4]) + (", ...]" if len(values) > 4 else "]")


def warn_rewritten_copies(key: str, details: list[str], causes: str) -> None:
    """Once for ``key`` (one check): the served copies that did not hold the scales in
    force and were rewritten (``details``: one ``<copy> held X, in force Y`` each);
    ``causes``: what in this host clears or changes them."""
    if not details:
        return
    warn_once(
        key,
        "kvscale: %d served KV-scale %s not hold the scales in force and %s rewritten from "
        "kvscale's record: %s. Something outside kvscale changed them (%s); nothing is "
        "served from them after this check.",
        len(details),
        "copy did" if len(details) == 1 else "copies did",
        "was" if len(details) == 1 else "were",
        shorten(details, "copies"),
        causes,
    )
