"""Name mapping on real vLLM engines: the naming zoo across model families, a
third-party rule package discovered through its entry point, unmapped names."""

from __future__ import annotations

import pytest
import torch
from kvscale_testing.checkpoints import checkpoint_scale_tensors, read_stored_scales
from kvscale_testing.probe import layer_index, layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.fingerprint import scale_fingerprint
from kvscale_plugin.hosts.vllm.live import worker_fingerprint

pytestmark = pytest.mark.engine

ZOO = ("self_attn", "k_proj", "qkv_proj", "output_scale", "kv_scale")


def _assert_loaded(ckpt, scales):
    stored = read_stored_scales(ckpt)
    assert len(scales) == len(stored)
    for name, s in scales.items():
        want = stored[layer_index(name)]
        assert (s.k, s.k_float, s.k_cpu) == pytest.approx((want["k"],) * 3, rel=1e-6), name
        assert (s.v, s.v_float, s.v_cpu) == pytest.approx((want["v"],) * 3, rel=1e-6), name
        assert s.pool_is_fp8


@needs_fp8_cpu_cache
@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "qwen3_moe"])
def test_naming_zoo_per_family(tiny, family):
    # Layer i uses naming ZOO[i]: every convention in one engine per family.
    zero_points = {
        f"model.layers.{i}.self_attn.{kind}_zero_point": torch.zeros(1)
        for i in range(len(ZOO))
        for kind in "kv"
    }
    ckpt = tiny(
        f"zoo-{family}", family=family, num_layers=len(ZOO), naming=ZOO, extra_tensors=zero_points
    )
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        _assert_loaded(ckpt, layer_scales(llm))
        (fp,) = llm.collective_rpc(worker_fingerprint)
    # Every naming of the zoo: the engine's fingerprint is the trainer side's of the
    # checkpoint's own tensors.
    sent = checkpoint_scale_tensors(ckpt)
    assert fp["fingerprint"] == scale_fingerprint(sent, layers=fp["layers"])
    assert fp["layers"] == list(range(len(ZOO)))


@needs_fp8_cpu_cache
def test_third_party_rule_package(tiny, kvscale_warnings, monkeypatch):
    from kvscale_plugin import names

    # rediscover the installed rule packages in this engine
    monkeypatch.setattr(names, "plugin_manager", None)
    invented = {}
    for i, (k, v) in enumerate([(2.25, 3.5), (4.75, 5.125)]):
        invented[f"model.layers.{i}.attention.kv_quant.k"] = torch.tensor([k])
        invented[f"model.layers.{i}.attention.kv_quant.v"] = torch.tensor([v])
    ckpt = tiny("invented-naming", write_scales=False, extra_tensors=invented)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
        (fp,) = llm.collective_rpc(worker_fingerprint)
    got = {layer_index(n): (s.k, s.v) for n, s in scales.items()}
    assert got == {0: (2.25, 3.5), 1: (4.75, 5.125)}
    # The trainer side of the invented names, through the same rule package.
    want = scale_fingerprint(invented, layers=fp["layers"], model_type=fp["model_type"])
    assert fp["fingerprint"] == want and fp["layers"] == [0, 1], fp
    # The deliberately broken rule package in the same distribution: one warning, named.
    broken = kvscale_warnings("'broken_rules'")
    assert len(broken) == 1, broken


@needs_fp8_cpu_cache
def test_unmapped_scale_names_one_warning(tiny, kvscale_warnings):
    stray = {
        "model.layers.7.self_attn.k_scale": torch.tensor([3.0]),
        "model.layers.9.self_attn.v_proj.v_scale": torch.tensor([3.0]),
    }
    ckpt = tiny("stray-names", extra_tensors=stray)
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
    _assert_loaded(ckpt, scales)
    warnings = kvscale_warnings("name no attention layer")
    assert len(warnings) == 1, warnings
    assert "model.layers.7.self_attn.k_scale" in warnings[0]
    assert "model.layers.9.self_attn.v_proj.v_scale" in warnings[0]

    # Stock vLLM refuses to start on the same checkpoint.
    with pytest.raises(ValueError, match="no module or parameter named .layers.7"):
        with vllm_engine(ckpt):
            pass
