"""The scale state KV travels with (``kvscale_plugin.scalestate``): one tag for one set of
scales whatever the engine's layout, a refusal when its workers disagree, and who may read
whose KV."""

from __future__ import annotations

import json

import pytest

from kvscale_plugin.scalestate import (
    PARAMS_KEY,
    ScaleState,
    ScaleStateError,
    merge,
    part,
    readable,
)

LAYERS = {
    "model.layers.0.self_attn.attn": ((0.05, 0.07), (0.04, 0.03)),  # per head (2 KV heads)
    "model.layers.1.self_attn.attn": ((0.06,), (0.05,)),
}


def _part(names, applied=True, layers=LAYERS):
    return part([(n, *layers[n], None) for n in names], applied)


def _tp_rank(rank: int) -> tuple:
    """A TP=2 rank's part: head ``rank`` of the per-head layer, the per-tensor one whole."""
    (k0, v0), (k1, v1) = LAYERS.values()
    return part(
        [
            ("model.layers.0.self_attn.attn", (k0[rank],), (v0[rank],), (rank,)),
            ("model.layers.1.self_attn.attn", k1, v1, None),
        ],
        True,
    )


def test_one_tag_whatever_the_layout() -> None:
    one_worker = merge([_part(LAYERS)])
    # TP=2: each rank serves one head of the per-head layer; PP=2: each stage its layers;
    # fewer KV heads than ranks: every rank holds the same heads.
    tp2 = merge([_tp_rank(0), _tp_rank(1)])
    replicated = merge([_part(LAYERS), _part(LAYERS)])
    assert tp2 == replicated
    pp2 = merge(
        [_part(["model.layers.0.self_attn.attn"]), _part(["model.layers.1.self_attn.attn"])]
    )
    assert one_worker == tp2 == pp2
    assert one_worker.layers == 2 and one_worker.applied
    assert len(one_worker.tag) == 16


def test_any_scale_changes_the_tag() -> None:
    base = merge([_part(LAYERS)])
    for name, (k, v) in LAYERS.items():
        for changed in ((tuple(x * 2 for x in k), v), (k, tuple(x + 1e-6 for x in v))):
            other = merge([_part(LAYERS, layers={**LAYERS, name: changed})])
            assert other.tag != base.tag, (name, changed)
    fewer = merge([_part(["model.layers.1.self_attn.attn"])])
    assert fewer.tag != base.tag


def test_workers_that_disagree_are_refused_naming_the_layer() -> None:
    other = {**LAYERS, "model.layers.1.self_attn.attn": ((0.5,), (0.05,))}
    with pytest.raises(ScaleStateError, match=r"k scales for head 0 of layer 'model\.layers\.1\."):
        merge([_part(LAYERS), _part(LAYERS, layers=other)])


def test_no_scales_no_state() -> None:
    assert merge([]) is None
    assert merge([None, None]) is None


def test_applied_when_any_worker_applies() -> None:
    assert merge([_part(LAYERS, applied=False)]).applied is False
    assert merge([_part(LAYERS, applied=False), _part(LAYERS)]).applied is True


def test_it_travels_as_json() -> None:
    state = merge([_part(LAYERS)])
    params = json.loads(json.dumps({"do_remote_prefill": True, PARAMS_KEY: state.to_params()}))
    assert ScaleState.from_params(params) == state
    for broken in (None, {}, {PARAMS_KEY: "x"}, {PARAMS_KEY: {"tag": 1, "applied": True}}):
        assert ScaleState.from_params(broken) is None


def test_who_reads_whose_kv() -> None:
    a = ScaleState("a" * 16, True, 2)
    b = ScaleState("b" * 16, True, 2)
    bf16_a = ScaleState("a" * 16, False, 2)
    bf16_b = ScaleState("b" * 16, False, 2)
    assert readable(a, a)
    assert not readable(a, b) and not readable(b, a)
    assert not readable(None, a)  # a producer that names no scales: never into FP8
    assert not readable(bf16_a, a)  # bf16 KV is not FP8 KV under a
    # A cache that applies no scales reads anything; an engine without kvscale too.
    assert readable(a, bf16_b) and readable(None, bf16_a) and readable(b, None)
