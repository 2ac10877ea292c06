"""The load cycle both hosts call: which caches serve the checkpoint's k/v scales, what a
loader reads from each tensor, and what a load or reload serves (the one rule)."""

from __future__ import annotations

import math

import pytest
import torch

from kvscale_plugin.heads import HeadLayout
from kvscale_plugin.loadcycle import (
    Action,
    Cycle,
    LayerRecord,
    computes_own_scales,
    decide,
    layer_record,
    read_scale,
    scale_loader,
    serves_checkpoint_scales,
)
from kvscale_plugin.notices import (
    refused_reload_message,
    reload_without_scales_message,
    unused_corrupt_message,
)
from kvscale_plugin.scales import (
    CorruptScales,
    ResolvedScales,
    ScaleProblem,
    ScaleSource,
    unscaled,
)
from kvscale_plugin.scheme import FP8_KV_SCHEME, judge_kv_cache_scheme

SUPPORTED = judge_kv_cache_scheme(dict(FP8_KV_SCHEME))
UNSUPPORTED = judge_kv_cache_scheme({**FP8_KV_SCHEME, "num_bits": 4, "type": "int"})
NONE = judge_kv_cache_scheme(None)


@pytest.mark.parametrize(
    ("verdict", "dtype", "quantized", "serves"),
    [
        (SUPPORTED, "fp8", True, True),
        (SUPPORTED, "fp8_e4m3", True, True),
        # Scales computed per token and head as the cache is written: never the file's.
        (SUPPORTED, "fp8_per_token_head", True, False),
        (SUPPORTED, "int8_per_token_head", True, False),
        (SUPPORTED, "int4_per_token_head", True, False),
        # A layer kept in the model dtype (--kv-cache-dtype-skip-layers) or a bf16 cache.
        (SUPPORTED, "auto", False, False),
        (SUPPORTED, "bfloat16", False, False),
        (UNSUPPORTED, "fp8", True, False),
        # No scheme, FP8 cache chosen: stock vLLM loads per-tensor scales, and so do we.
        (NONE, "fp8", True, True),
        (NONE, "fp8_per_token_head", True, False),
    ],
)
def test_which_caches_serve_checkpoint_scales(verdict, dtype, quantized, serves):
    assert serves_checkpoint_scales(verdict, dtype, quantized=quantized) is serves


def test_only_per_token_head_modes_compute_their_own():
    assert [d for d in ("fp8", "fp8_e5m2", "fp8_per_token_head") if computes_own_scales(d)] == [
        "fp8_per_token_head"
    ]


# --- the one reload rule (loadcycle.decide), on plain tensors: no engine -------------------


class Layer:
    """Stands in for a host's attention layer: something a record can be kept on."""


def _cycle(tensors: dict[str, object], heads=None) -> tuple[dict, CorruptScales]:
    """One load cycle through the loaders and records both hosts use (``<layer>.<kind>``
    tensors): what the layers' records hold, and what the cycle refused."""
    cycle = Cycle()
    records: dict[str, LayerRecord] = {}
    for name, value in tensors.items():
        layer, kind = name.rsplit(".", 1)
        record = records.get(layer) or records.setdefault(
            layer, cycle.record(layer, Layer(), heads=heads)
        )
        loader = scale_loader(record, kind, heads)
        loader(torch.zeros(()), torch.as_tensor(value, dtype=torch.float32), "shard-id")
    stored = {f"{r.name}.{kind}": v for r in records.values() for kind, v in r.loaded.items()}
    return stored, cycle.refused()[0]


def test_a_load_with_new_scales_serves_them():
    stored, corrupt = _cycle({"l0.k_scale": 3.25, "l0.v_scale": 2.5})
    out = decide(
        serves=True,
        reload=True,
        corrupt=bool(corrupt),
        k=stored["l0.k_scale"],
        v=stored["l0.v_scale"],
    )
    assert out.action is Action.SERVE and (out.resolved.k, out.resolved.v) == (3.25, 2.5)
    assert not (out.refused or out.carried_none or out.unused_corrupt or out.missing)


@pytest.mark.parametrize("reload", [False, True])
def test_a_corrupt_scale_is_refused_at_start_and_kept_back_in_a_reload(reload):
    stored, corrupt = _cycle({"l0.k_scale": 2.0, "l1.k_scale": math.nan})
    assert list(stored) == ["l0.k_scale"]
    assert corrupt.as_mapping() == {"l1.k_scale": "NaN"}
    # Layer 0's own scale is valid: the whole cycle's scales are refused all the same.
    out = decide(serves=True, reload=reload, corrupt=True, k=stored["l0.k_scale"], v=None)
    if reload:
        assert out.action is Action.KEEP and out.refused and out.resolved is None
    else:
        assert out.action is Action.REFUSE


@pytest.mark.parametrize("reload", [False, True])
def test_a_corrupt_scale_a_bf16_cache_does_not_use_changes_nothing_but_is_flagged(reload):
    out = decide(serves=False, reload=reload, corrupt=True, k=(2.0,), v=None)
    assert out.action is Action.SERVE and out.resolved == unscaled() and out.unused_corrupt
    corrupt = _cycle({"l0.k_scale": -1.0})[1]
    assert "these corrupt ones are not served" in unused_corrupt_message(corrupt)


def test_a_reload_without_scales_keeps_those_in_force():
    out = decide(serves=True, reload=True, corrupt=False, k=None, v=None)
    assert out.action is Action.KEEP and out.carried_none and not out.refused


def test_a_first_load_without_scales_serves_one_and_says_so():
    out = decide(serves=True, reload=False, corrupt=False, k=None, v=None)
    assert out.action is Action.SERVE and out.missing and out.resolved.k == 1.0


def test_one_kv_scale_serves_k_and_v_and_fnuz_doubles_once():
    out = decide(serves=True, reload=False, corrupt=False, k=(3.0,), v=None, fnuz=True)
    assert (out.resolved.k, out.resolved.v, out.resolved.source.value) == (6.0, 6.0, "duplicated")


def test_per_head_loads_keep_this_ranks_heads_and_check_every_head():
    layout = HeadLayout.place(4, 2, [(1, 2)], total_q=8)
    assert layout.heads == (2, 3)
    stored, corrupt = _cycle({"l0.k_scale": [[[1.0]], [[2.0]], [[3.0]], [[4.0]]]}, layout)
    assert stored == {"l0.k_scale": (3.0, 4.0)} and not corrupt
    # A bad head another rank serves is still this cycle's problem.
    stored, corrupt = _cycle({"l0.k_scale": [0.0, 2.0, 3.0, 4.0]}, layout)
    assert stored == {} and list(corrupt.as_mapping()) == ["l0.k_scale[head 0]"]


def test_a_per_query_head_q_scale_is_reduced_over_each_kv_heads_group():
    layout = HeadLayout.place(4, 2, [(0, 2)], total_q=8)
    values, problems = read_scale("q", torch.arange(1.0, 9.0), layout, is_query=True)
    assert problems == [] and values == (2.0, 4.0)  # max of (1,2) and (3,4)


def test_heads_that_cannot_be_placed_are_each_tensors_problem():
    layout = HeadLayout.place(4, 3, [(1, 2), (3, 4)])
    assert layout.heads is None and layout.local == 0
    values, problems = read_scale("k", torch.ones(4), layout)
    assert values is None
    assert "cannot place 4 per-head scales onto this layer's 3 KV head(s)" in problems[0].why


def test_the_refusal_and_the_reload_warning_name_what_to_do():
    _, corrupt = _cycle({"model.layers.1.self_attn.k_scale": math.nan})
    text = refused_reload_message(corrupt, "SGLang")
    assert "model.layers.1.self_attn.k_scale: NaN" in text
    assert "every attention layer keeps the KV scales it had" in text and "SGLang" in text
    text = reload_without_scales_message([f"layer{i}" for i in range(6)])
    assert "layer0, layer1, layer2, layer3, ... (6 layers)" in text


# --- the cycle object the config owns: records, refusals read once, the INFO line ---------


def test_the_cycles_refusals_are_gathered_once_until_a_loader_changes_a_record():
    cycle = Cycle()
    layers = [Layer() for _ in range(3)]
    records = [cycle.record(f"l{i}", layer) for i, layer in enumerate(layers)]
    assert [layer_record(layer) for layer in layers] == records  # kept on each layer
    for record in records:
        scale_loader(record, "k_scale", None)(torch.zeros(()), torch.tensor(2.0))
    first = cycle.refused()
    assert not first[0] and cycle.refused() is first  # no layer walked again
    scale_loader(records[2], "v_scale", None)(torch.zeros(()), torch.tensor(math.inf))
    kv, q = cycle.refused()
    assert kv is not first[0] and list(kv.as_mapping()) == ["l2.v_scale"] and not q
    # A query scale goes apart (only hosts that quantize queries refuse it).
    scale_loader(records[0], "q_scale", None)(torch.zeros(()), torch.tensor(-1.0))
    assert list(cycle.refused()[1].as_mapping()) == ["l0.q_scale"]
    # A new cycle for layer 2 forgets what it refused; the layers that share a cache are
    # left out (their own scales are unused: warned about, never refused).
    records[2].start()
    records[1].target = "l0"
    scale_loader(records[1], "k_scale", None)(torch.zeros(()), torch.tensor(math.nan))
    assert not cycle.refused()[0] and records[1].corrupt


def test_a_host_that_knows_targets_late_is_asked_when_refusals_are_gathered():
    targets = {"l1": "l0"}
    cycle = Cycle(target_of=lambda record: targets.get(record.name))
    sharer = cycle.record("l1", Layer())
    scale_loader(sharer, "k_scale", None)(torch.zeros(()), torch.tensor(0.0))
    assert not cycle.refused()[0] and sharer.target == "l0"


def test_a_record_serves_reports_its_source_and_the_last_layer_ends_the_cycle(caplog):
    cycle = Cycle()
    a, b = cycle.record("a", Layer()), cycle.record("b", Layer(), target="a")
    for record in (a, b):
        cycle.built(record.name)
    scale_loader(a, "k_scale", None)(torch.zeros(()), torch.tensor(3.0))
    resolved = decide(
        serves=True, reload=False, corrupt=False, k=a.value("k_scale"), v=None
    ).resolved
    a.served(resolved)
    assert (a.loaded, a.source, a.resolved.v) == ({"k_scale": (3.0,)}, "duplicated", 3.0)
    with caplog.at_level("INFO", logger="kvscale_plugin"):
        assert cycle.done(a, "fp8_e4m3") is False
        assert [(r.name, s.k) for r, s in cycle.sharing_records()] == [("b", 3.0)]
        b.served(resolved, "shared")
        assert cycle.done(b, "fp8_e4m3") is True
    assert "2 attention layer(s) loaded, KV cache fp8_e4m3" in caplog.text
    assert "1 reading another layer's cache" in caplog.text


# --- the cycle's one verdict (Cycle.judge, Cycle.take_verdict) -----------------------------


def _judged_cycle(tensors: dict[str, float], *, served: bool) -> tuple[Cycle, list[LayerRecord]]:
    """Two layers (``l0``, ``l1``; ``served``: both served 2.0 / 3.0 before: a reload),
    given ``tensors`` (``<layer>.<kind>``) through their loaders."""
    cycle = Cycle(on_disk={"l1.q_scale": "model.layers.1.self_attn.q_scale"})
    records = [cycle.record(f"l{i}", Layer()) for i in range(2)]
    for record in records:
        if served:
            record.served(
                decide(serves=True, reload=False, corrupt=False, k=(2.0,), v=(3.0,)).resolved
            )
        record.start()
    for name, value in tensors.items():
        layer, kind = name.rsplit(".", 1)
        record = records[int(layer[1:])]
        scale_loader(record, kind, None)(torch.zeros(()), torch.tensor(value))
    return cycle, records


def test_a_reload_whose_only_corrupt_tensor_is_a_q_scale_read_by_attention_is_refused():
    tensors = {"l0.k_scale": 4.0, "l0.v_scale": 6.0, "l1.k_scale": 8.0, "l1.q_scale": math.nan}
    cycle, records = _judged_cycle(tensors, served=True)
    outcomes = [cycle.judge(r, serves=True, reads_q=True) for r in records]
    assert [o.action for o in outcomes] == [Action.KEEP, Action.KEEP]
    verdict = cycle.take_verdict()
    # Named as on disk, so that a user finds it in the file.
    assert list(verdict.refused.as_mapping()) == ["model.layers.1.self_attn.q_scale"]
    assert not verdict.unread_q and verdict.reload
    # Where no attention reads q scales it is unread: warned about, the reload serves.
    cycle, records = _judged_cycle(tensors, served=True)
    outcomes = [cycle.judge(r, serves=True, reads_q=False) for r in records]
    assert [o.action for o in outcomes] == [Action.SERVE, Action.SERVE]
    verdict = cycle.take_verdict()
    assert not verdict.refused
    assert list(verdict.unread_q.as_mapping()) == ["model.layers.1.self_attn.q_scale"]


def test_the_verdict_files_every_outcome_and_a_new_cycle_starts_empty():
    # Start-up, a layer without scales: missing where scales were expected, only then.
    for expects, missing in ((True, ["l1"]), (False, [])):
        cycle, records = _judged_cycle({"l0.k_scale": 4.0}, served=False)
        for record in records:
            cycle.judge(record, serves=True, dummy_load=not expects)
        verdict = cycle.take_verdict()
        assert verdict.missing == missing and not verdict.reload and not verdict.refused
    # A reload that carried nothing for l1 keeps its scales, and says so.
    cycle, records = _judged_cycle({"l0.k_scale": 4.0}, served=True)
    assert [cycle.judge(r, serves=True).action for r in records] == [Action.SERVE, Action.KEEP]
    assert all(r.judged for r in records)
    verdict = cycle.take_verdict()
    assert verdict.kept_without_scales == ["l1"] and not verdict.missing
    assert not any(r.judged for r in records)
    assert not (cycle.verdict.kept_without_scales or cycle.verdict.reload)
    # Without a declared scheme (stock's rules) nothing is said of it.
    cycle, records = _judged_cycle({"l0.k_scale": 4.0}, served=True)
    assert cycle.judge(records[1], serves=True, declared=False).carried_none
    assert not cycle.take_verdict().kept_without_scales
    # A bf16 cache: a corrupt scale is unused, never refused.
    cycle, records = _judged_cycle({"l0.k_scale": -1.0}, served=True)
    assert {cycle.judge(r, serves=False).action for r in records} == {Action.SERVE}
    verdict = cycle.take_verdict()
    assert list(verdict.unused.as_mapping()) == ["l0.k_scale"] and not verdict.refused
    # A start-up load with a corrupt scale is refused, naming it.
    cycle, records = _judged_cycle({"l0.k_scale": -1.0}, served=False)
    assert cycle.judge(records[0], serves=True).action is Action.REFUSE
    assert list(cycle.verdict.refused.as_mapping()) == ["l0.k_scale"]


@pytest.mark.parametrize(
    "partial, source, fnuz, want",
    [
        (False, ScaleSource.CHECKPOINT, False, (5.0, 5.0)),  # a checkpoint's one scale: both
        (True, ScaleSource.CHECKPOINT, False, (5.0, 2.5)),  # an update call: v kept
        (True, ScaleSource.CHECKPOINT, True, (10.0, 2.5)),  # fnuz: v kept, not doubled again
        (True, ScaleSource.DUPLICATED, False, (5.0, 5.0)),  # one scale for both stays so
    ],
)
def test_a_lone_k_in_an_update_call_keeps_v_in_force(partial, source, fnuz, want):
    cycle = Cycle()
    record = cycle.record("l0", Layer())
    v_held = 2.5 if source is ScaleSource.CHECKPOINT else 3.0
    record.served(ResolvedScales(3.0, v_held, source, (3.0,), (v_held,)))
    if source is ScaleSource.DUPLICATED:
        want = (want[0], want[0])
    record.loaded["k_scale"] = (5.0,)
    cycle.partial = partial
    out = cycle.judge(record, serves=True, fnuz=fnuz)
    assert out.action is Action.SERVE
    assert (out.resolved.k, out.resolved.v) == want


def test_an_update_refused_for_another_stages_tensor_is_refused_here_too():
    cycle = Cycle()
    record = cycle.record("l0", Layer())
    record.served(ResolvedScales(3.0, 2.5, ScaleSource.CHECKPOINT))
    record.loaded["k_scale"] = (5.0,)
    cycle.elsewhere.add([ScaleProblem("model.layers.7.self_attn.k_scale", "NaN")])
    out = cycle.judge(record, serves=True)
    assert out.action is Action.KEEP and out.refused
    assert "model.layers.7.self_attn.k_scale" in cycle.take_verdict().refused.as_mapping()
    cycle.begin(loading=False)  # the host's load ended: nothing is carried over
    assert not cycle.elsewhere and not cycle.loading
