from __future__ import annotations

import pytest

from kvscale_plugin.names import map_scale_name, names_attention_layer


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
