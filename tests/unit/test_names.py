from __future__ import annotations

import pytest

from kvscale_plugin.names import map_scale_name, mtp_layer_ordinal, names_attention_layer


@pytest.mark.parametrize("host", ["vllm", "sglang"])
@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("model.layers.3.self_attn.k_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.v_scale", "model.layers.3.self_attn.attn.v_scale"),
        ("model.layers.3.self_attn.q_scale", "model.layers.3.self_attn.attn.q_scale"),
        ("model.layers.3.self_attn.attn.k_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.k_proj.k_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.v_proj.v_scale", "model.layers.3.self_attn.attn.v_scale"),
        ("model.layers.3.self_attn.qkv_proj.k_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.qkv_proj.v_scale", "model.layers.3.self_attn.attn.v_scale"),
        ("model.layers.3.self_attn.k_proj.output_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.v_proj.output_scale", "model.layers.3.self_attn.attn.v_scale"),
        ("model.layers.3.self_attn.kv_scale", "model.layers.3.self_attn.attn.k_scale"),
        ("model.layers.3.self_attn.k_zero_point", "model.layers.3.self_attn.attn.k_zero_point"),
        ("mtp.layers.0.self_attn.k_scale", "mtp.layers.0.self_attn.attn.k_scale"),
        ("model.layers.48.self_attn.v_scale", "model.layers.48.self_attn.attn.v_scale"),
    ],
)
def test_builtin_conventions(host, name, expected):
    assert map_scale_name(name, host) == expected


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.weight_scale",
        "model.layers.0.self_attn.k_proj.input_scale",
        "model.layers.0.mlp.down_proj.weight_scale",
        "lm_head.weight",
    ],
)
def test_other_tensors_pass(name):
    assert map_scale_name(name, "vllm") is None


def test_unknown_host_passes():
    assert map_scale_name("model.layers.0.self_attn.k_scale", "tensorrt") is None


def test_legacy_kv_scale_warns_once(kvscale_warnings):
    map_scale_name("model.layers.0.self_attn.kv_scale", "vllm")
    map_scale_name("model.layers.1.self_attn.kv_scale", "vllm")
    assert len(kvscale_warnings("deprecated single 'kv_scale'")) == 1


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("model.layers.1.self_attn.attn.k_scale", True),
        ("model.layers.7.self_attn.attn.k_scale", False),  # a layer the model lacks
        # Checkpoint prefix differs from the host's (multimodal wrappers): same tail.
        ("model.language_model.layers.1.self_attn.attn.v_scale", True),
        ("mtp.layers.0.self_attn.attn.k_scale", True),  # cannot tell: the host decides
        ("lm_head.attn.k_scale", True),  # no layers.N tail: cannot tell
    ],
)
def test_names_attention_layer(target, expected):
    layers = [
        "language_model.model.layers.0.self_attn.attn",
        "language_model.model.layers.1.self_attn.attn",
    ]
    assert names_attention_layer(target, layers) is expected


@pytest.mark.parametrize(
    ("name", "num_hidden_layers", "expected"),
    [
        # MiMo: the MTP layers' own prefix, counted from 0.
        ("model.mtp_layers.0.self_attn.k_scale", 36, 0),
        ("model.mtp_layers.2.self_attn.v_proj.v_scale", 36, 2),
        # Qwen3-Next / Qwen3.5: `mtp.layers.N`, also under a multimodal prefix.
        ("mtp.layers.0.self_attn.k_scale", 48, 0),
        ("mtp.layers.1.self_attn.qkv_proj.v_scale", None, 1),
        ("model.mtp.layers.0.self_attn.k_scale", 48, 0),
        # GLM-4-MoE / DeepSeek-V3: the stack continues past num_hidden_layers.
        ("model.layers.46.self_attn.k_scale", 46, 0),
        ("model.layers.47.self_attn.k_scale", 46, 1),
        ("layers.61.self_attn.k_scale", 61, 0),
        ("model.language_model.layers.40.self_attn.k_scale", 40, 0),
        # The main stack, and names the stack depth cannot judge.
        ("model.layers.45.self_attn.k_scale", 46, None),
        ("model.layers.0.self_attn.k_scale", 2, None),
        ("model.layers.46.self_attn.k_scale", None, None),
        ("model.vision_tower.layers.50.self_attn.k_scale", 46, None),
        ("model.smtp_layers.0.self_attn.k_scale", 2, None),
    ],
)
def test_mtp_layer_ordinal(name, num_hidden_layers, expected):
    assert mtp_layer_ordinal(name, num_hidden_layers) == expected


def test_declared_mtp_layers_reads_every_count_field():
    from types import SimpleNamespace

    from kvscale_plugin.names import declared_mtp_layers

    assert declared_mtp_layers(SimpleNamespace(num_nextn_predict_layers=1)) == 1
    assert declared_mtp_layers(SimpleNamespace(mtp_num_hidden_layers=2)) == 2  # Qwen3.5
    # A multimodal config and its text config: the count may sit on either.
    assert declared_mtp_layers(SimpleNamespace(), SimpleNamespace(num_nextn_predict_layers=3)) == 3
    assert declared_mtp_layers(None, SimpleNamespace()) == 0
    assert declared_mtp_layers(SimpleNamespace(num_nextn_predict_layers=True)) == 0
    assert declared_mtp_layers(SimpleNamespace(num_nextn_predict_layers=-1)) == 0


# --- land_scale_name: judged by where the model's own translation takes a name ----------


def _substr(rules: dict[str, str]):
    def translate(name: str) -> str:
        for old, new in rules.items():
            name = name.replace(old, new, 1)
        return name

    return translate


def _same(name: str) -> str:
    return name


def test_land_model_translation_of_the_rules_answer():
    from kvscale_plugin.names import land_scale_name

    # GPT-OSS: the model renames .self_attn. -> .attn.; its attention is at layers.N.attn.attn
    name = "model.layers.0.self_attn.k_scale"
    mapped = map_scale_name(name, "vllm", "gpt_oss")
    landing = land_scale_name(
        name, mapped, _substr({".self_attn.": ".attn."}), {"model.layers.0.attn.attn"}
    )
    assert landing is not None
    assert (landing.emit, landing.target) == (mapped, "model.layers.0.attn.attn.k_scale")
    assert landing.kind == "k_scale"


def test_land_name_as_written_first():
    from kvscale_plugin.names import land_scale_name

    # The model's own translation of the name as written lands: it is kept as written,
    # whatever a rule answers.
    name = "model.layers.3.blk.k_scale"
    landing = land_scale_name(
        name,
        "model.layers.3.elsewhere.attn.k_scale",
        _substr({".blk.": ".blk.attn."}),
        {"model.layers.3.blk.attn", "model.layers.3.elsewhere.attn"},
    )
    assert landing is not None and landing.emit == name


@pytest.mark.parametrize(
    ("name", "translate", "layers", "emit", "target"),
    [
        # GPT-BigCode on vLLM's Transformers backend: transformer. -> model., attention at .attn
        (
            "transformer.h.1.attn.v_scale",
            _substr({"transformer.": "model."}),
            {"model.h.0.attn.attn", "model.h.1.attn.attn"},
            "transformer.h.1.attn.attn.v_scale",
            "model.h.1.attn.attn.v_scale",
        ),
        # Jamba: .self_attn. -> . ; attention at layers.N.attn
        (
            "model.layers.1.self_attn.k_scale",
            _substr({".self_attn.": "."}),
            {"model.layers.1.attn"},
            "model.layers.1.self_attn.attn.k_scale",
            "model.layers.1.attn.k_scale",
        ),
        # Falcon-H1: the rules' answer is already the parameter path
        (
            "model.layers.0.self_attn.k_scale",
            _same,
            {"model.layers.0.self_attn.attn"},
            "model.layers.0.self_attn.attn.k_scale",
            "model.layers.0.self_attn.attn.k_scale",
        ),
    ],
)
def test_land_per_model_translation(name, translate, layers, emit, target):
    from kvscale_plugin.names import land_scale_name

    landing = land_scale_name(name, map_scale_name(name, "vllm", None), translate, layers)
    assert landing is not None
    assert (landing.emit, landing.target) == (emit, target)


def test_land_nowhere_or_ambiguous_is_none():
    from kvscale_plugin.names import land_scale_name

    # No attention module under the named one.
    assert (
        land_scale_name(
            "model.layers.7.self_attn.k_scale", None, _same, {"model.layers.0.self_attn.attn"}
        )
        is None
    )
    # Two attention modules under the named module: not guessed.
    two = {"model.layers.0.a.attn", "model.layers.0.b.attn"}
    assert land_scale_name("model.layers.0.k_scale", None, _same, two) is None
    # Not a scale kind at all.
    assert land_scale_name("model.layers.0.self_attn.weight", None, _same, two) is None
    # A translation that drops the name.
    assert land_scale_name("model.layers.0.self_attn.k_scale", None, lambda n: None, two) is None


def test_loaded_form_is_a_tail_of_a_landing():
    from kvscale_plugin.names import is_loaded_form

    layers = {"language_model.model.layers.0.self_attn.attn"}
    assert is_loaded_form("model.layers.0.self_attn.attn.k_scale", layers)
    assert is_loaded_form("language_model.model.layers.0.self_attn.attn.v_scale", layers)
    assert not is_loaded_form("model.layers.0.self_attn.k_scale", layers)
    assert not is_loaded_form("model.layers.0.self_attn.attn.weight", layers)
