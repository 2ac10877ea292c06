"""`kvscale calibrate`: what it measures, the scales it derives, and the checkpoint it writes.

Real transformers models (the tiny local checkpoints); no engine. The recorded maxima are
checked against an independent path: the bf16 KV cache transformers itself fills with the
stock ``sdpa`` attention.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvscale_plugin import calibration as cal
from kvscale_plugin import fp8
from kvscale_plugin.checkpoint import open_checkpoint
from kvscale_plugin.cli import main as cli_main
from kvscale_plugin.demo.tinymodels import CORPUS
from kvscale_plugin.inspection import inspect_checkpoint
from kvscale_plugin.scheme import FP8_KV_SCHEME

TEXTS = cal.builtin_corpus("calibration")[:3]


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out.update({n: st.get_tensor(n) for n in st.keys()})
    return out


def _digest(model_dir: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(model_dir.iterdir())
        if p.is_file()
    }


def _cache_maxima(model_dir: Path, texts: list[str], max_len: int) -> tuple[dict, dict]:
    """Independent measurement: per layer and KV head, the abs max of what transformers'
    own bf16 KV cache holds after a forward with the stock sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    config = AutoConfig.from_pretrained(str(model_dir))
    # Without the KV-only compressed-tensors config, or transformers would attach
    # compressed-tensors' own KV fake-quantization to attention.
    del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        str(model_dir), config=config, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    k: dict[int, torch.Tensor] = {}
    v: dict[int, torch.Tensor] = {}
    with torch.inference_mode():
        for text in texts:
            ids = tok(text, return_tensors="pt", truncation=True, max_length=max_len)["input_ids"]
            cache = model(input_ids=ids, use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                assert layer.keys.dtype == torch.bfloat16
                km = layer.keys.abs().amax(dim=(0, 2, 3)).float()
                vm = layer.values.abs().amax(dim=(0, 2, 3)).float()
                k[i] = torch.maximum(k[i], km) if i in k else km
                v[i] = torch.maximum(v[i], vm) if i in v else vm
    return k, v


@pytest.fixture(scope="module")
def plain(tiny) -> Path:
    """Boosted tiny Llama, scheme declared but no scale tensors."""
    return tiny("cal-plain", num_layers=3, write_scales=False)


def test_scale_from_amax_shapes_and_floor():
    amax = torch.tensor([448.0, 896.0, 0.0])
    t = cal.scale_from_amax(amax, "tensor")
    assert t.dtype == torch.float32 and t.shape == (1,) and float(t) == 2.0
    h = cal.scale_from_amax(amax, "attn_head")
    assert h.shape == (3, 1, 1)
    assert h.reshape(-1).tolist() == [1.0, 2.0, cal.SCALE_FLOOR]
    # A dead layer never gets 0: engines reject 0 as corrupt.
    assert float(cal.scale_from_amax(torch.zeros(2), "tensor")) == cal.SCALE_FLOOR > 0
    with pytest.raises(ValueError):
        cal.scale_from_amax(amax, "channel")


def test_builtin_corpus_is_real_prose_with_disjoint_splits():
    calib, held = cal.builtin_corpus("calibration"), cal.builtin_corpus("heldout")
    assert len(calib) >= 32 and len(held) >= 16

    def sentences(texts: list[str]) -> set[str]:
        return {s for t in texts for s in re.split(r"(?<=[.!?])\s+", t) if len(s) >= 60}

    assert not sentences(calib) & sentences(held)  # held-out text is really held out
    words = " ".join(calib + held).split()
    assert len(words) > 15_000
    assert sum(w.lower() in {"the", "of", "and", "is", "a"} for w in words) / len(words) > 0.1
    lic = (cal.DATA_DIR / "calibration_corpus.LICENSE.txt").read_text()
    assert "PSF LICENSE AGREEMENT" in lic.upper() or "PYTHON SOFTWARE FOUNDATION LICENSE" in lic


def test_read_samples_jsonl_and_text(tmp_path):
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"text": "first sample"}\n\n"second sample"\n{"text": ""}\n')
    assert cal.read_samples(jl) == ["first sample", "second sample"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"nope": 1}\n')
    with pytest.raises(cal.CalibrationError, match=r"bad.jsonl:2"):
        cal.read_samples(bad)
    txt = tmp_path / "s.txt"
    paras = [("word " * 30).strip() + f" {i}." for i in range(10)]
    txt.write_text("\n\n".join(paras))
    packed = cal.read_samples(txt, max_len=64)  # ~256 characters per sample
    assert 2 <= len(packed) < 10
    assert " ".join(" ".join(packed).split()) == " ".join(" ".join(paras).split())
    empty = tmp_path / "e.txt"
    empty.write_text("\n\n")
    with pytest.raises(cal.CalibrationError, match="no calibration text"):
        cal.read_samples(empty)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_recorded_maxima_equal_the_bf16_kv_cache(tiny, family):
    # qwen3 normalizes K per head (k-norm) before rotary: the cache holds neither the
    # projection output nor its rotation, and the observer must still match it.
    ckpt = tiny(f"cal-{family}", family=family, num_layers=2, write_scales=False)
    texts = [*CORPUS[:2], *TEXTS[:1]]
    model, tok = cal.load_model(ckpt)
    assert next(model.parameters()).dtype == torch.bfloat16  # the stored weights' dtype
    obs = cal.observe(model, tok, texts, max_len=96, progress=False)
    k_ref, v_ref = _cache_maxima(ckpt, texts, 96)
    names = [f"model.layers.{i}.self_attn" for i in range(2)]
    assert sorted(obs.k_amax) == names
    for i, name in enumerate(names):
        assert obs.k_amax[name].shape == (2,)  # per KV head
        assert torch.equal(obs.k_amax[name], k_ref[i]), (name, obs.k_amax[name], k_ref[i])
        assert torch.equal(obs.v_amax[name], v_ref[i])
    assert obs.num_samples == 3 and obs.num_tokens == sum(
        min(96, len(tok(t)["input_ids"])) for t in texts
    )


def test_keys_are_observed_after_rotary_not_at_the_projection(plain):
    # A second independent path: K by hand from the k_proj output and the model's rotary.
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model, tok = cal.load_model(plain)
    proj: dict[int, torch.Tensor] = {}
    handles = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda _m, _i, out, i=i: proj.__setitem__(i, out.detach())
        )
        for i, layer in enumerate(model.model.layers)
    ]
    obs = cal.observe(model, tok, TEXTS[:1], max_len=128, progress=False)
    for h in handles:
        h.remove()
    differs = 0
    for i, k_lin in proj.items():
        k = k_lin.view(1, k_lin.shape[1], -1, 64).transpose(1, 2)  # [b, kv_heads, seq, d]
        pos = torch.arange(k.shape[2])[None]
        cos, sin = model.model.rotary_emb(k, pos)
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
        by_hand = k_rot.abs().amax(dim=(0, 2, 3)).float()
        assert torch.equal(obs.k_amax[f"model.layers.{i}.self_attn"], by_hand)
        differs += not torch.equal(by_hand, k.abs().amax(dim=(0, 2, 3)).float())
    assert differs  # the projection's maxima are not what the cache holds


def test_write_checkpoint_single_file(plain, tmp_path):
    before = _digest(plain)
    scales = {
        f"model.layers.{i}.self_attn": (torch.tensor([1.5 + i]), torch.tensor([0.25]))
        for i in range(3)
    }
    out = cal.write_checkpoint(
        plain, tmp_path / "out", scales, "tensor", record={"samples": "test"}
    )
    assert _digest(plain) == before  # MODEL_DIR untouched
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"] == FP8_KV_SCHEME
    assert cfg["quantization_config"]["quant_method"] == "compressed-tensors"
    src, new = _tensors(plain), _tensors(out)
    assert set(new) == set(src) | {f"{n}.{k}_scale" for n in scales for k in "kv"}
    for name, t in src.items():
        assert torch.equal(new[name], t)
    for i in range(3):
        k = new[f"model.layers.{i}.self_attn.k_scale"]
        assert k.dtype == torch.float32 and k.shape == (1,) and float(k) == 1.5 + i
    # The tokenizer is linked, not copied.
    assert (out / "tokenizer.json").stat().st_ino == (plain / "tokenizer.json").stat().st_ino
    assert json.loads((out / cal.CALIBRATION_RECORD).read_text())["samples"] == "test"
    assert inspect_checkpoint(out).exit_status == 0
    assert not list(tmp_path.glob(".*kvscale-tmp*"))


def test_write_checkpoint_refuses_existing_out_and_model_dir(plain, tmp_path):
    scales = {
        f"model.layers.{i}.self_attn": (torch.tensor([2.0]), torch.tensor([2.0])) for i in range(3)
    }
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(cal.CalibrationError, match="already exists; pass --force"):
        cal.write_checkpoint(plain, out, scales, "tensor")
    assert (out / "keep.txt").read_text() == "mine"
    cal.write_checkpoint(plain, out, scales, "tensor", force=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    for bad_out in (plain, plain / "sub", plain.parent):
        with pytest.raises(cal.CalibrationError, match="outside"):
            cal.write_checkpoint(plain, bad_out, scales, "tensor", force=True)
    with pytest.raises(cal.CalibrationError, match="positive finite"):
        cal.write_checkpoint(
            plain,
            tmp_path / "x",
            {"model.layers.0.self_attn": (torch.tensor([0.0]), torch.tensor([1.0]))},
            "tensor",
        )


def test_write_checkpoint_sharded_replaces_old_scales_and_links_weights(tiny, tmp_path):
    # Sharded, with old scales under the older llm-compressor naming (k_proj.output_scale).
    src = tiny("cal-sharded", num_layers=4, num_shards=3, naming="output_scale")
    before = _digest(src)
    old = {n for n in _tensors(src) if n.endswith("output_scale")}
    assert len(old) == 8
    scales = {
        f"model.layers.{i}.self_attn": (torch.full((2, 1, 1), 3.0 + i), torch.full((2, 1, 1), 0.5))
        for i in range(4)
    }
    out = cal.write_checkpoint(src, tmp_path / "out", scales, "attn_head")
    assert _digest(src) == before
    new = _tensors(out)
    assert not old & set(new)  # old scales dropped: the new ones are the only ones
    assert new["model.layers.3.self_attn.k_scale"].shape == (2, 1, 1)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    ckpt = open_checkpoint(out)  # index and shard headers agree
    assert set(index["weight_map"]) == set(ckpt.tensors) == set(new)
    assert index["weight_map"]["model.layers.0.self_attn.v_scale"] == cal.SCALES_SHARD
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in ckpt.tensors.values())
    # Shards without old scales are hard links of the originals; the others rewritten.
    linked = [
        f.name
        for f in out.glob("model-0000*.safetensors")
        if f.stat().st_ino == (src / f.name).stat().st_ino
    ]
    rewritten = {
        f.name
        for f in src.glob("model-0000*.safetensors")
        if any(n.endswith("output_scale") for n in _tensors_in(f))
    }
    assert rewritten
    assert set(linked) == {f.name for f in src.glob("model-0000*.safetensors")} - rewritten
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"


def _tensors_in(f: Path) -> list[str]:
    with safe_open(str(f), framework="pt") as st:
        return list(st.keys())


def test_quantization_config_merging():
    weight_qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"]}},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    merged = cal.quantization_config_with_kv({"quantization_config": weight_qc}, "tensor")
    assert merged["config_groups"] == weight_qc["config_groups"]  # weight schemes kept
    assert merged["format"] == "int-quantized" and merged["ignore"] == ["lm_head"]
    assert merged["kv_cache_scheme"]["strategy"] == "tensor"
    fresh = cal.quantization_config_with_kv({}, "attn_head")
    assert fresh["config_groups"] == {} and fresh["kv_cache_scheme"]["strategy"] == "attn_head"
    with pytest.raises(cal.CalibrationError, match="'fp8', not compressed-tensors"):
        cal.quantization_config_with_kv({"quantization_config": {"quant_method": "fp8"}}, "tensor")


def test_cli_calibrate_tensor_and_attn_head(plain, tmp_path, capsys):
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "cal"
    args = [
        "calibrate",
        str(plain),
        "--out",
        str(out),
        "--samples",
        str(samples),
        "--num-samples",
        "2",
        "--max-len",
        "64",
    ]
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert "model.layers.2.self_attn" in text and "kvscale inspect: clean" in text
    record = json.loads((out / cal.CALIBRATION_RECORD).read_text())
    assert record["num_samples"] == 2 and record["num_tokens"] == 128
    tensors = _tensors(out)
    for i in range(3):
        name = f"model.layers.{i}.self_attn"
        for kind in "kv":
            amax = max(record[f"{kind}_amax"][name])
            assert amax > 448  # the boosted model's K/V exceed FP8's range
            assert float(tensors[f"{name}.{kind}_scale"]) == pytest.approx(amax / 448, rel=1e-6)
    assert cli_main(args) == 2  # exists
    assert "already exists; pass --force" in capsys.readouterr().err

    head_out = tmp_path / "cal-head"
    assert cli_main([*args[:3], str(head_out), *args[4:], "--scheme", "attn_head"]) == 0
    rec = json.loads((head_out / cal.CALIBRATION_RECORD).read_text())
    heads = _tensors(head_out)
    for i in range(3):
        name = f"model.layers.{i}.self_attn"
        k = heads[f"{name}.k_scale"]
        assert k.shape == (2, 1, 1) and k.dtype == torch.float32
        want = [a / 448 for a in rec["k_amax"][name]]
        assert k.reshape(-1).tolist() == pytest.approx(want, rel=1e-6)
        assert max(want) == pytest.approx(float(tensors[f"{name}.k_scale"]), rel=1e-6)
    assert (
        json.loads((head_out / "config.json").read_text())["quantization_config"][
            "kv_cache_scheme"
        ]["strategy"]
        == "attn_head"
    )


def test_cli_calibrate_bad_input(tmp_path, capsys):
    assert cli_main(["calibrate", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_scale_floor_is_documented_value():
    assert cal.SCALE_FLOOR == torch.finfo(torch.float32).eps


def test_fp8_constants_are_torchs():
    """The core's torch-free constants are torch's own values, bit for bit."""
    assert fp8.FP8_E4M3_MAX == float(torch.finfo(torch.float8_e4m3fn).max)
    assert math.isclose(fp8.FP8_E4M3_MAX, 448.0)
    assert fp8.FLOAT32_EPS == torch.finfo(torch.float32).eps
    assert fp8.FLOAT32_MAX == torch.finfo(torch.float32).max
    assert fp8.scale_shape(None) == (1,)
    assert fp8.scale_shape(4) == (4, 1, 1)
    assert fp8.per_head_shape_ok(fp8.scale_shape(4), 4)


def test_package_exports_every_public_name():
    """``kvscale_plugin.calibration`` re-exports its modules' API, loaded on first use."""
    import kvscale_plugin.calibration as package

    assert set(package.__all__) == set(package._EXPORTS)
    # A submodule named like an exported name would replace it once imported.
    modules = {
        m: importlib.import_module(f"{package.__name__}.{m}") for m in package._EXPORTS.values()
    }
    assert not set(modules) & set(package.__all__)
    for name in package.__all__:
        assert getattr(package, name) is getattr(modules[package._EXPORTS[name]], name)
    with pytest.raises(AttributeError):
        package.no_such_name  # noqa: B018


@pytest.mark.slow  # a transformers model run (~12 s): `make test`, not `make test-fast`
def test_layers_that_read_another_layers_cache_get_no_scales(tmp_path):
    """A tiny Gemma-4 whose layers 2 and 3 read layers 0 and 1's KV cache: transformers
    hands those layers the shared keys and values, but only the writing layers get scales
    (a sharing layer serves its target's), and inspect calls the result clean."""
    from kvscale_testing.shared_kv import build_shared_kv_checkpoint

    src = build_shared_kv_checkpoint(tmp_path / "gemma4")
    result = cal.calibrate(src, tmp_path / "out", num_samples=2, progress=False)
    assert sorted(result.scales) == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    written = sorted(n for n in _tensors(tmp_path / "out") if n.endswith("_scale"))
    assert written == [f"model.layers.{i}.self_attn.{k}_scale" for i in (0, 1) for k in "kv"]
    report = inspect_checkpoint(tmp_path / "out")
    assert report.exit_status == 0
    shared = {r.layer: r for r in report.layers if "reads_shared_kv" in r.problems}
    assert set(shared) == {"model.layers.2.self_attn", "model.layers.3.self_attn"}
    assert shared["model.layers.2.self_attn"].kvscale.outcome == "shared"
