"""Hostile inputs through the core, fuzzed with hypothesis.

* ``scheme.judge_kv_cache_scheme``: ``kv_cache_scheme`` values of every wrong type,
  unknown and missing fields, absurd numbers -> never raises; always a verdict that is
  "not declared", "supported" or "unsupported, with a reason". Every judged scheme the
  plain-Python reading answers (``scheme._plain_args``, what inspect uses to avoid
  importing compressed-tensors) gets the verdict compressed-tensors' own parse gives,
  field for field, with no warning the library would have printed; a second corpus stays
  near that reading's edges (llm-compressor's fields, boundary values of each).
* ``scales.scale_problems`` / ``check_scales`` (``kvscale_testing.scale_checks``: what a
  load does with a cycle's tensors, through the product's own calls): scale tensors of
  every dtype and shape (0-d, [1], [2], [H, 1, 1], [H], empty, ...) holding 0 / -0.0 /
  negative / -1.0 / NaN / +-inf / subnormal / huge values, per tensor and per head ->
  exactly the problems an
  independent oracle predicts, each keyed by the tensor (and head) name; ``check_scales``
  raises ``CorruptScaleError`` naming every bad tensor, or nothing.
* ``scales.resolve_kv_scales``: k / v as None, floats, per-head sequences, tensors, with
  the same values -> a valid ``ResolvedScales`` or ``CorruptScaleError`` naming k_scale /
  v_scale.

Every case run is counted; the counts are printed at the end of the module (and each
test asserts that its budget of examples really ran).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping
from typing import Any
from unittest import mock

import compressed_tensors.quantization  # noqa: F401 - imported before warnings are recorded
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvscale_testing.scale_checks import check_scales, scale_problem

from kvscale_plugin import scheme as scheme_module
from kvscale_plugin.scales import (
    SENTINEL,
    CorruptScaleError,
    ResolvedScales,
    ScaleSource,
    resolve_kv_scales,
    scale_problems,
)
from kvscale_plugin.scheme import FP8_KV_SCHEME, SchemeVerdict, judge_kv_cache_scheme

COUNTS: Counter[str] = Counter()

N_SCHEME = 300
N_PARITY = 1500
N_SCALES = 700
N_RESOLVE = 700

_BASE = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.data_too_large,
    ],
)


def fuzz(examples: int) -> settings:
    """Settings of one fuzz target: ``examples`` cases, no deadline, no example database."""
    return settings(_BASE, max_examples=examples)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    line = "fuzz cases (core): " + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()))
    line += f", total={sum(COUNTS.values())}"
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line)
    else:  # pragma: no cover - run without the terminal reporter
        print(line)


# ----------------------------------------------------------------- kv_cache_scheme

FIELDS = (
    "num_bits",
    "type",
    "symmetric",
    "group_size",
    "strategy",
    "block_structure",
    "dynamic",
    "actorder",
    "scale_dtype",
    "zp_dtype",
    "observer",
    "observer_kwargs",
)

ABSURD_NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 8, 4, 16, 2**31, 2**63, -(2**63), 1e308, -0.0, 8.0, 8.5, True]),
)
JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    ABSURD_NUMBERS,
    st.text(max_size=12),
    st.sampled_from(
        [
            "float",
            "int",
            "tensor",
            "attn_head",
            "channel",
            "group",
            "token",
            "block",
            "tensor_group",
            "FLOAT",
            " tensor",
            "true",
            "false",
            "8",
            "",
            "minmax",
            "static_minmax",
            "dynamic",
            "local",
            "bfloat16",
        ]
    ),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=8,
)
# Python values a JSON loader never produces, for "every wrong type".
ODD_VALUES = st.sampled_from(
    [b"bytes", (8,), {8}, frozenset(), object(), 3 + 4j, range(3), float, ..., torch.tensor(8)]
)
GOOD = {
    "num_bits": st.sampled_from([8, 4, 16]),
    "type": st.sampled_from(["float", "int"]),
    "symmetric": st.booleans(),
    "strategy": st.sampled_from(["tensor", "attn_head", "channel", "token", "group"]),
    "dynamic": st.sampled_from([False, True, "local"]),
    "group_size": st.sampled_from([None, 128]),
    "observer": st.sampled_from(["minmax", None]),
    "observer_kwargs": st.just({}),
}


@st.composite
def schemes(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["mapping", "mapping", "mapping", "json", "odd", "none"]))
    if kind == "json":
        return draw(JSON_VALUES)
    if kind == "odd":
        return draw(ODD_VALUES)
    if kind == "none":
        return None
    scheme: dict[Any, Any] = {}
    for name in FIELDS:
        how = draw(st.sampled_from(["good", "good", "missing", "json", "odd"]))
        if how == "good" and name in GOOD:
            scheme[name] = draw(GOOD[name])
        elif how == "json":
            scheme[name] = draw(JSON_VALUES)
        elif how == "odd":
            scheme[name] = draw(ODD_VALUES)
    extra = draw(
        st.dictionaries(st.one_of(st.text(max_size=10), st.integers()), JSON_VALUES, max_size=3)
    )
    for key, value in extra.items():
        scheme.setdefault(key, value)
    return scheme


def _check_verdict(scheme: Any, verdict: SchemeVerdict) -> None:
    assert isinstance(verdict, SchemeVerdict)
    assert isinstance(verdict.reason, str) and verdict.reason
    assert isinstance(verdict.describe(), str)
    if scheme is None:
        assert not verdict.declared and not verdict.supported
        return
    assert verdict.declared
    if verdict.supported:
        args = verdict.args
        assert args is not None
        assert str(getattr(args.type, "value", args.type)) == "float" and args.num_bits == 8
        assert str(getattr(args.strategy, "value", args.strategy)) in ("tensor", "attn_head")
        assert not args.dynamic and args.symmetric
        assert verdict.per_head == (
            str(getattr(args.strategy, "value", args.strategy)) == "attn_head"
        )
    else:
        assert not verdict.per_head


def _library_verdict(scheme: Any) -> SchemeVerdict:
    """The verdict with every scheme parsed by compressed-tensors' ``QuantizationArgs``."""
    with mock.patch.object(scheme_module, "_plain_args", lambda scheme: None):
        return judge_kv_cache_scheme(scheme)


def _check_parity(scheme: Any, verdict: SchemeVerdict) -> bool:
    """Where the plain reading answers, compressed-tensors agrees (and stays silent).
    Whether it answered."""
    if not isinstance(scheme, Mapping) or scheme_module._plain_args(scheme) is None:
        return False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        reference = _library_verdict(scheme)
    assert verdict == reference, scheme
    assert not caught, [str(w.message) for w in caught]
    return True


def _judge_checked(scheme: Any) -> None:
    COUNTS["scheme"] += 1
    verdict = judge_kv_cache_scheme(scheme)
    _check_verdict(scheme, verdict)
    COUNTS["scheme:plain" if _check_parity(scheme, verdict) else "scheme:library"] += 1


# Near the plain reading's edges: llm-compressor's value of a field, the field left out,
# or a value next to what the plain reading takes.
NEAR = {
    "num_bits": [8, 8.0, "8", True, 4, 16, 0, -8, None, 2**64],
    "type": ["float", "int", "FLOAT", "Float", " float", "complex", None, 1, ""],
    "symmetric": [True, False, "true", 1, 0, None, "no"],
    "group_size": [None, 128, -1, 0, -2, "x", 1.5],
    "strategy": [None, "tensor", "attn_head", "channel", "token", "group", "block"]
    + ["tensor_group", "TENSOR", "Attn_Head", "", " tensor", 0, False, [], "x"],
    "block_structure": [None, [128, 128], "2x4", [1], "x"],
    "dynamic": [False, True, "local", "LOCAL", "false", 0, 1, None, "x"],
    "actorder": [None, False, True, "group", "static", "x"],
    "scale_dtype": [None, "torch.float32", "bfloat16", "x", 3],
    "zp_dtype": [None, "torch.int8", "x"],
    "observer": [None, "minmax", "memoryless", "memoryless_minmax", "", 3, True],
    "observer_kwargs": [{}, {"a": 1}, {"averaging_constant": 0.01}, None, [], {"": None}],
}


@st.composite
def near_plain_schemes(draw: st.DrawFn) -> dict[Any, Any]:
    scheme: dict[Any, Any] = {}
    for name in FIELDS:
        how = draw(st.sampled_from(["llm-compressor"] * 5 + ["missing"] * 2 + ["near"] * 2))
        if how == "llm-compressor":
            scheme[name] = FP8_KV_SCHEME[name]
        elif how == "near":
            scheme[name] = draw(st.sampled_from(NEAR[name]))
    if draw(st.integers(0, 7)) == 0:
        scheme[draw(st.sampled_from(["colour", "Strategy", "num_bits ", 1]))] = None
    return scheme


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
@fuzz(N_PARITY)
@given(near_plain_schemes())
def test_plain_reading_agrees_with_compressed_tensors(scheme: dict[Any, Any]) -> None:
    _judge_checked(scheme)
    COUNTS["parity"] += 1


@pytest.mark.parametrize(
    "scheme",
    [
        FP8_KV_SCHEME,
        {**FP8_KV_SCHEME, "strategy": "attn_head"},
        {**FP8_KV_SCHEME, "observer": "minmax"},
        {"num_bits": 8, "type": "float"},
        {"num_bits": 8, "type": "float", "strategy": "attn_head", "symmetric": True},
        {},
        {**FP8_KV_SCHEME, "type": "int"},
        {**FP8_KV_SCHEME, "strategy": "channel"},
        {**FP8_KV_SCHEME, "symmetric": False},
        {**FP8_KV_SCHEME, "dynamic": True},
        {**FP8_KV_SCHEME, "dynamic": True, "strategy": "token", "observer": "memoryless"},
    ],
)
def test_plain_reading_answers_llm_compressor_schemes(scheme: dict[str, Any]) -> None:
    """What llm-compressor writes (and one field off) is read without compressed-tensors,
    with the library's verdict."""
    assert scheme_module._plain_args(scheme) is not None
    assert _check_parity(scheme, judge_kv_cache_scheme(scheme))


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
def test_parity_budget_ran() -> None:
    assert COUNTS["parity"] >= N_PARITY, COUNTS
    # Both readings were exercised: the plain one answered, the library took the rest.
    assert COUNTS["scheme:plain"] >= N_PARITY // 5, COUNTS
    assert COUNTS["scheme:library"] >= N_PARITY // 5, COUNTS


HOSTILE_FIELD_VALUES = (None, "", [], {}, -1, 2**64, math.nan, math.inf, "tensor", True, b"x")


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
@fuzz(N_SCHEME)
@given(schemes(), st.integers(0, len(FIELDS) - 1))
def test_judge_never_raises(scheme: Any, field_index: int) -> None:
    """The drawn scheme, then each of its fields left out, then one field set to each
    hostile value: every one judged (each judged input counts as a case)."""
    _judge_checked(scheme)
    if not isinstance(scheme, dict):
        return
    for key in list(scheme):
        _judge_checked({k: v for k, v in scheme.items() if k != key})
    for value in HOSTILE_FIELD_VALUES:
        _judge_checked({**scheme, FIELDS[field_index]: value})


@pytest.mark.parametrize("bits", [16, 2, 32])
def test_judge_float_scheme_not_8_bit(bits: int) -> None:
    verdict = judge_kv_cache_scheme({"num_bits": bits, "type": "float"})
    assert verdict.declared and not verdict.supported and verdict.reason


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
def test_judge_budget_ran() -> None:
    assert COUNTS["scheme"] >= N_SCHEME * 5, COUNTS


def test_judge_named_hostile_schemes() -> None:
    """A few hand-picked ones, so the worst kinds are certainly in."""
    for scheme in (
        [],
        "fp8",
        8,
        8.0,
        True,
        float("nan"),
        {"num_bits": float("nan"), "type": "float"},
        {"num_bits": 2**70, "type": "int"},
        {"num_bits": -8, "type": "int"},
        {"num_bits": "eight", "type": 5, "strategy": []},
        {"type": {"nested": [1]}},
        {"": None},
        {1: 2},
        {"num_bits": 8, "type": "float", "strategy": "attn_head", "dynamic": "local"},
        {"num_bits": 8, "type": "float", "observer_kwargs": "x"},
        {},
    ):
        COUNTS["scheme"] += 1
        _check_verdict(scheme, judge_kv_cache_scheme(scheme))
    assert not judge_kv_cache_scheme({}).supported or judge_kv_cache_scheme({}).assumed


# ----------------------------------------------------------------- scale tensors

FLOAT_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
OTHER_DTYPES = (
    torch.int32,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int16,
    torch.complex64,
)
SPECIAL = (
    0.0,
    -0.0,
    -1.0,
    SENTINEL,
    -3.5,
    math.nan,
    -math.nan,
    math.inf,
    -math.inf,
    1e-45,
    1.4e-45,
    1e-40,
    1e-310,
    5e-324,
    6e-8,
    1e-30,
    3.4e38,
    3.5e38,
    1e300,
    65504.0,
    65520.0,
    448.0,
    57344.0,
    1e-3,
    1.0,
    2.5,
)
VALUES = st.one_of(
    st.sampled_from(SPECIAL),
    st.floats(allow_nan=True, allow_infinity=True, width=64),
    st.floats(min_value=1e-6, max_value=1e4),
)


@st.composite
def scale_inputs(draw: st.DrawFn) -> tuple[Any, int | None]:
    """(value, num_heads): a tensor of some dtype and shape, or a plain number."""
    num_heads = draw(st.sampled_from([None, None, 1, 2, 4, 8]))
    if draw(st.integers(0, 9)) == 0:
        return draw(st.one_of(VALUES, st.integers(-5, 5))), num_heads
    dtype = draw(st.sampled_from(FLOAT_DTYPES * 2 + OTHER_DTYPES))
    h = num_heads or draw(st.sampled_from([1, 2, 4]))
    shape = draw(
        st.sampled_from(
            [
                (),
                (1,),
                (2,),
                (h,),
                (h, 1, 1),
                (h, 1),
                (0,),
                (1, 1),
                (1, 1, 1),
                (h, 2, 1),
                (2, h),
                (h + 1,),
                (h + 1, 1, 1),
                (3,),
                (0, 1),
                (h, 1, 1, 1),
            ]
        )
    )
    numel = math.prod(shape)
    values = draw(st.lists(VALUES, min_size=numel, max_size=numel))
    source = torch.tensor(values, dtype=torch.float64).reshape(shape)
    if dtype.is_floating_point:
        tensor = source.to(dtype)
    elif dtype == torch.complex64:
        tensor = source.to(dtype)
    else:
        # NaN / inf / huge values cannot be cast to integers meaningfully: clamp first.
        tensor = torch.nan_to_num(source, nan=0.0, posinf=3.0, neginf=-3.0).clamp(-100, 100)
        tensor = tensor.to(dtype)
    return tensor, num_heads


# A calibrated scale lies in [2**-27, 1e4] (fp8.PLAUSIBLE_SCALE_MIN / _MAX), well inside
# what keeps 448 x scale a finite float32 (dequantizing the cache multiplies by it).
_MIN_SCALE, _MAX_SCALE = 2.0**-27, 1e4


def _bad(x: float) -> bool:
    return not (math.isfinite(x) and _MIN_SCALE <= x <= _MAX_SCALE)


def _oracle(name: str, value: Any, num_heads: int | None) -> set[str]:
    """The keys ``scale_problems`` must report, computed independently. Tensor elements
    are judged as float32 (the dtype the adapters store scales in): a float64 3.5e38 is
    inf there, a float64 1e-310 is 0."""
    if not isinstance(value, torch.Tensor):
        return {name} if _bad(float(value)) else set()
    if not value.is_floating_point():
        return {name}
    shape = tuple(value.shape)
    if num_heads is None:
        if value.numel() != 1:
            return {name}
        return {name} if _bad(float(value.float().item())) else set()
    ok_shape = len(shape) >= 1 and shape[0] == num_heads and all(d == 1 for d in shape[1:])
    if not ok_shape:
        return {name}
    flat = value.float().reshape(-1).tolist()
    return {f"{name}[head {i}]" for i, x in enumerate(flat) if _bad(x)}


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
@fuzz(N_SCALES)
@given(
    scale_inputs(),
    st.sampled_from(
        [
            "model.layers.0.self_attn.attn.k_scale",
            "mtp.layers.3.self_attn.v_scale",
            "x",
            "weird name.[]",
        ]
    ),
)
def test_scale_problems_match_oracle(case: tuple[Any, int | None], name: str) -> None:
    """The drawn value judged per tensor and against several KV-head counts (each
    judgement counts as a case)."""
    value, drawn_heads = case
    first = [int(value.shape[0])] if isinstance(value, torch.Tensor) and value.dim() else []
    for num_heads in dict.fromkeys([drawn_heads, None, 1, 2, 4, 8, *first]):
        _scale_case(name, value, num_heads)


def _scale_case(name: str, value: Any, num_heads: int | None) -> None:
    COUNTS["scale_problems"] += 1
    problems = scale_problems(name, value, num_heads=num_heads)
    assert set(problems) == _oracle(name, value, num_heads), (value, num_heads, problems)
    for key, why in problems.items():
        assert key.startswith(name) and isinstance(why, str) and why
    # The one-line variant agrees; check_scales raises exactly when there are problems.
    assert (scale_problem(value, num_heads=num_heads) is None) == (not problems)
    if problems:
        with pytest.raises(CorruptScaleError) as info:
            check_scales([(name, value)], num_heads=num_heads)
        for key in problems:
            assert key in str(info.value)
    else:
        check_scales([(name, value)], num_heads=num_heads)


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
def test_scale_budget_ran() -> None:
    assert COUNTS["scale_problems"] >= N_SCALES * 5, COUNTS


def test_check_scales_names_every_bad_tensor_at_once() -> None:
    named = [
        ("a.k_scale", torch.tensor(0.0)),
        ("a.v_scale", torch.tensor(2.0)),
        ("b.k_scale", torch.tensor([math.nan])),
        ("b.v_scale", torch.tensor(-1.0)),
        ("c.k_scale", torch.tensor(3, dtype=torch.int32)),
        ("c.v_scale", torch.empty(0)),
        ("d.k_scale", torch.tensor(1e-45)),
        ("d.v_scale", torch.tensor(1e30)),
        ("e.k_scale", torch.tensor(3e38)),
        ("f.k_scale", torch.tensor(2.0**-27)),
        ("f.v_scale", torch.tensor(1e4)),
    ]
    COUNTS["scale_problems"] += 1
    with pytest.raises(CorruptScaleError) as info:
        check_scales(named)
    text = str(info.value)
    bad = ("a.k_scale", "b.k_scale", "b.v_scale", "c.k_scale", "c.v_scale")
    # Positive and finite but no calibration gives them (uninitialised memory does).
    implausible = ("d.k_scale", "d.v_scale", "e.k_scale")
    for name in (*bad, *implausible):
        assert f"- {name}:" in text, text
    for name in ("d.k_scale", "d.v_scale"):
        assert "implausible" in text.split(f"- {name}:")[1].split("\n")[0], text
    for name in ("a.v_scale", "f.k_scale", "f.v_scale"):  # in range (edges included): servable
        assert f"- {name}:" not in text, text


# ----------------------------------------------------------------- resolve_kv_scales


@st.composite
def loaded_scale(draw: st.DrawFn, heads: int) -> Any:
    """One of k / v as an adapter or inspect passes it: None, a number, per-head values."""
    kind = draw(st.sampled_from(["none", "float", "int", "seq", "tuple", "tensor", "tensor0d"]))
    n = draw(st.sampled_from([heads, heads, heads + 1, 1]))
    if kind == "none":
        return None
    if kind == "float":
        return draw(VALUES)
    if kind == "int":
        return draw(st.integers(-3, 10))
    values = draw(st.lists(VALUES, min_size=n, max_size=n))
    if kind == "seq":
        return values
    if kind == "tuple":
        return tuple(values)
    if kind == "tensor0d":
        return torch.tensor(values[0], dtype=draw(st.sampled_from(FLOAT_DTYPES)))
    return torch.tensor(values, dtype=torch.float64).to(draw(st.sampled_from(FLOAT_DTYPES)))


def _elements(value: Any) -> list[float]:
    if isinstance(value, torch.Tensor):  # judged as float32, like the adapters store them
        return [float(x) for x in value.float().reshape(-1).tolist()]
    if isinstance(value, (int, float)):
        return [float(value)]
    return [float(x) for x in value]


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
@fuzz(N_RESOLVE)
@given(
    st.sampled_from([1, 2, 4]).flatmap(lambda h: st.tuples(loaded_scale(h), loaded_scale(h))),
    st.booleans(),
)
def test_resolve_kv_scales(kv: tuple[Any, Any], fnuz: bool) -> None:
    """(k, v), (v, k), k only and v only (each a case)."""
    k, v = kv
    for a, b in ((k, v), (v, k), (k, None), (None, v)):
        _resolve_case(a, b, fnuz)


def _resolve_case(k: Any, v: Any, fnuz: bool) -> None:
    COUNTS["resolve_kv_scales"] += 1
    loaded = {n: _elements(x) for n, x in (("k_scale", k), ("v_scale", v)) if x is not None}
    bad = {n for n, xs in loaded.items() if any(_bad(x) for x in xs)}
    mismatch = len(loaded) == 2 and len(loaded["k_scale"]) != len(loaded["v_scale"])
    if bad or mismatch:
        with pytest.raises(CorruptScaleError) as info:
            resolve_kv_scales(k, v, fnuz=fnuz)
        for n in bad | ({"v_scale"} if mismatch else set()):
            assert n in str(info.value)
        return
    resolved = resolve_kv_scales(k, v, fnuz=fnuz)
    assert isinstance(resolved, ResolvedScales)
    factor = 2.0 if fnuz else 1.0
    if not loaded:
        assert resolved.source is ScaleSource.DEFAULT and (resolved.k, resolved.v) == (1.0, 1.0)
        return
    k_heads = loaded.get("k_scale") or loaded["v_scale"]
    v_heads = loaded.get("v_scale") or loaded["k_scale"]
    assert resolved.k_heads == pytest.approx([x * factor for x in k_heads])
    assert resolved.v_heads == pytest.approx([x * factor for x in v_heads])
    assert resolved.k == max(resolved.k_heads) and resolved.v == max(resolved.v_heads)
    assert all(math.isfinite(x) or x == math.inf for x in (*resolved.k_heads, *resolved.v_heads))
    want = ScaleSource.CHECKPOINT if len(loaded) == 2 else ScaleSource.DUPLICATED
    assert resolved.source is want


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
def test_resolve_budget_ran() -> None:
    assert COUNTS["resolve_kv_scales"] >= N_RESOLVE * 4, COUNTS


@pytest.mark.parametrize(
    ("k", "v"), [((), None), (None, ()), ((), ()), (torch.empty(0), None), ([], [])]
)
def test_resolve_empty_scale_is_a_corrupt_scale_error(k: Any, v: Any) -> None:
    COUNTS["resolve_kv_scales"] += 1
    with pytest.raises(CorruptScaleError):
        resolve_kv_scales(k, v)
