"""Hostile checkpoints on disk through ``kvscale inspect``, fuzzed with hypothesis.

Each case writes a small checkpoint directory (``config.json`` + raw safetensors
bytes, written by hand so that headers can lie) and runs the command path in-process
(``inspection.run_inspect``, ``--json`` and the text table, hosts vllm and sglang).

The contract: the exit status is 0, 1 or 2; with ``--json`` the output is strict JSON
whose ``exit_status`` is the status (and, for 2, an ``error`` object); unusable input
is reported as ``kvscale inspect: error: <file>: ...`` -- never an unexplained
exception. Damage the format defines as fatal (truncation, a header length or tensor
offsets past the end of the file, byte counts that do not match dtype x shape, garbage
JSON, overlapping tensors, gaps or trailing bytes in the data section -- what the
safetensors library refuses -- and an index naming a missing shard or disagreeing with
its shards) must be exit 2.

Every case also runs through inspect's former torch path (``kvscale_testing.
inspect_reference``: scale tensors decoded by torch, every scheme parsed by
compressed-tensors): the output (status, stdout, stderr; ``--json`` and text) must be the
same, byte for byte.

Counts of cases (inspect runs) per kind of damage are printed at the end of the module.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import struct
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvscale_testing.inspect_reference import torch_path

from kvscale_plugin.inspection import run_inspect
from kvscale_plugin.scheme import FP8_KV_SCHEME

COUNTS: Counter[str] = Counter()
OUTCOMES: Counter[str] = Counter()
N_CHECKPOINTS = 900

_BASE = settings(
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[
        HealthCheck.function_scoped_fixture,
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
    ],
)


def fuzz(examples: int) -> settings:
    """Settings of one fuzz target: ``examples`` cases, no deadline, no example database."""
    return settings(_BASE, max_examples=examples)


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    lines = [
        "fuzz cases (inspect runs): "
        + ", ".join(f"{k}={v}" for k, v in sorted(COUNTS.items()))
        + f", total={sum(COUNTS.values())}",
        "inspect outcomes: " + ", ".join(f"{k}={v}" for k, v in sorted(OUTCOMES.items())),
    ]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capman = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capman is not None:
        with capman.global_and_fixture_disabled():
            reporter.write_line("")
            for line in lines:
                reporter.write_line(line)
    else:  # pragma: no cover
        print("\n".join(lines))


# ------------------------------------------------------------------ writing by hand

TORCH_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# dtypes torch cannot decode here, or that the format does not know.
ODD_DTYPES = ("F8_E8M0", "U16", "U32", "U64", "F4", "F6_E2M3", "XYZ", "", "f32")


def encode(dtype: str, shape: list[int], values: list[float]) -> bytes:
    """The safetensors bytes of ``values`` as ``dtype`` (unknown dtypes: filler bytes)."""
    numel = math.prod(shape)
    if dtype not in TORCH_DTYPES:
        size = {"F8_E8M0": 1, "U16": 2, "U32": 4, "U64": 8}.get(dtype, 1)
        return bytes((i * 37) % 256 for i in range(numel * size))
    src = torch.tensor(
        (values * (numel // max(len(values), 1) + 1))[:numel] or [0.0], dtype=torch.float64
    )[:numel].reshape(shape)
    torch_dtype = TORCH_DTYPES[dtype]
    if not torch_dtype.is_floating_point:
        src = torch.nan_to_num(src, nan=0.0, posinf=5.0, neginf=-5.0).clamp(-100, 100)
    t = src.to(torch_dtype).contiguous()
    return t.reshape(-1).view(torch.uint8).numpy().tobytes() if numel else b""


def safetensors_bytes(tensors: dict[str, tuple[str, list[int], bytes]]) -> tuple[dict, bytes]:
    """A well-formed header (contiguous offsets) and the data section."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    data = b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    return header, data


def pack(header: Any, data: bytes, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode() if not isinstance(header, bytes) else header
    return struct.pack("<Q", len(raw) if length is None else length) + raw + data


# ------------------------------------------------------------------ strategies

JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**66), 2**66),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
)
JSON_VALUES = st.recursive(
    JSON_SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)
    ),
    max_leaves=5,
)
SCHEMES = st.one_of(
    st.just(dict(FP8_KV_SCHEME)),
    st.just({**FP8_KV_SCHEME, "strategy": "attn_head"}),
    st.just({**FP8_KV_SCHEME, "strategy": "channel"}),
    st.just({"num_bits": 8, "type": "float"}),
    st.just({**FP8_KV_SCHEME, "type": "int"}),
    st.just({**FP8_KV_SCHEME, "num_bits": "eight", "strategy": []}),
    st.none(),
    JSON_VALUES,
)
NAMES = (
    "model.layers.{i}.self_attn.k_scale",
    "model.layers.{i}.self_attn.v_scale",
    "model.layers.{i}.self_attn.q_scale",
    "model.layers.{i}.self_attn.kv_scale",
    "model.layers.{i}.self_attn.k_proj.k_scale",
    "model.layers.{i}.self_attn.v_proj.v_scale",
    "model.layers.{i}.self_attn.qkv_proj.k_scale",
    "model.layers.{i}.self_attn.k_proj.output_scale",
    "model.layers.{i}.self_attn.k_zero_point",
    "model.layers.{i}.self_attn.attn.k_scale",
    "mtp.layers.{i}.self_attn.k_scale",
    "model.mtp_layers.{i}.self_attn.v_scale",
    "model.layers.{i}.mlp.k_scale",
    "lm_head.v_scale",
    "model.layers.{i}.self_attn.o_proj.weight",
    "model.embed_tokens.weight",
    "weird..k_scale",
    "model.layers.-1.self_attn.k_scale",
)
VALUES = st.sampled_from(
    [
        0.0,
        -0.0,
        -1.0,
        -2.5,
        math.nan,
        math.inf,
        -math.inf,
        1e-45,
        1e-310,
        3.5e38,
        1e300,
        65504.0,
        1.0,
        2.5,
        0.125,
        448.0,
    ]
)
SHAPES = st.sampled_from([[], [1], [2], [4], [2, 1, 1], [4, 1, 1], [0], [1, 1], [2, 2], [3]])


@st.composite
def tensor_sets(draw: st.DrawFn) -> dict[str, tuple[str, list[int], bytes]]:
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for _ in range(draw(st.integers(0, 7))):
        name = draw(st.sampled_from(NAMES)).format(i=draw(st.sampled_from([0, 1, 2, 3, 99])))
        if draw(st.integers(0, 12)) == 0:
            name = draw(st.text(min_size=1, max_size=20)) + ".k_scale"
        dtype = draw(st.sampled_from([*TORCH_DTYPES] * 2 + list(ODD_DTYPES[:4])))
        shape = draw(SHAPES)
        values = draw(st.lists(VALUES, min_size=1, max_size=4))
        tensors[name] = (dtype, shape, encode(dtype, shape, values))
    if draw(st.booleans()):  # a "weight" too big to decode, never read
        tensors["model.layers.0.mlp.down_proj.weight"] = ("BF16", [64, 64], bytes(64 * 64 * 2))
    return tensors


@st.composite
def configs(draw: st.DrawFn) -> Any:
    if draw(st.integers(0, 15)) == 0:
        return draw(JSON_VALUES)  # not even an object
    cfg: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_size": 256,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "kv_cache_scheme": draw(SCHEMES),
        },
    }
    for key in list(cfg):
        how = draw(st.sampled_from(["keep"] * 5 + ["drop", "hostile"]))
        if how == "drop":
            del cfg[key]
        elif how == "hostile":
            cfg[key] = draw(JSON_VALUES)
    if draw(st.integers(0, 5)) == 0:
        cfg["num_hidden_layers"] = draw(st.sampled_from([0, -1, 1, 3, 10**9, 2.5, "2"]))
    if draw(st.integers(0, 5)) == 0:
        cfg["num_key_value_heads"] = draw(st.sampled_from([0, -2, 1, 3, 4, 10**12, None, "2"]))
    if draw(st.integers(0, 6)) == 0:
        cfg["text_config"] = draw(st.one_of(JSON_VALUES, st.just(dict(cfg))))
    if draw(st.integers(0, 6)) == 0:
        cfg["layer_types"] = draw(st.one_of(JSON_VALUES, st.just(["full_attention", "mamba"])))
    if draw(st.integers(0, 8)) == 0:
        cfg["num_nextn_predict_layers"] = draw(st.sampled_from([1, -1, 10**6, "x"]))
    return cfg


# Damage, and whether it must end in exit status 2.
FATAL = {
    "truncate": True,
    "header_length_long": True,
    "header_length_short": True,
    "header_length_huge": True,
    "offsets_past_eof": True,
    "wrong_byte_count": True,
    "header_not_json": True,
    "header_not_object": True,
    "entry_not_object": True,
    "bad_shape": True,
    "bad_offsets": True,
    "empty_file": True,
    "index_missing_shard": True,
    "index_garbage": True,
    "index_no_weight_map": True,
    "index_wrong_shard": True,
    "config_garbage": True,
    "config_missing": True,
    "config_not_utf8": True,
    "no_weights": True,
    # The safetensors library (hence every engine) refuses these, and so does inspect.
    "overlapping": True,
    "gap": True,
    "trailing_bytes": True,
    # A dtype name the format does not know is refused; a known one with matching bytes is not.
    "odd_dtype_name": False,
    "none": False,
}


def _mutate(kind: str, root: Path, header: dict, data: bytes, draw: st.DrawFn) -> None:
    """Write ``model.safetensors`` (and maybe an index / config) damaged as ``kind``."""
    target = root / "model.safetensors"
    names = [n for n in header if n != "__metadata__"]
    sized = [n for n in names if header[n]["data_offsets"][1] > header[n]["data_offsets"][0]]
    if kind in ("offsets_past_eof", "wrong_byte_count", "overlapping", "gap") and not sized:
        kind = "truncate"  # nothing to lie about: damage the file instead
    if kind in ("entry_not_object", "bad_shape", "bad_offsets", "odd_dtype_name") and not names:
        kind = "header_not_object"
    blob = pack(header, data)
    if kind == "truncate":
        blob = blob[: draw(st.integers(0, len(blob) - 1))]
    elif kind == "header_length_long":
        raw = json.dumps(header).encode()
        blob = pack(raw, data, len(raw) + draw(st.integers(1, max(1, len(data) + 8))))
    elif kind == "header_length_short":
        raw = json.dumps(header).encode()
        blob = pack(raw, data, draw(st.integers(0, len(raw) - 1)))
    elif kind == "header_length_huge":
        huge = draw(st.sampled_from([2**63, 10**9, 2**64 - 1]))
        blob = pack(json.dumps(header).encode(), data, huge)
    elif kind == "empty_file":
        blob = draw(st.sampled_from([b"", b"\x00" * 7, b"\x01\x00"]))
    elif kind == "header_not_json":
        raw = draw(st.sampled_from([b"{not json", b"\xff\xfe\x00", b"[1, 2", b"{}}", b"  "]))
        blob = pack(raw, data)
    elif kind == "header_not_object":
        blob = pack(draw(st.sampled_from([[], [1], "x", 3, None])), data)
    else:
        h = json.loads(json.dumps(header))
        if kind == "offsets_past_eof":
            n = draw(st.sampled_from(sized))
            begin, end = h[n]["data_offsets"]
            extra = draw(st.integers(1, 1000))
            h[n]["data_offsets"] = [begin + extra, end + extra]
            if not draw(st.booleans()):
                h[n]["data_offsets"] = [begin, len(data) + extra]
            if h[n]["data_offsets"][1] <= len(data):
                h[n]["data_offsets"][1] = len(data) + 1
        elif kind == "wrong_byte_count":
            n = draw(st.sampled_from(sized))
            begin, end = h[n]["data_offsets"]
            if h[n]["dtype"] not in TORCH_DTYPES and h[n]["dtype"] not in (
                "U16",
                "U32",
                "U64",
                "F8_E8M0",
            ):
                h[n]["dtype"] = "F32"
            # Claim another dtype or shape for the same bytes.
            if draw(st.booleans()):
                h[n]["dtype"] = {
                    "F64": "F32",
                    "F32": "F16",
                    "F16": "F32",
                    "BF16": "F64",
                    "I64": "I8",
                }.get(h[n]["dtype"], "F64")
            else:
                h[n]["shape"] = [*h[n]["shape"], 3] if h[n]["shape"] else [5]
            h[n]["data_offsets"] = [begin, end]
        elif kind == "overlapping":
            n = draw(st.sampled_from(sized))
            others = [m for m in names if m != n]
            if others:
                h[draw(st.sampled_from(others))] = dict(h[n])  # same bytes twice
            else:  # a single tensor cannot overlap another: claim one byte too few
                h[n]["data_offsets"] = [h[n]["data_offsets"][0], h[n]["data_offsets"][1] - 1]
        elif kind == "gap":
            n = draw(st.sampled_from(sized))
            begin, end = h[n]["data_offsets"]
            h[n]["data_offsets"] = [begin, end]
            data = data + bytes(end - begin)
            h[n]["data_offsets"] = [len(data) - (end - begin), len(data)]
        elif kind == "trailing_bytes":
            data = data + b"\x00" * draw(st.integers(1, 64))
        elif kind == "entry_not_object":
            h[draw(st.sampled_from(names))] = draw(st.sampled_from([[], 1, "x", None]))
        elif kind == "bad_shape":
            h[draw(st.sampled_from(names))]["shape"] = draw(
                st.sampled_from([[-1], "x", [1.5], None, [True, "a"], {"a": 1}])
            )
        elif kind == "bad_offsets":
            h[draw(st.sampled_from(names))]["data_offsets"] = draw(
                st.sampled_from([[4, 0], [-4, 0], [0], "0-4", None, [0, 1, 2], [0.0, 4.0]])
            )
        elif kind == "odd_dtype_name":
            h[draw(st.sampled_from(names))]["dtype"] = draw(st.sampled_from(ODD_DTYPES))
        blob = pack(h, data)
    target.write_bytes(blob)


@st.composite
def damaged_checkpoints(draw: st.DrawFn) -> tuple[Any, dict, str]:
    # Half the cases are readable files (hostile configs and values), half are damaged.
    kind = draw(st.sampled_from(sorted(FATAL) + ["none"] * len(FATAL)))
    return draw(configs()), draw(tensor_sets()), kind


_dirs = iter(range(10**9))


def _write_case(base: Path, config: Any, tensors: dict, kind: str, draw: st.DrawFn) -> Path:
    root = base / f"c{next(_dirs)}"
    root.mkdir()
    if kind == "config_garbage":
        (root / "config.json").write_text(draw(st.sampled_from(["{", "", "null x", "{'a': 1}"])))
    elif kind == "config_not_utf8":
        (root / "config.json").write_bytes(b"\xff\xfe{\x00}")
    elif kind != "config_missing":
        (root / "config.json").write_text(json.dumps(config))
    header, data = safetensors_bytes(tensors)
    if kind.startswith("index_"):
        names = list(tensors) or ["model.layers.0.self_attn.k_scale"]
        half = len(names) // 2
        parts = {
            "model-00001-of-00002.safetensors": names[:half],
            "model-00002-of-00002.safetensors": names[half:],
        }
        weight_map = {n: f for f, ns in parts.items() for n in ns}
        for fname, ns in parts.items():
            h, d = safetensors_bytes({n: tensors[n] for n in ns if n in tensors})
            (root / fname).write_bytes(pack(h, d))
        index: Any = {"metadata": {}, "weight_map": weight_map}
        if kind == "index_missing_shard":
            weight_map[names[0]] = "model-00003-of-00002.safetensors"
        elif kind == "index_garbage":
            index = draw(st.sampled_from([b"{", b"\xff\xff", b"[1,", b""]))
        elif kind == "index_no_weight_map":
            index = draw(st.sampled_from([{}, {"weight_map": []}, {"weight_map": {"a": 1}}, []]))
        elif kind == "index_wrong_shard":
            weight_map[names[0]] = (
                "model-00002-of-00002.safetensors"
                if weight_map[names[0]].startswith("model-00001")
                else "model-00001-of-00002.safetensors"
            )
        text = index if isinstance(index, bytes) else json.dumps(index).encode()
        (root / "model.safetensors.index.json").write_bytes(text)
    elif kind == "no_weights":
        if draw(st.booleans()):
            (root / "pytorch_model.bin").write_bytes(b"not read")
    elif kind == "none":
        (root / "model.safetensors").write_bytes(pack(header, data))
    else:
        _mutate(kind, root, header, data, draw)
    return root


def _run(root: Path, as_json: bool, host: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = run_inspect(str(root), as_json=as_json, host=host)
    return status, out.getvalue(), err.getvalue()


def _same_as_torch_path(root: Path, as_json: bool, host: str, got: tuple[int, str, str]) -> None:
    """The former torch path prints exactly ``got`` for this checkpoint."""
    with torch_path():
        reference = _run(root, as_json, host)
    COUNTS["torch_path"] += 1
    assert got == reference


def _no_constants(name: str) -> None:
    raise AssertionError(f"non-standard JSON constant {name}")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz-inspect")


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
@fuzz(N_CHECKPOINTS)
@given(damaged_checkpoints(), st.data())
def test_inspect_hostile_checkpoints(
    base: Path, case: tuple[Any, dict, str], data: st.DataObject
) -> None:
    config, tensors, kind = case
    root = _write_case(base, config, tensors, kind, data.draw)
    host = data.draw(st.sampled_from(["vllm", "vllm", "sglang"]))
    status, out, err = _run(root, True, host)
    COUNTS[kind] += 1
    _same_as_torch_path(root, True, host, (status, out, err))
    assert status in (0, 1, 2)
    doc = json.loads(out, parse_constant=_no_constants)
    assert doc["exit_status"] == status and doc["schema_version"] == 1
    if status == 2:
        assert doc["error"]["type"] == "CheckpointError" and doc["error"]["message"]
        assert err.startswith("kvscale inspect: error: "), err
        assert str(root) in err
    bad_config = not isinstance(config, dict) or kind.startswith("config_")
    if FATAL[kind] or bad_config:
        assert status == 2, (kind, config, doc.get("problems"))
    OUTCOMES[f"{kind}->{status}"] += 1
    # The text table over the same input: same status, no exception.
    text = _run(root, False, host)
    COUNTS["text:" + ("fatal" if FATAL[kind] else "readable")] += 1
    _same_as_torch_path(root, False, host, text)
    assert text[0] == status


@pytest.mark.slow  # the full fuzz budget: `make test`, not `make test-fast`
def test_budget_ran() -> None:
    assert sum(COUNTS.values()) >= N_CHECKPOINTS * 1.8, COUNTS
    assert COUNTS["torch_path"] >= N_CHECKPOINTS * 2, COUNTS


# ------------------------------------------------------------------ named cases


def _ckpt(tmp_path: Path, tensors: dict, name: str = "model.safetensors") -> Path:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "quantization_config": {
            "quant_method": "compressed-tensors",
            "config_groups": {},
            "kv_cache_scheme": dict(FP8_KV_SCHEME),
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    header, data = safetensors_bytes(tensors)
    (tmp_path / name).write_bytes(pack(header, data))
    return tmp_path


GOOD = {
    "model.layers.0.self_attn.k_scale": ("F32", [], encode("F32", [], [2.0])),
    "model.layers.0.self_attn.v_scale": ("F32", [], encode("F32", [], [3.0])),
}


def test_good_checkpoint_is_fine(tmp_path: Path) -> None:
    status, out, _ = _run(_ckpt(tmp_path, GOOD), True, "vllm")
    COUNTS["named"] += 1
    assert status == 0, out


@pytest.mark.parametrize("cut", [0, 4, 8, 20, -1])
def test_truncated_shard_is_exit_2(tmp_path: Path, cut: int) -> None:
    root = _ckpt(tmp_path, GOOD)
    blob = (root / "model.safetensors").read_bytes()
    (root / "model.safetensors").write_bytes(blob[:cut] if cut >= 0 else blob[:-1])
    status, _, err = _run(root, False, "vllm")
    COUNTS["named"] += 1
    assert status == 2 and "truncated" in err, err


def test_index_naming_a_missing_shard_is_exit_2(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, GOOD, name="model-00001-of-00002.safetensors")
    (root / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "weight_map": {
                    "model.layers.0.self_attn.k_scale": "model-00001-of-00002.safetensors",
                    "model.layers.0.self_attn.v_scale": "model-00002-of-00002.safetensors",
                }
            }
        )
    )
    status, _, err = _run(root, False, "vllm")
    COUNTS["named"] += 1
    assert status == 2 and "model-00002-of-00002.safetensors" in err and "missing" in err


@pytest.mark.parametrize("damage", ["overlapping", "gap", "trailing"])
def test_gaps_in_the_data_section_are_detected(tmp_path: Path, damage: str) -> None:
    header, data = safetensors_bytes(GOOD)
    if damage == "overlapping":
        header["model.layers.0.self_attn.v_scale"]["data_offsets"] = [0, 4]
    elif damage == "gap":
        header["model.layers.0.self_attn.v_scale"]["data_offsets"] = [8, 12]
        data += bytes(4)
    else:
        data += bytes(4)
    root = _ckpt(tmp_path, GOOD)
    (root / "model.safetensors").write_bytes(pack(header, data))
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    with pytest.raises(SafetensorError):  # what an engine's loader does with this file
        load_file(root / "model.safetensors")
    status, _, err = _run(root, False, "vllm")
    COUNTS["named"] += 1
    assert status == 2
    assert f"{root / 'model.safetensors'}: corrupt safetensors file" in err
    assert "(safetensors: " in err and "Re-download or re-export" in err


def test_float16_scheme_is_reported_not_raised(tmp_path: Path) -> None:
    root = _ckpt(tmp_path, GOOD)
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["kv_cache_scheme"] = {"num_bits": 16, "type": "float"}
    (root / "config.json").write_text(json.dumps(cfg))
    status, _, _ = _run(root, True, "vllm")
    COUNTS["named"] += 1
    assert status in (0, 1)


ALL_DTYPES = (*TORCH_DTYPES, "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0", "U16", "U32", "U64")


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
@pytest.mark.parametrize("host", ["vllm", "sglang"])
def test_same_output_as_the_torch_path(tmp_path: Path, strategy: str, host: str) -> None:
    """Every dtype, hostile values, scalars, per-head shapes and zero points: the former
    torch path prints the same, byte for byte."""
    values = [0.0, -1.0, math.nan, math.inf, 1e-45, 1e300, 1e-310, 3.5e38, 0.125, 448.0, 2.5]
    tensors: dict[str, tuple[str, list[int], bytes]] = {}
    for i, dtype in enumerate(ALL_DTYPES):
        layer = f"model.layers.{i}.self_attn"
        for what, shape in (("k_scale", [1]), ("v_scale", [2, 1, 1]), ("q_scale", [4])):
            vals = values[len(tensors) % len(values) :] + values
            tensors[f"{layer}.{what}"] = (dtype, shape, encode(dtype, shape, vals))
        tensors[f"{layer}.v_zero_point"] = (dtype, [], encode(dtype, [], values[i:]))
    root = _ckpt(tmp_path, tensors)
    cfg = json.loads((root / "config.json").read_text())
    cfg["num_hidden_layers"] = len(ALL_DTYPES)
    cfg["quantization_config"]["kv_cache_scheme"]["strategy"] = strategy
    (root / "config.json").write_text(json.dumps(cfg))
    for as_json in (True, False):
        got = _run(root, as_json, host)
        assert got[0] == 1 and "corrupt_value" in got[1], got
        _same_as_torch_path(root, as_json, host, got)


@pytest.mark.parametrize("architectures", [[[None]], [{"a": 1}], [5], []])
def test_odd_architectures_are_no_architecture(tmp_path: Path, architectures: Any) -> None:
    """Found by the fuzzer: a list as ``architectures[0]`` raised TypeError (unhashable)."""
    root = _ckpt(tmp_path, GOOD)
    cfg = json.loads((root / "config.json").read_text())
    cfg["architectures"] = architectures
    (root / "config.json").write_text(json.dumps(cfg))
    status, out, _ = _run(root, True, "vllm")
    COUNTS["named"] += 1
    assert status == 0, out
