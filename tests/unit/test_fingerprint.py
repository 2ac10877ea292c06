"""``kvscale_plugin.fingerprint``: the canonical form a trainer and an engine agree on."""

from __future__ import annotations

import hashlib
import struct

import pytest
import torch

from kvscale_plugin.fingerprint import canonical_lines, digest, scale_fingerprint


def _hex(x: float) -> str:
    return struct.pack("<f", x).hex()


def test_canonical_lines_by_hand():
    tensors = {
        "model.layers.1.self_attn.v_scale": torch.tensor([2.5]),
        "model.layers.0.self_attn.k_scale": torch.tensor(3.5),
        "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(4.75),  # another naming
        "model.layers.0.self_attn.v_scale": torch.tensor([[[2.25]]]),
        "model.layers.0.self_attn.q_scale": torch.tensor(9.0),  # not part of it
        "model.layers.0.mlp.down_proj.weight": torch.ones(4, 4),  # not a scale
        "lm_head.k_scale": torch.tensor(1.0),  # not under layers.N
    }
    assert canonical_lines(tensors) == [
        f"0 k {_hex(3.5)}",
        f"0 v {_hex(2.25)}",
        f"1 k {_hex(4.75)}",
        f"1 v {_hex(2.5)}",
    ]
    expected = hashlib.sha256(
        ("kvscale-fp2\n" + "".join(f"{line}\n" for line in canonical_lines(tensors))).encode()
    ).hexdigest()[:16]
    assert scale_fingerprint(tensors) == expected == digest(canonical_lines(tensors))
    # A list of pairs (what a trainer hands load_weights) gives the same.
    assert scale_fingerprint(list(tensors.items())) == expected


def test_float32_exact_and_order_free():
    a = {"model.layers.0.self_attn.k_scale": torch.tensor(0.1, dtype=torch.float32)}
    b = {"model.layers.0.self_attn.k_scale": torch.tensor(0.1, dtype=torch.float64)}
    c = {"model.layers.0.self_attn.k_scale": torch.tensor(0.10000001, dtype=torch.float64)}
    assert scale_fingerprint(a) == scale_fingerprint(b)  # same float32
    assert scale_fingerprint(a) != scale_fingerprint(c)
    two = [
        ("model.layers.3.self_attn.v_scale", torch.tensor(2.0)),
        ("model.layers.3.self_attn.k_scale", torch.tensor(1.0)),
    ]
    assert scale_fingerprint(two) == scale_fingerprint(list(reversed(two)))


@pytest.mark.parametrize(
    ("heads", "tp_size", "kept"),
    [(4, 2, {0: [0, 1], 1: [2, 3]}), (2, 4, {0: [0], 1: [0], 2: [1], 3: [1]})],
)
def test_per_head_scales_are_the_ranks_heads(heads, tp_size, kept):
    values = [1.0 + h for h in range(heads)]
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor(values).reshape(heads, 1, 1)}
    for rank, own in kept.items():
        line = canonical_lines(tensors, tp_rank=rank, tp_size=tp_size)[0]
        assert line == "0 k " + ",".join(_hex(values[h]) for h in own)


def test_layers_filter_is_a_pipeline_stage():
    tensors = {f"model.layers.{i}.self_attn.k_scale": torch.tensor(1.0 + i) for i in range(4)}
    stage = {
        f"model.layers.{i}.self_attn.k_scale": tensors[f"model.layers.{i}.self_attn.k_scale"]
        for i in (2, 3)
    }
    assert scale_fingerprint(tensors, layers=[2, 3]) == scale_fingerprint(stage)
    assert scale_fingerprint(tensors, layers=[2, 3]) != scale_fingerprint(tensors)


def test_every_naming_the_engines_take_and_every_family_numbering():
    from kvscale_plugin.fingerprint import layer_index

    same = {
        "transformer.h.2.attn.k_scale": torch.tensor(3.5),  # GPT-BigCode, GPT-J
        "gpt_neox.layers.2.attention.v_scale": torch.tensor(2.5),  # GPT-NeoX
    }
    assert canonical_lines(same) == [f"2 k {_hex(3.5)}", f"2 v {_hex(2.5)}"]
    assert layer_index("model.language_model.layers.5.self_attn.attn") == 5
    assert layer_index("model.mtp.layers.0.self_attn.k_scale") is None  # a draft's own
    # k_proj.output_scale, and the legacy kv_scale for k and v
    other = {
        "model.layers.2.self_attn.k_proj.output_scale": torch.tensor(3.5),
        "model.layers.2.self_attn.v_proj.output_scale": torch.tensor(2.5),
    }
    assert canonical_lines(other) == canonical_lines(same)
    legacy = {"model.layers.4.self_attn.kv_scale": torch.tensor(1.5)}
    assert canonical_lines(legacy) == [f"4 k {_hex(1.5)}", f"4 v {_hex(1.5)}"]


def test_a_fingerprint_over_no_layer_is_an_error():
    from kvscale_plugin.fingerprint import FingerprintError

    with pytest.raises(FingerprintError, match="would check nothing"):
        scale_fingerprint({"model.embed_tokens.weight": torch.ones(2)})
    with pytest.raises(FingerprintError, match=r"among layers \[7\]"):
        scale_fingerprint({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, layers=[7])


def test_a_bf16_cache_is_fingerprinted_as_it_serves_unscaled():
    sent = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.05),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.04, 0.03]),
    }
    ones = {n: torch.ones_like(t) for n, t in sent.items()}
    assert scale_fingerprint(sent, applied=False) == scale_fingerprint(ones)
    assert scale_fingerprint(sent, applied=False) != scale_fingerprint(sent)
