"""`kvscale calibrate --check`: how a checkpoint's own k/v scales fit a text.

Real transformers models (the tiny local checkpoints, K/V boosted beyond FP8's 448); no
engine. Saturated fractions are checked against an independent path: the bf16 KV cache
transformers itself fills with the stock ``sdpa`` attention, divided by the scales by hand.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvscale_plugin import calibration as cal
from kvscale_plugin.calibration import check as chk
from kvscale_plugin.cli import main as cli_main

TEXTS = cal.builtin_corpus("calibration")[:3]
MAX_LEN = 64
LAYERS = [f"model.layers.{i}.self_attn" for i in range(3)]
#: ``--samples`` options for the CLI: the same three texts, the same length.
SAMPLE_ARGS = ["--num-samples", "3", "--max-len", str(MAX_LEN)]


def _digest(d: Path) -> dict[str, str]:
    return {
        str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


def _direct_saturation(
    model_dir: Path, scales: dict[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, dict[str, tuple[list[int], int]]]:
    """Independent count, per layer and kind: (saturated elements per KV head, elements per
    head) of transformers' own bf16 KV cache (stock sdpa) divided by the scales by hand."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = AutoConfig.from_pretrained(str(model_dir))
    del config.quantization_config  # or compressed-tensors attaches its KV fake-quantization
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    out: dict[str, dict[str, tuple[list[int], int]]] = {}
    with torch.inference_mode():
        for text in TEXTS:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=MAX_LEN)["input_ids"]
            cache = model(input_ids=ids, use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                name = f"model.layers.{i}.self_attn"
                for kind, x, s in (
                    ("k", layer.keys, scales[name][0]),
                    ("v", layer.values, scales[name][1]),
                ):
                    q = x.float() / s.float().reshape(1, -1, 1, 1)
                    sat = (q.abs() > 448 + 2**-15).sum(dim=(0, 2, 3)).tolist()
                    per_head = x.shape[0] * x.shape[2] * x.shape[3]
                    old_sat, old_n = out.setdefault(name, {}).get(kind, ([0] * len(sat), 0))
                    total = [a + b for a, b in zip(old_sat, sat, strict=True)]
                    out[name][kind] = (total, old_n + per_head)
    return out


@pytest.fixture(scope="module")
def calibrated(tiny, tmp_path_factory) -> Path:
    """A boosted tiny Llama (3 layers), calibrated per tensor on TEXTS."""
    plain = tiny("check-plain", num_layers=3, write_scales=False)
    out = tmp_path_factory.mktemp("check") / "calibrated"
    cal.calibrate(plain, out, texts=TEXTS, max_len=MAX_LEN, progress=False)
    return out


@pytest.fixture(scope="module")
def divided(calibrated, tmp_path_factory) -> Path:
    """``calibrated`` with layer 1's k and v scales and layer 2's v scale divided by 4."""
    scales = cal.read_scales(calibrated)
    k1, v1 = scales[LAYERS[1]]
    scales[LAYERS[1]] = (k1 / 4, v1 / 4)
    k2, v2 = scales[LAYERS[2]]
    scales[LAYERS[2]] = (k2, v2 / 4)
    out = tmp_path_factory.mktemp("check") / "divided"
    return cal.write_checkpoint(calibrated, out, scales, "tensor")


def test_scales_calibrated_on_the_same_text_do_not_saturate(calibrated, capsys):
    result = chk.check(calibrated, texts=TEXTS, max_len=MAX_LEN, progress=False)
    record = json.loads((calibrated / cal.CALIBRATION_RECORD).read_text())
    assert [r.layer for r in result.layers] == LAYERS and result.scheme == "tensor"
    for r in result.layers:
        assert r.source == "checkpoint" and not r.clips
        # The same maxima calibrate recorded, and the scale is amax / 448 (float32).
        assert r.k.amax == record["k_amax"][r.layer] and r.v.amax == record["v_amax"][r.layer]
        assert r.k.ratio == pytest.approx(1.0, abs=1e-6)
        assert r.v.ratio == pytest.approx(1.0, abs=1e-6)
        assert r.k.layer_amax > 448  # boosted: a scale of 1.0 would clip
    assert result.exit_status == 0 and result.num_tokens == record["num_tokens"]

    # The same texts from two --data files.
    first, second = calibrated.parent / "a.jsonl", calibrated.parent / "b.jsonl"
    first.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS[:2]))
    second.write_text(json.dumps({"text": TEXTS[2]}) + "\n")
    argv = ["calibrate", str(calibrated), "--check", "--max-len", "64"]
    assert cli_main([*argv, "--data", str(first), "--data", str(second)]) == 0
    text = capsys.readouterr().out
    assert "no saturation: 0 of 3 layers clip" in text and "exit status 0" in text
    assert "OUT_DIR" not in text  # nothing to fix


def test_divided_scales_saturate_in_those_layers(divided, capsys):
    before = _digest(divided)
    siblings = sorted(divided.parent.iterdir())
    result = chk.check(divided, texts=TEXTS, max_len=MAX_LEN, progress=False)
    rows = {r.layer: r for r in result.layers}
    assert not rows[LAYERS[0]].clips
    assert sum(rows[LAYERS[1]].k.saturated) and sum(rows[LAYERS[1]].v.saturated)
    assert not sum(rows[LAYERS[2]].k.saturated) and sum(rows[LAYERS[2]].v.saturated)
    assert rows[LAYERS[1]].k.ratio == pytest.approx(0.25, rel=1e-6)
    assert rows[LAYERS[2]].v.ratio == pytest.approx(0.25, rel=1e-6)
    assert rows[LAYERS[2]].k.ratio == pytest.approx(1.0, abs=1e-6)
    assert [r.layer for r in result.clipping] == LAYERS[1:] and result.exit_status == 1

    direct = _direct_saturation(divided, cal.read_scales(divided))
    for r in result.layers:
        for kind, got in (("k", r.k), ("v", r.v)):
            sat, n = direct[r.layer][kind]
            assert (got.saturated, got.elements) == (sat, n), (r.layer, kind)
            assert got.fraction == sum(sat) / (n * len(sat))
    assert 0 < rows[LAYERS[1]].k.fraction < 0.5

    args = ["calibrate", str(divided), "--check", *SAMPLE_ARGS]
    assert cli_main(args) == 1
    text = capsys.readouterr().out
    assert "SATURATES: 2 of 3 layers clip (K in 1, V in 2)" in text
    fix = f"kvscale calibrate {divided} --out OUT_DIR --num-samples 3 --max-len {MAX_LEN}"
    assert fix in text and "exit status 1" in text
    # --check writes nothing.
    assert _digest(divided) == before and sorted(divided.parent.iterdir()) == siblings


def test_per_head_scales_saturate_per_head(tiny, tmp_path, capsys):
    plain = tiny("check-heads", num_layers=2, write_scales=False, head_boost=(1.0, 3.0))
    good = tmp_path / "good"
    cal.calibrate(plain, good, scheme="attn_head", texts=TEXTS, max_len=MAX_LEN, progress=False)
    scales = cal.read_scales(good)
    k0, v0 = scales[LAYERS[0]]
    k0 = k0.clone()
    k0[0] /= 4  # head 0 of layer 0's K only
    scales[LAYERS[0]] = (k0, v0)
    bad = cal.write_checkpoint(good, tmp_path / "bad", scales, "attn_head")

    assert cli_main(["calibrate", str(good), "--check", *SAMPLE_ARGS, "--json"]) == 0
    clean = json.loads(capsys.readouterr().out)
    assert clean["scheme"] == "attn_head" and clean["summary"]["clipping_layers"] == 0
    assert cli_main(["calibrate", str(bad), "--check", *SAMPLE_ARGS, "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert (
        data["summary"]["clipping_layers"] == 1
        and "--scheme attn_head --num-samples 3" in data["fix"]
    )
    assert (
        data["summary"]["worst"]["layer"] == LAYERS[0] and data["summary"]["worst"]["kind"] == "k"
    )
    layer0 = data["layers"][0]
    heads = layer0["k"]["heads"]
    assert [h["ratio"] for h in heads] == [pytest.approx(0.25), pytest.approx(1.0, abs=1e-6)]
    assert heads[0]["saturated"] > 0 and heads[1]["saturated"] == 0
    assert all(h["saturated"] == 0 for h in layer0["v"]["heads"])
    assert heads[1]["amax"] > 2 * heads[0]["amax"]  # head_boost: heads need their own scales
    direct = _direct_saturation(bad, cal.read_scales(bad))
    sat, n = direct[LAYERS[0]]["k"]
    assert [h["saturated"] for h in heads] == sat and heads[0]["elements"] == n
    assert heads[0]["saturated_fraction"] == sat[0] / n

    assert cli_main(["calibrate", str(bad), "--check", *SAMPLE_ARGS]) == 1
    text = capsys.readouterr().out
    assert "  head 0" in text and "  head 1" in text


def test_json_output(divided, tmp_path, capsys):
    samples = tmp_path / "texts.txt"
    samples.write_text("\n\n".join(TEXTS))
    argv = ["calibrate", str(divided), "--check", "--samples", str(samples), "--max-len", "64"]
    assert cli_main([*argv, "--json"]) == 1
    captured = capsys.readouterr()
    data = json.loads(captured.out, parse_constant=lambda c: pytest.fail(f"JSON constant {c}"))
    assert set(data) == {
        "schema_version",
        "tool",
        "kvscale_version",
        "model_dir",
        "scheme",
        "fp8_max",
        "samples",
        "layers",
        "unscaled_layers",
        "summary",
        "inspect_problems",
        "fix",
        "exit_status",
    }
    assert data["tool"] == "kvscale calibrate --check" and data["exit_status"] == 1
    assert data["samples"]["source"] == str(samples) and data["fp8_max"] == 448
    assert data["fix"] == (
        f"kvscale calibrate {divided} --out OUT_DIR --samples {samples} --max-len {MAX_LEN}"
    )
    k = data["layers"][1]["k"]
    assert set(k) == {
        "amax",
        "amax_over_fp8_max",
        "scale",
        "ratio",
        "saturated",
        "elements",
        "saturated_fraction",
        "heads",
    }
    assert k["heads"] is None and k["amax_over_fp8_max"] == k["amax"] / 448
    assert k["saturated_fraction"] == k["saturated"] / k["elements"] > 0
    assert data["summary"]["clipping_layers"] == 2
    assert "loaded" in captured.err  # progress goes to stderr, stdout is only the JSON


def _with_config(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    edit(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_bad_input_exits_2_with_a_clear_message(tiny, calibrated, tmp_path, capsys):
    def run(*argv: str, as_json: bool = False) -> tuple[int, str, str]:
        rc = cli_main(["calibrate", *argv, *(["--json"] if as_json else [])])
        cap = capsys.readouterr()
        return rc, cap.out, cap.err

    rc, _, err = run(str(tmp_path), "--check")
    assert rc == 2 and "no config.json" in err
    rc, out, err = run(str(tmp_path), "--check", as_json=True)
    assert rc == 2 and json.loads(out)["exit_status"] == 2
    assert "no config.json" in json.loads(out)["error"]["message"]

    plain = tiny("check-plain", num_layers=3, write_scales=False)
    rc, _, err = run(str(plain), "--check")
    assert rc == 2 and "stores no k/v scale tensors" in err
    assert f"kvscale calibrate {plain} --out OUT_DIR" in err

    def no_scheme(c):
        c["quantization_config"]["kv_cache_scheme"] = None

    rc, _, err = run(str(_with_config(calibrated, tmp_path / "noscheme", no_scheme)), "--check")
    assert rc == 2 and "declares no kv_cache_scheme" in err

    def int8(c):
        c["quantization_config"]["kv_cache_scheme"]["type"] = "int"

    rc, _, err = run(str(_with_config(calibrated, tmp_path / "int8", int8)), "--check")
    assert rc == 2 and "kv_cache_scheme not supported" in err

    zero = tmp_path / "zero"
    shutil.copytree(calibrated, zero)
    sd = load_file(str(zero / "model.safetensors"))
    sd["model.layers.1.self_attn.v_scale"] = torch.zeros(1)
    save_file(sd, str(zero / "model.safetensors"), metadata={"format": "pt"})
    rc, _, err = run(str(zero), "--check")
    assert rc == 2 and "CorruptScaleError" in err and "model.layers.1.self_attn.v_scale" in err

    rc, _, err = run(str(calibrated), "--check", "--out", str(tmp_path / "o"))
    assert rc == 2 and "--check writes nothing" in err and not (tmp_path / "o").exists()
    rc, _, err = run(str(calibrated))
    assert rc == 2 and "--out OUT_DIR is required" in err
    rc, _, err = run(str(calibrated), "--out", str(tmp_path / "o"), as_json=True)
    assert rc == 2 and "--json is an option of --check" in err


def test_weight_quantized_checkpoint_is_checked_as_transformers_runs_it(calibrated, tmp_path):
    """Static FP8 W8A8 weights (compressed-tensors float-quantized, what llm-compressor's
    FP8 recipe stores) run through transformers' compressed-tensors path."""
    fp8 = tmp_path / "fp8"
    shutil.copytree(calibrated, fp8)
    sd = load_file(str(fp8 / "model.safetensors"))
    for name in [n for n in sd if n.endswith("_proj.weight")]:
        w = sd[name].float()
        s = w.abs().max() / 448
        sd[name] = (w / s).to(torch.float8_e4m3fn)
        sd[name.removesuffix("weight") + "weight_scale"] = s.reshape(1)
        sd[name.removesuffix("weight") + "input_scale"] = torch.tensor([0.05])
    save_file(sd, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
    args = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True}
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"].update(
        format="float-quantized",
        ignore=["lm_head"],
        config_groups={
            "group_0": {
                "targets": ["Linear"],
                "weights": {**args, "dynamic": False},
                "input_activations": {**args, "dynamic": False},
            }
        },
    )
    (fp8 / "config.json").write_text(json.dumps(cfg))

    result = chk.check(fp8, texts=TEXTS, max_len=MAX_LEN, progress=False)
    plain = chk.check(calibrated, texts=TEXTS, max_len=MAX_LEN, progress=False)
    assert [r.layer for r in result.layers] == LAYERS
    # The quantized weights and activations change K and V: not the bf16 model's maxima.
    assert [r.k.amax for r in result.layers] != [r.k.amax for r in plain.layers]
    for r, p in zip(result.layers, plain.layers, strict=True):
        assert r.k.scale == p.k.scale  # the same checkpoint scales, judged on other K/V
        assert r.k.ratio == pytest.approx(r.k.scale[0] * 448 / r.k.layer_amax)
