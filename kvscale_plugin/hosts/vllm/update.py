"""KV scales sent after start-up through the model's own ``load_weights`` (the ``rl-sync``
feature): one update, decided by the load cycle's rule.

After start-up vLLM's KV method has consumed the scale placeholders, so a KV-scale tensor a
trainer sends through ``model.load_weights`` (``collective_rpc``, or a direct call on an
in-process or SPMD engine: verl, NeMo-RL, TRL's colocate mode) has no parameter to land in
and the model's loader skips it without a word. kvscale wraps the loaded model's own
``load_weights`` (that instance only, in a ``-q kvscale`` engine). While the host's own
load runs (start-up, ``reload_weights``, a weight-transfer session: ``host_load_running``)
the call goes through unchanged and the KV method takes the scales. Outside it, a call's
KV-scale tensors are taken out and the rest goes to the model; the scales are one update:

* every tensor read as the KV method's loaders read it (``loadcycle.read_scale``: every
  element checked, this rank's heads kept) into the layers' records, tensors of another
  pipeline stage's layers checked too (``Cycle.elsewhere``);
* the cycle's one rule per layer (``Cycle.judge``): a corrupt tensor anywhere in the call
  refuses it on every rank, where a cache uses the scales (nothing written); on a cache
  that uses none (bf16) it is warned about; a lone k or v keeps the other in force;
* the verdict reported as a reload's (``reload.report_verdict``: raised alike on every
  rank), then written in place to every copy, the served copies checked, counted, logged
  (``live.after_load``), and the prefix cache told when what an FP8 cache is written with
  changed (``prefixcache``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from kvscale_plugin._log import shorten, warn_once
from kvscale_plugin.hosts.vllm.layers import layer_serves_checkpoint_scales
from kvscale_plugin.loadcycle import Action, layer_record, read_scale
from kvscale_plugin.names import main_stack_index, map_scale_name, scale_kind
from kvscale_plugin.scales import CorruptScales

_WRAPPED = "__kvscale_live_load_weights__"
_HOST_NAME = "vllm"
#: ``_landing`` for a KV-scale name of a layer another pipeline stage holds.
ELSEWHERE = "elsewhere"

Landing = tuple[torch.nn.Module, str] | None | bool | str


def _landing(cfg: Any, name: str, paths: list[Any]) -> Landing:
    """Where a weight called ``name`` goes: (attention layer, kind) for a KV scale of this
    model, None for any other weight, ``ELSEWHERE`` for a KV scale of a layer another
    pipeline stage holds, False for a KV-scale name that lands on no layer.
    ``paths``: the call's ``ModelPaths``, built at its first scale name."""
    from kvscale_plugin.hosts.vllm.scalepaths import ModelPaths

    mapped = map_scale_name(name, _HOST_NAME, cfg.model_type)
    kind = scale_kind(name)
    if mapped is None and kind is None and not name.endswith(".kv_scale"):
        return None
    if not paths:
        paths.append(ModelPaths(cfg.attention_layers()))
    found = paths[0].land(name, mapped)
    if found is not None:
        landing, layer = found
        return layer, landing.kind
    if mapped is not None:
        layer = cfg.attention_layer(mapped.rsplit(".", 1)[0])
        if layer is not None:
            return layer, mapped.rsplit(".", 1)[1]
    if _other_stage(cfg, mapped or name):
        return ELSEWHERE
    return False


def _other_stage(cfg: Any, name: str) -> bool:
    """Under pipeline parallelism: ``name`` is a main-stack layer's (index below the
    model's layer count) that this stage does not hold."""
    from kvscale_plugin.hosts.vllm.runtime import pipeline_parallel

    index = main_stack_index(name)
    layers = getattr(cfg, "num_hidden_layers", None)
    if index is None or not isinstance(layers, int) or not 0 <= index < layers:
        return False
    return pipeline_parallel()


def host_load_running(cfg: Any) -> bool:
    """vLLM's own load is running, and its KV method takes the scales: the load cycle says
    so (the start-up load, ``reload_weights``), or vLLM's layerwise reload (a reload, a
    weight-transfer session) restored the layers' scale placeholders on the meta device.
    Up to 0.33 the placeholders exist only then; from 0.34 they stay after loading (on the
    layer's device), so only the cycle's state or the meta device tells."""
    from kvscale_plugin.hosts.vllm.runtime import keeps_placeholders

    if cfg.cycle.loading:
        return True
    for layer in cfg.attention_layers():
        placeholder = getattr(layer, "k_scale", None)
        if isinstance(placeholder, torch.Tensor) and (
            placeholder.is_meta or not keeps_placeholders()
        ):
            return True
    return False


def wrap_model(cfg: Any, model: torch.nn.Module) -> None:
    """Wrap ``model``'s own ``load_weights`` (this instance only). Idempotent."""
    original = model.load_weights
    if getattr(original, _WRAPPED, False):
        return

    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, torch.Tensor]], *args: Any, **kwargs: Any):
        if host_load_running(cfg):
            return original(weights, *args, **kwargs)
        taken: list[tuple[str, torch.Tensor, Landing]] = []
        rest = _divert(cfg, weights, taken)
        first = next(rest, None)
        loaded = (
            original(itertools.chain([first], rest), *args, **kwargs)
            if first is not None
            else set()
        )
        names = take_update(cfg, taken)
        return loaded | names if isinstance(loaded, set) else loaded

    setattr(load_weights, _WRAPPED, True)
    model.load_weights = load_weights


def _divert(
    cfg: Any,
    weights: Iterable[tuple[str, torch.Tensor]],
    taken: list[tuple[str, torch.Tensor, Landing]],
) -> Iterator[tuple[str, torch.Tensor]]:
    paths: list[Any] = []
    for name, tensor in weights:
        where = _landing(cfg, name, paths)
        if where is None:
            yield name, tensor
        else:
            taken.append((name, tensor, where))


def _read(cfg: Any, taken: list[tuple[str, torch.Tensor, Landing]]) -> tuple[dict, set, list, int]:
    """Every tensor of the update into its layer's record (or the cycle's ``elsewhere``):
    the layers named, the names taken here, the names that land nowhere, and how many
    tensors another pipeline stage takes."""
    from kvscale_plugin.hosts.vllm.qscales import reads_q_scale

    layers = cfg.attention_layers()
    records = [r for r in map(layer_record, layers) if r is not None]
    heads = next((r.heads for r in records if r.heads is not None), None)
    reads_q = any(reads_q_scale(layer) for layer in layers)
    named: dict[int, torch.nn.Module] = {}
    names: set[str] = set()
    nowhere: list[str] = []
    elsewhere = 0
    for name, tensor, where in taken:
        if where is False:
            nowhere.append(name)
            continue
        if where == ELSEWHERE:
            is_q = scale_kind(name) == "q_scale"
            if is_q and not reads_q:
                continue
            _, problems = read_scale(name, tensor, heads, is_query=is_q)
            cfg.cycle.elsewhere.add(problems)
            elsewhere += 1
            continue
        assert not isinstance(where, (bool, str)) and where is not None
        layer, kind = where
        record = layer_record(layer)
        if record is None or kind not in ("k_scale", "v_scale", "q_scale"):
            continue  # zero points (accepted, dropped), prob_scale (read by no backend)
        is_q = kind == "q_scale"
        named[id(layer)] = layer
        values, problems = read_scale(name, tensor, record.heads, is_query=is_q)
        kinds = (kind, "v_scale") if name.endswith(".kv_scale") else (kind,)
        names.update(f"{record.name}.{k}" for k in kinds)
        if values is None:
            (record.corrupt_q if is_q else record.corrupt).add(problems)
            continue
        for k in kinds:  # the legacy single kv_scale: k and v
            record.loaded[k] = values
    return named, names, nowhere, elsewhere


def take_update(cfg: Any, taken: list[tuple[str, torch.Tensor, Landing]]) -> set[str]:
    """One update: the KV-scale tensors of one ``model.load_weights`` call, judged by the
    load cycle's rule, then written in place; the served copies checked; counted and
    logged. Returns the names taken. Raises ``CorruptScaleError`` on every rank (nothing
    written) when the rule refuses the call."""
    from kvscale_plugin.hosts.vllm import live
    from kvscale_plugin.hosts.vllm.qscales import reads_q_scale
    from kvscale_plugin.hosts.vllm.reload import report_verdict
    from kvscale_plugin.hosts.vllm.served import write_kv_scales, write_scales
    from kvscale_plugin.hosts.vllm.shared import resync_sharing_layers, sharing_target

    cycle = cfg.cycle
    layers = cfg.attention_layers()
    records = [r for r in map(layer_record, layers) if r is not None]
    for record in records:
        record.start()
    cycle.elsewhere.clear()
    try:
        named, names, nowhere, elsewhere = _read(cfg, taken)
        if nowhere:
            warn_once(
                f"{cfg.warn_scope}live-unmapped-{','.join(sorted(nowhere))}",
                "kvscale: KV-scale tensor(s) that name no attention layer of this model "
                "were dropped from the update: %s (check the names against `kvscale "
                "inspect` of a checkpoint of the model).",
                shorten(nowhere, "tensors"),
            )
        fnuz = live.fnuz()

        def judge(layer: torch.nn.Module):
            record = layer_record(layer)
            assert record is not None
            serves = layer_serves_checkpoint_scales(cfg.kv_verdict, layer)
            outcome = cycle.judge(
                record,
                serves=serves,
                reads_q=reads_q_scale(layer),
                declared=cfg.kv_verdict.declared,
                fnuz=fnuz,
            )
            return layer, record, serves, outcome

        own = [layer for layer in named.values() if sharing_target(layer) is None]
        cycle.partial = True
        try:
            judged = [judge(layer) for layer in own]
        finally:
            cycle.partial = False
        kv, q = cycle.refused()
        if (kv or q) and not judged:
            # The call's only refusals are for another stage's layers: judged here too.
            first = next((x for x in layers if sharing_target(x) is None), None)
            if first is not None and layer_record(first) is not None:
                judge(first)
        verdict = cycle.take_verdict()
        verdict.kept_without_scales.clear()  # an update changes what it names
        report_verdict(cfg, verdict, _refused)  # raises a refusal (nothing written yet)
        factor = 2.0 if fnuz else 1.0
        served = 0
        for layer, record, serves, outcome in judged:
            q_sent = record.value("q_scale")
            if not serves:
                continue  # a cache that uses no scales: nothing served changes
            resolved = outcome.resolved if outcome.action is Action.SERVE else record.resolved
            if resolved is None or (outcome.action is not Action.SERVE and q_sent is None):
                continue
            if q_sent is not None and reads_q_scale(layer):
                q = tuple(x * factor for x in q_sent)
                write_scales(layer, resolved, q, float(getattr(layer, "_prob_scale_float", 1.0)))
            else:
                write_kv_scales(layer, resolved)
            record.served(resolved)
            live.serve_cpu_write(layer)
            served += 1
    finally:
        for record in records:
            record.loaded.clear()
            record.corrupt.clear()
            record.corrupt_q.clear()
        cycle.elsewhere.clear()
    resync_sharing_layers(layers)
    total = len(layers)
    what = "weights-only model.load_weights"
    if named:
        what = (
            f"KV-scale update through model.load_weights: {len(names)} tensor(s) for "
            f"{len(named)} of {total} attention layers taken ({served} serve them)"
        )
        if len(named) < total:
            what += f"; the other {total - len(named)} keep theirs"
    # Counted alike on every rank and stage: a call that carried scales for any layer.
    took = bool(names) or elsewhere > 0
    live.after_load(cfg, what, took_scales=took, quiet=not took)
    return names


def _refused(corrupt: CorruptScales) -> str:
    lines = "\n".join(f"  - {name}: {why}" for name, why in sorted(corrupt.as_mapping().items()))
    return (
        f"kvscale: refused the {len(corrupt)} corrupt KV-scale tensor(s) of this "
        f"model.load_weights call:\n{lines}\nNo scale of the call was taken: every "
        "attention layer keeps the scales in force (the call's other weights were "
        "loaded). Fix them where they are computed (a scale is a positive, finite "
        "number) and send the scales again."
    )


def wrap_loaded_models(cfg: Any) -> None:
    """At the end of a start-up load: every model this config's layers belong to gets the
    wrapped ``load_weights`` (the target model and an MTP draft)."""
    from kvscale_plugin.hosts.vllm.scalepaths import module_path

    roots: dict[int, torch.nn.Module] = {}
    for layer in cfg.attention_layers():
        found = module_path(layer)
        if found is not None:
            roots[id(found[0])] = found[0]
    for root in roots.values():
        if callable(getattr(root, "load_weights", None)):
            wrap_model(cfg, root)
