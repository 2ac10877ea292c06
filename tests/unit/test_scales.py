from __future__ import annotations

import math

import pytest
import torch

from kvscale_plugin.scales import (
    SENTINEL,
    CorruptScaleError,
    ScaleSource,
    check_scales,
    resolve_kv_scales,
    scale_problem,
)


def test_both_loaded_are_used():
    r = resolve_kv_scales(2.5, 3.5)
    assert (r.k, r.v, r.source) == (2.5, 3.5, ScaleSource.CHECKPOINT)


def test_neither_loaded_is_one():
    r = resolve_kv_scales(SENTINEL, SENTINEL)
    assert (r.k, r.v, r.source) == (1.0, 1.0, ScaleSource.DEFAULT)


@pytest.mark.parametrize(("k", "v"), [(4.0, SENTINEL), (SENTINEL, 4.0)])
def test_single_scale_is_used_for_both(k, v):
    r = resolve_kv_scales(k, v)
    assert (r.k, r.v, r.source) == (4.0, 4.0, ScaleSource.DUPLICATED)


def test_fnuz_doubles_loaded_scales_but_not_the_default():
    r = resolve_kv_scales(2.0, 3.0, fnuz=True)
    assert (r.k, r.v) == (4.0, 6.0)
    assert resolve_kv_scales(SENTINEL, SENTINEL, fnuz=True).k == 1.0
    assert resolve_kv_scales(2.0, SENTINEL, fnuz=True).v == 4.0


@pytest.mark.parametrize("bad", [0.0, -2.0, math.nan, math.inf, -math.inf])
def test_corrupt_values_are_rejected(bad):
    assert scale_problem(bad) is not None
    with pytest.raises(CorruptScaleError):
        resolve_kv_scales(bad, 1.0)


def test_non_scalar_is_rejected():
    assert "per-tensor" in scale_problem(torch.ones(4))
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
