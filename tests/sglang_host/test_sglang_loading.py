"""Tiny models built and loaded by SGLang's own loader: per-layer scales, namings, stock
comparison, scheme handling, corrupt scales, reloads."""

from __future__ import annotations

import math

import pytest

# "sglang.srt", not "sglang": this test folder itself is named sglang (see conftest).
import torch  # noqa: E402
from kvscale_testing.checkpoints import read_stored_scales  # noqa: E402
from sglang_helpers import (  # noqa: E402
    SCALES,
    SCALES_B,
    SCALES_C,
    assert_scales,
    attention_layers,
    build_model,
    layer_scales,
    reload,
    resolve_kv_cache_dtype,
)

from kvscale_plugin.scales import CorruptScaleError  # noqa: E402
from kvscale_plugin.scheme import FP8_KV_SCHEME  # noqa: E402

pytestmark = pytest.mark.usefixtures("sglang_runtime")

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mixtral")
NAMINGS = ("self_attn", "k_proj", "qkv_proj", "output_scale", "kv_scale")


def stored(ckpt) -> dict[int, tuple[float, float]]:
    return {i: (s["k"], s["v"]) for i, s in read_stored_scales(ckpt).items()}


def checkpoint(tiny, family: str, naming: str = "self_attn", scales=SCALES, **fields):
    return tiny(f"sgl-{family}-{naming}", family=family, naming=naming, scales=scales, **fields)


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_layer_gets_its_checkpoint_scales(tiny, family, naming):
    ckpt = checkpoint(tiny, family, naming)
    model, _ = build_model(ckpt)
    scales = layer_scales(model)
    assert_scales(scales, stored(ckpt))
    # Per-layer values really differ, so a layer mix-up cannot pass.
    assert len({s.k for s in scales.values()}) == len(scales)
    want = "duplicated" if naming == "kv_scale" else "checkpoint"
    assert {(s.method, s.source) for s in scales.values()} == {("KVScaleKVCacheMethod", want)}
    assert resolve_kv_cache_dtype(model, "auto") == ("fp8_e4m3", torch.float8_e4m3fn)
    if family == "mixtral":
        # SGLang routes Mixtral with a quantization name it does not know to
        # QuantMixtralForCausalLM; kvscale keeps the compressed-tensors model class.
        assert type(model).__name__ == "MixtralForCausalLM"


# What stock SGLang 0.5.23 (compressed-tensors auto-detected) does with the same
# checkpoints: "loaded", "1.0" (KV method present, scales dropped), "none" (attention
# built without quant_config: no KV method at all), or the exception it raises.
STOCK = {
    **{("llama", n): "loaded" for n in ("self_attn", "k_proj", "output_scale", "kv_scale")},
    ("llama", "qkv_proj"): "1.0",
    **{("qwen2", n): "1.0" for n in NAMINGS},
    **{("qwen3", n): "none" for n in NAMINGS},
    **{("qwen3_moe", n): "none" for n in NAMINGS},
    ("mixtral", "self_attn"): "1.0",
    ("mixtral", "kv_scale"): "1.0",
    **{("mixtral", n): "KeyError" for n in ("k_proj", "qkv_proj", "output_scale")},
}


@pytest.mark.parametrize("naming", NAMINGS)
@pytest.mark.parametrize("family", FAMILIES)
def test_stock_sglang_on_the_same_checkpoints(tiny, family, naming):
    ckpt = checkpoint(tiny, family, naming)
    expected = STOCK[(family, naming)]
    if expected == "KeyError":
        with pytest.raises(KeyError, match="self_attn"):
            build_model(ckpt, quantization=None)
        return
    model, model_config = build_model(ckpt, quantization=None)
    assert model_config.quantization == "compressed-tensors"
    scales = layer_scales(model)
    if expected == "loaded":
        assert_scales(scales, stored(ckpt))
    elif expected == "1.0":
        assert all(s.k == s.v == s.k_float == 1.0 for s in scales.values()), scales
    else:
        assert all(s.method is None and s.k is None for s in scales.values()), scales


def test_dense_qwen3_stock_drops_scales_kvscale_loads_them(tiny):
    ckpt = checkpoint(tiny, "qwen3")
    stock, _ = build_model(ckpt, quantization=None)
    # SGLang 0.5.23's Qwen3Attention builds RadixAttention without quant_config.
    assert all(s.k is None and s.k_float is None for s in layer_scales(stock).values())
    assert resolve_kv_cache_dtype(stock, "auto")[0] == "fp8_e4m3"  # FP8 pool, scales 1.0

    ours, _ = build_model(ckpt)
    assert_scales(layer_scales(ours), stored(ckpt))


def test_maybe_remap_kv_scale_name_maps_onto_kvscale_placeholders_only(tiny):
    from sglang.srt.model_loader.weight_utils import maybe_remap_kv_scale_name

    ckpt = checkpoint(tiny, "qwen3")
    name = "model.layers.1.self_attn.qkv_proj.k_scale"
    ours, _ = build_model(ckpt)
    assert maybe_remap_kv_scale_name(name, dict(ours.named_parameters())) == (
        "model.layers.1.self_attn.attn.k_scale"
    )
    # A stock model's parameters get SGLang's own answer (here: not loadable).
    llama, _ = build_model(checkpoint(tiny, "llama"), quantization=None)
    assert maybe_remap_kv_scale_name(name, dict(llama.named_parameters())) is None


UNSUPPORTED = {
    "int8": ({**FP8_KV_SCHEME, "type": "int"}, "type=int"),
    "fp4": ({**FP8_KV_SCHEME, "num_bits": 4}, "num_bits=4"),
    "channel": ({**FP8_KV_SCHEME, "strategy": "channel"}, "strategy=channel"),
    "dynamic": ({**FP8_KV_SCHEME, "dynamic": True}, "dynamic=true"),
    "asymmetric": ({**FP8_KV_SCHEME, "symmetric": False}, "symmetric=false"),
    "malformed": ({**FP8_KV_SCHEME, "num_bits": "eight"}, "malformed"),
}


@pytest.mark.parametrize("case", sorted(UNSUPPORTED))
def test_unsupported_scheme_builds_unscaled_with_one_warning(tiny, kvscale_warnings, case):
    scheme, reason = UNSUPPORTED[case]
    ckpt = tiny(f"sgl-unsupported-{case}", family="qwen3", kv_cache_scheme=scheme, scales=SCALES)
    model, _ = build_model(ckpt)
    scales = layer_scales(model)
    # The checkpoint carries valid-looking scales; none of them is applied.
    assert all(s.k == s.v == s.k_float == s.v_float == 1.0 for s in scales.values()), scales
    assert {s.source for s in scales.values()} == {"unscaled"}
    assert resolve_kv_cache_dtype(model, "auto") == (None, torch.bfloat16)
    warnings = kvscale_warnings("is not supported")
    assert len(warnings) == 1, warnings
    assert reason in warnings[0]


def test_stock_sglang_skips_unsupported_scheme(tiny):
    scheme, _ = UNSUPPORTED["channel"]
    ckpt = tiny("sgl-unsupported-channel-llama", kv_cache_scheme=scheme, scales=SCALES)
    model, _ = build_model(ckpt, quantization=None)
    assert all(s.method is None for s in layer_scales(model).values())


def test_scheme_without_scales_uses_one_and_warns_once(tiny, kvscale_warnings):
    ckpt = tiny("sgl-noscales", family="qwen2", write_scales=False)
    model, _ = build_model(ckpt)
    scales = layer_scales(model)
    assert all(s.k == s.v == s.k_float == s.v_float == 1.0 for s in scales.values())
    assert {s.source for s in scales.values()} == {"default"}
    warnings = kvscale_warnings("no k_scale/v_scale tensors")
    assert len(warnings) == 1, warnings
    assert "model.layers.0.self_attn.attn" in warnings[0]
    assert "model.layers.1.self_attn.attn" in warnings[0]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_no_scheme_is_unchanged(tiny, family):
    ckpt = tiny(f"sgl-no-scheme-{family}", family=family, kv_cache_scheme=None)
    ours, _ = build_model(ckpt)
    stock, _ = build_model(ckpt, quantization=None)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in stock.named_parameters()]
    assert not any("scale" in n or "zero_point" in n for n, _ in ours.named_parameters())
    assert layer_scales(ours) == layer_scales(stock)
    assert all(s.method is None and s.k is None for s in layer_scales(ours).values())
    assert resolve_kv_cache_dtype(ours, "auto") == resolve_kv_cache_dtype(stock, "auto")
    assert resolve_kv_cache_dtype(ours, "auto")[1] == torch.bfloat16


@pytest.mark.parametrize(("requested", "applied"), [("bf16", False), ("fp8_e4m3", True)])
def test_explicit_kv_cache_dtype_wins(tiny, requested, applied):
    from sglang.srt.runtime_context import get_model

    ckpt = checkpoint(tiny, "llama")
    with get_model().override(kv_cache_dtype=requested):
        model, _ = build_model(ckpt)
    scales = layer_scales(model)
    if applied:
        assert_scales(scales, stored(ckpt))
        assert resolve_kv_cache_dtype(model, requested)[1] == torch.float8_e4m3fn
    else:
        assert all(s.k == s.v == 1.0 and s.source == "unscaled" for s in scales.values())
        assert resolve_kv_cache_dtype(model, requested)[1] == torch.bfloat16


def test_corrupt_scales_fail_naming_every_tensor(tiny):
    bad = {0: (0.0, 2.0), 1: (-2.0, math.nan), 2: (math.inf, 2.0)}
    ckpt = tiny("sgl-corrupt", family="qwen3", num_layers=3, scales=bad)
    with pytest.raises(CorruptScaleError) as err:
        build_model(ckpt)
    text = str(err.value)
    # Named as the checkpoint writes them (SGLang's parameter is ``...self_attn.attn.k_scale``).
    for tensor, why in [
        ("model.layers.0.self_attn.k_scale", "0 (a zero scale"),
        ("model.layers.1.self_attn.k_scale", "negative"),
        ("model.layers.1.self_attn.v_scale", "NaN"),
        ("model.layers.2.self_attn.k_scale", "infinite"),
    ]:
        assert f"{tensor}: " in text and why in text, text
    assert "self_attn.attn." not in text and "model.layers.0.self_attn.v_scale" not in text


def test_zero_points_are_accepted_and_dropped(tiny, kvscale_warnings):
    ckpt = tiny(
        "sgl-zero-points",
        family="qwen3",
        scales=SCALES,
        extra_tensors={
            "model.layers.0.self_attn.k_zero_point": torch.tensor([3.0]),
            "model.layers.1.self_attn.v_zero_point": torch.tensor([0.0]),
        },
    )
    model, _ = build_model(ckpt)
    assert_scales(layer_scales(model), stored(ckpt))
    warnings = kvscale_warnings("non-zero zero point")
    assert len(warnings) == 1, warnings
    assert "model.layers.0.self_attn.attn.k_zero_point" in warnings[0]


@pytest.mark.parametrize("fnuz", [False, True], ids=["fp8", "fp8-fnuz"])
def test_reload_gives_latest_scales_in_place_without_compounding(tiny, monkeypatch, fnuz):
    from kvscale_plugin.hosts.sglang import method

    # On FP8-fnuz (ROCm MI300) every loaded scale is doubled, once.
    monkeypatch.setattr(method, "is_fp8_fnuz", lambda: fnuz)
    factor = 2.0 if fnuz else 1.0
    a = tiny("sgl-reload-a", family="qwen3", scales=SCALES)
    b = tiny("sgl-reload-b", family="qwen3", scales=SCALES_B)
    c = tiny("sgl-reload-c", family="qwen3", scales=SCALES_C)

    def expect(scales):
        return {i: (k * factor, v * factor) for i, (k, v) in scales.items()}

    model, model_config = build_model(a)
    first = layer_scales(model)
    assert_scales(first, expect(SCALES))
    for path, scales in ((b, SCALES_B), (c, SCALES_C), (b, SCALES_B)):
        reload(model, model_config, path)
        now = layer_scales(model)
        assert_scales(now, expect(scales))
        # Updated in place: the tensors kernels / CUDA graphs captured are the same.
        assert {n: s.k_ptr for n, s in now.items()} == {n: s.k_ptr for n, s in first.items()}

    # A reload that carries no scales (partial weight update) keeps the latest ones.
    for _ in range(2):
        reload(model, model_config, c, name_filter=lambda n: not n.endswith("_scale"))
        assert_scales(layer_scales(model), expect(SCALES_B))


def test_dummy_load_then_real_reload(tiny, kvscale_warnings):
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig, LoadFormat
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import get_model_loader

    ckpt = checkpoint(tiny, "qwen2")
    model_config = ModelConfig(str(ckpt), quantization="kvscale", dtype="bfloat16")
    loader = get_model_loader(LoadConfig(load_format=LoadFormat.DUMMY), model_config)
    model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    # No random "scales" from the dummy weights, and no missing-scales warning.
    assert all(s.k == s.v == s.k_float == 1.0 for s in layer_scales(model).values())
    assert kvscale_warnings("no k_scale/v_scale tensors") == []
    reload(model, model_config, ckpt)
    assert_scales(layer_scales(model), stored(ckpt))


def test_reload_legacy_kv_scale_no_stale_duplication(tiny):
    big = tiny("sgl-kv-big", naming="kv_scale", scales={0: (8.0, 1.0), 1: (6.0, 1.0)})
    small = tiny("sgl-kv-small", naming="kv_scale", scales={0: (0.5, 0.25), 1: (0.75, 0.5)})

    model, model_config = build_model(big)
    reload(model, model_config, small)
    assert_scales(layer_scales(model), {0: (0.5, 0.5), 1: (0.75, 0.75)})

    # Stock SGLang keeps the previous v_scale: k from the new checkpoint, v stale.
    stock, stock_config = build_model(big, quantization=None)
    reload(stock, stock_config, small)
    assert_scales(layer_scales(stock), {0: (0.5, 8.0), 1: (0.75, 6.0)})


def test_stock_sglang_compounds_fnuz_on_reload(tiny, monkeypatch):
    import sglang.srt.layers.quantization.kv_cache as sglang_kv_cache

    # Stock post-processing doubles whatever the parameters hold; after a reload that
    # carried no scales they hold the already doubled values.
    monkeypatch.setattr(sglang_kv_cache, "is_fp8_fnuz", lambda: True)
    ckpt = checkpoint(tiny, "llama")
    stock, stock_config = build_model(ckpt, quantization=None)
    assert_scales(layer_scales(stock), {i: (2 * k, 2 * v) for i, (k, v) in SCALES.items()})
    reload(stock, stock_config, ckpt, name_filter=lambda n: not n.endswith("_scale"))
    assert_scales(layer_scales(stock), {i: (4 * k, 4 * v) for i, (k, v) in SCALES.items()})


def test_attention_layers_are_found(tiny):
    # Guard for the helpers: every decoder layer has exactly one RadixAttention.
    model, _ = build_model(checkpoint(tiny, "qwen3_moe"))
    assert sorted(attention_layers(model)) == [
        "model.layers.0.self_attn.attn",
        "model.layers.1.self_attn.attn",
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_naming_zoo_and_stray_names(tiny, family, kvscale_warnings):
    # Layer i uses naming NAMINGS[i] (every convention in one checkpoint), plus zero
    # points, plus scales for layers this model does not have.
    extra = {
        f"model.layers.{i}.self_attn.{kind}_zero_point": torch.zeros(1)
        for i in range(len(NAMINGS))
        for kind in "kv"
    }
    extra["model.layers.7.self_attn.k_scale"] = torch.tensor([3.0])
    extra["model.layers.9.self_attn.v_proj.v_scale"] = torch.tensor([3.0])
    scales = {i: (1.0 + i, 0.5 + i) for i in range(len(NAMINGS))}
    ckpt = tiny(
        f"sgl-zoo-{family}",
        family=family,
        num_layers=len(NAMINGS),
        naming=NAMINGS,
        scales=scales,
        extra_tensors=extra,
    )
    model, _ = build_model(ckpt)
    assert_scales(layer_scales(model), stored(ckpt))
    # The stray names are not loaded (SGLang's loader skips them): one warning names both.
    warnings = kvscale_warnings("name no attention layer")
    assert len(warnings) == 1, warnings
    assert "model.layers.7.self_attn.k_scale" in warnings[0]
    assert "model.layers.9.self_attn.v_proj.v_scale" in warnings[0]


def test_third_party_rule_package(tiny, kvscale_warnings, monkeypatch):
    from importlib.metadata import entry_points

    from kvscale_plugin import names

    # A missing install must fail, not skip: scripts/setup_sglang_venv.sh installs it.
    assert "example_rules" in {ep.name for ep in entry_points(group="kvscale_plugin")}
    # rediscover the installed rule packages for this test
    monkeypatch.setattr(names, "plugin_manager", None)
    # A naming no built-in rule knows; only tests/rule_package maps it (host "sglang").
    invented = {}
    for i, (k, v) in SCALES.items():
        invented[f"model.layers.{i}.attention.kv_quant.k"] = torch.tensor([k])
        invented[f"model.layers.{i}.attention.kv_quant.v"] = torch.tensor([v])
    for family in ("qwen2", "qwen3"):
        ckpt = tiny(
            f"sgl-invented-{family}", family=family, write_scales=False, extra_tensors=invented
        )
        model, _ = build_model(ckpt)
        assert_scales(layer_scales(model), SCALES)
    # The deliberately broken rule package of the same distribution: at most one warning.
    assert len(kvscale_warnings("'broken_rules'")) == 1


def test_scheme_with_omitted_fields_uses_library_defaults(tiny, caplog):
    # Real checkpoints sometimes omit strategy / symmetric / dynamic.
    ckpt = tiny(
        "sgl-minimal-scheme",
        family="qwen2",
        scales=SCALES,
        kv_cache_scheme={"num_bits": 8, "type": "float"},
    )
    caplog.set_level("INFO", logger="kvscale_plugin")
    model, _ = build_model(ckpt)
    assert_scales(layer_scales(model), SCALES)
    assert resolve_kv_cache_dtype(model, "auto")[0] == "fp8_e4m3"
    assumed = [r.getMessage() for r in caplog.records if "defaults assumed" in r.getMessage()]
    assert assumed and "strategy=tensor" in assumed[0] and "symmetric=true" in assumed[0]
    # Stock SGLang requires an explicit strategy "tensor": it ignores the scheme.
    stock, _ = build_model(ckpt, quantization=None)
    assert all(s.method is None for s in layer_scales(stock).values())
    assert resolve_kv_cache_dtype(stock, "auto")[1] == torch.bfloat16


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_scale_under_a_module_with_one_attention_layer(tiny, family):
    # Scales stored on the decoder layer (``model.layers.N.k_scale``: no rule knows it):
    # the one attention layer under that module serves them (names.land_scale_name).
    under_layer = {}
    for i, (k, v) in SCALES.items():
        under_layer[f"model.layers.{i}.k_scale"] = torch.tensor([k])
        under_layer[f"model.layers.{i}.v_scale"] = torch.tensor([v])
    ckpt = tiny(
        f"sgl-under-layer-{family}", family=family, write_scales=False, extra_tensors=under_layer
    )
    model, _ = build_model(ckpt)
    assert_scales(layer_scales(model), SCALES)
