from __future__ import annotations

import math

import pytest
import torch
from kvscale_testing.scale_checks import check_scales, scale_problem

from kvscale_plugin.scales import (
    CorruptScaleError,
    ScaleSource,
    resolve_kv_scales,
    scale_problems,
)


def test_both_loaded_are_used():
    r = resolve_kv_scales(2.5, 3.5)
    assert (r.k, r.v, r.source) == (2.5, 3.5, ScaleSource.CHECKPOINT)


def test_neither_loaded_is_one():
    r = resolve_kv_scales(None, None)
    assert (r.k, r.v, r.source) == (1.0, 1.0, ScaleSource.DEFAULT)


@pytest.mark.parametrize(("k", "v"), [(4.0, None), (None, 4.0)])
def test_single_scale_is_used_for_both(k, v):
    r = resolve_kv_scales(k, v)
    assert (r.k, r.v, r.source) == (4.0, 4.0, ScaleSource.DUPLICATED)


def test_fnuz_doubles_loaded_scales_but_not_the_default():
    r = resolve_kv_scales(2.0, 3.0, fnuz=True)
    assert (r.k, r.v) == (4.0, 6.0)
    assert resolve_kv_scales(None, None, fnuz=True).k == 1.0
    assert resolve_kv_scales(2.0, None, fnuz=True).v == 4.0


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf, -math.inf])
def test_corrupt_values_are_rejected(bad):
    assert scale_problem(bad) is not None
    with pytest.raises(CorruptScaleError):
        resolve_kv_scales(bad, 1.0)


def test_non_scalar_is_rejected():
    assert "per-tensor scalar" in scale_problem(torch.ones(4))
    assert scale_problem(torch.tensor([2.0])) is None
    assert scale_problem(torch.tensor(2.0)) is None


def test_one_error_names_every_bad_tensor():
    with pytest.raises(CorruptScaleError) as info:
        check_scales(
            [("a.k_scale", 0.0), ("b.k_scale", 1.0), ("c.v_scale", math.nan), ("d.k_scale", -1)]
        )
    text = str(info.value)
    assert "a.k_scale" in text and "c.v_scale" in text and "d.k_scale" in text
    assert "b.k_scale" not in text
    assert text.count("\n  - ") == 3


def test_non_float_dtype_is_rejected():
    assert "dtype torch.int32" in scale_problem(torch.tensor([3], dtype=torch.int32))
    assert scale_problem(torch.tensor([3.0], dtype=torch.bfloat16)) is None


def test_placeholder_value_is_never_taken_for_missing():
    # -1.0 was the "not loaded" placeholder; a real -1.0 must be corrupt, not missing.
    with pytest.raises(CorruptScaleError, match="negative"):
        resolve_kv_scales(-1.0, 2.0)


def test_per_head_scales_resolve_per_head_with_max_per_layer():
    r = resolve_kv_scales([2.0, 5.0], [1.0, 0.5])
    assert r.per_head and r.k_heads == (2.0, 5.0) and r.v_heads == (1.0, 0.5)
    assert (r.k, r.v, r.source) == (5.0, 1.0, ScaleSource.CHECKPOINT)
    r = resolve_kv_scales(torch.tensor([[[2.0]], [[3.0]]]), None, fnuz=True)
    assert r.k_heads == r.v_heads == (4.0, 6.0) and r.source is ScaleSource.DUPLICATED


def test_per_head_k_and_v_must_have_the_same_head_count():
    with pytest.raises(CorruptScaleError, match="v_scale: 3 value"):
        resolve_kv_scales([1.0, 2.0], [1.0, 2.0, 3.0])


def test_per_head_problem_names_the_head():
    problems = scale_problems(
        "model.layers.3.self_attn.k_scale", torch.tensor([[[1.0]], [[math.nan]]]), num_heads=2
    )
    assert problems == {"model.layers.3.self_attn.k_scale[head 1]: NaN".split(": ")[0]: "NaN"}
    with pytest.raises(CorruptScaleError) as info:
        resolve_kv_scales([1.0, 0.0, -3.0], [1.0, 1.0, 1.0])
    text = str(info.value)
    assert "k_scale[head 1]: 0" in text and "k_scale[head 2]: -3.0" in text


@pytest.mark.parametrize(
    "value", [torch.ones(3), torch.ones(2, 2), torch.ones(1), torch.ones(4, 1, 1), torch.ones(())]
)
def test_per_head_wrong_shape_names_the_expected_shape(value):
    why = scale_problem(value, num_heads=2)
    assert why is not None and "[2, 1, 1]" in why and "2 KV heads" in why


@pytest.mark.parametrize("value", [torch.ones(2), torch.ones(2, 1, 1), torch.ones(2, 1)])
def test_per_head_accepted_layouts(value):
    assert scale_problem(value, num_heads=2) is None


def test_scale_whose_cache_read_overflows_is_corrupt():
    # 448 x 3e38 overflows float32: the cache would read back as inf/NaN.
    assert "too large" in scale_problem(torch.tensor([3e38]))
    with pytest.raises(CorruptScaleError, match="too large"):
        resolve_kv_scales(1.0, 3e38)


@pytest.mark.parametrize("value", [2e24, 1e30, 8.8e-39, 1e-45, 1.0001e4, 7.4e-9])
def test_implausible_positive_scale_is_corrupt(value):
    # llm-compressor's never-calibrated q_scale values: positive, finite, uninitialised.
    why = scale_problem(torch.tensor([value]))
    assert why is not None and "implausible" in why and "uninitialised" in why, why


@pytest.mark.parametrize("value", [2.0**-27, 1e-8, 2.2e-7, 0.0559, 1.0, 576.0, 1e4])
def test_plausible_scale_is_served(value):
    assert scale_problem(torch.tensor([value], dtype=torch.float64)) is None


def test_plausible_range_is_checked_per_head():
    problems = scale_problems("k_scale", torch.tensor([[[0.05]], [[2e24]]]), num_heads=2)
    assert list(problems) == ["k_scale[head 1]"] and "implausible" in problems["k_scale[head 1]"]


def test_corrupt_scales_renamed_to_checkpoint_names_keep_heads_and_notes():
    from kvscale_plugin.scales import CorruptScales, scale_problem_records

    corrupt = CorruptScales()
    corrupt.add(
        scale_problem_records("m.l0.attn.k_scale", torch.tensor([[[1.0]], [[-1.0]]]), num_heads=2)
    )
    corrupt.add(scale_problem_records("m.l1.attn.v_scale", torch.tensor(math.nan)))
    named = corrupt.renamed({"m.l0.attn.k_scale": "m.l0.k_proj.output_scale"})
    assert set(named.as_mapping()) == {"m.l0.k_proj.output_scale[head 1]", "m.l1.attn.v_scale"}
    assert set(corrupt.as_mapping()) == {"m.l0.attn.k_scale[head 1]", "m.l1.attn.v_scale"}
