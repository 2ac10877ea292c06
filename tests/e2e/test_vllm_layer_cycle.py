"""One load cycle on vLLM's real attention layers, without an engine: vLLM's ``Attention``
built under a real ``VllmConfig`` with kvscale's config (the FP8 cache is refused only when
an engine allocates it, so this runs on every CPU), its real KV method and weight loaders,
and the reload check the worker's entry points run after vLLM's reload.

It covers what an engine test on this CPU cannot reach: a reload on an FP8 cache. Inputs a
CPU build never has (attention that reads q scales: FP8 attention on a GPU) are injected
where the host asks for them (``method.reads_q_scale``)."""

from __future__ import annotations

import json

import pytest
import torch

from kvscale_plugin.scales import CorruptScaleError

LAYERS = 2


@pytest.fixture(scope="module")
def build_layers(tmp_path_factory):
    from vllm.config import CacheConfig, ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention import Attention
    from vllm.plugins import load_general_plugins

    from kvscale_plugin.demo.tinymodels import TinySpec, build_tiny_checkpoint
    from kvscale_plugin.hosts.vllm.method import KVScaleConfig

    load_general_plugins()
    root = tmp_path_factory.mktemp("layer-cycle")
    ckpt = build_tiny_checkpoint(root / "ckpt", TinySpec(num_layers=LAYERS), cache_dir=root)
    quant = json.loads((ckpt / "config.json").read_text())["quantization_config"]

    def build():
        cfg = KVScaleConfig.from_config(quant)
        vllm_config = VllmConfig(
            model_config=ModelConfig(model=str(ckpt), quantization="kvscale"),
            cache_config=CacheConfig(cache_dtype="fp8"),
            quant_config=cfg,
        )
        with set_current_vllm_config(vllm_config):
            layers = [
                Attention(
                    4,
                    16,
                    0.25,
                    num_kv_heads=2,
                    cache_config=vllm_config.cache_config,
                    quant_config=cfg,
                    prefix=f"model.layers.{i}.self_attn.attn",
                )
                for i in range(LAYERS)
            ]
        return vllm_config, layers

    return build


def _load(vllm_config, layers, tensors: dict[tuple[int, str], float], *, reload: bool) -> None:
    """What vLLM's loader and layerwise reload do to the KV method: (for a reload) fresh
    placeholders, each tensor to its loader, then post-load processing of every layer."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vllm_config):
        if reload:
            for layer in layers:
                layer.quant_method.create_weights(layer)
        for (i, kind), value in tensors.items():
            param = getattr(layers[i], kind)
            param.weight_loader(param, torch.tensor([value]))
        for layer in layers:
            layer.quant_method.process_weights_after_loading(layer)


def _served(layers) -> list[tuple[float, float]]:
    return [(layer._k_scale_float, layer._v_scale_float) for layer in layers]


GOOD = {(0, "k_scale"): 2.0, (0, "v_scale"): 3.0, (1, "k_scale"): 4.0, (1, "v_scale"): 5.0}
NEW = {key: value * 2 for key, value in GOOD.items()}


def test_a_reload_whose_only_corrupt_tensor_is_a_read_q_scale_is_refused(build_layers, monkeypatch):
    """Attention that reads q scales refuses a corrupt one with the k/v scales: in a
    reload every layer keeps the scales it had and the reload check raises, naming it."""
    from kvscale_plugin.hosts.vllm import method
    from kvscale_plugin.hosts.vllm.reload import check_reload

    monkeypatch.setattr(method, "reads_q_scale", lambda layer: True)
    vllm_config, layers = build_layers()
    _load(vllm_config, layers, GOOD, reload=False)
    assert _served(layers) == [(2.0, 3.0), (4.0, 5.0)]

    _load(vllm_config, layers, {**NEW, (1, "q_scale"): float("nan")}, reload=True)
    with pytest.raises(CorruptScaleError) as info:
        check_reload(layers, draft=False)
    assert "model.layers.1.self_attn.attn.q_scale: NaN" in str(info.value), info.value
    assert "every attention layer keeps the KV scales it had" in str(info.value)
    assert _served(layers) == [(2.0, 3.0), (4.0, 5.0)]

    # The refusal was consumed: the next, valid reload serves its scales.
    _load(vllm_config, layers, NEW, reload=True)
    check_reload(layers, draft=False)
    assert _served(layers) == [(4.0, 6.0), (8.0, 10.0)]


def test_a_q_scale_nothing_reads_is_warned_about_and_the_reload_serves(
    build_layers, kvscale_warnings
):
    """vLLM's CPU attention reads no q scale: a corrupt one does not hold the reload back."""
    from kvscale_plugin.hosts.vllm.reload import check_reload

    vllm_config, layers = build_layers()
    _load(vllm_config, layers, GOOD, reload=False)
    _load(vllm_config, layers, {**NEW, (0, "q_scale"): -1.0}, reload=True)
    check_reload(layers, draft=False)
    assert _served(layers) == [(4.0, 6.0), (8.0, 10.0)]
    assert len(kvscale_warnings("query-scale value(s)")) == 1


def test_a_reload_does_not_report_the_previous_loads_unmapped_names(build_layers, monkeypatch):
    """Checkpoint scale names that land on no layer are reported for the load that carried
    them: a later reload (its names mapped before vLLM re-creates the placeholders, as the
    layerwise reload does) reports only its own."""
    from vllm.config import set_current_vllm_config

    from kvscale_plugin.hosts.vllm import method

    reported: list[set[str]] = []
    monkeypatch.setattr(method, "warn_unmapped_scales", lambda names, scope: reported.append(names))
    vllm_config, layers = build_layers()
    cfg = layers[0].quant_method.quant_config
    stray = "model.layers.7.self_attn.k_scale"

    def mapped(names: list[str]) -> list[str]:
        with set_current_vllm_config(vllm_config):
            mapper = cfg.get_cache_scale_mapper()
            return [name for name, _ in mapper.apply((n, torch.tensor([1.0])) for n in names)]

    assert mapped([stray, "model.layers.0.self_attn.k_scale"]) == [
        "model.layers.0.self_attn.attn.k_scale"
    ]
    _load(vllm_config, layers, GOOD, reload=False)
    assert reported and all(names == {stray} for names in reported), reported

    reported.clear()
    assert mapped(["model.layers.1.self_attn.k_scale"]) == ["model.layers.1.self_attn.attn.k_scale"]
    _load(vllm_config, layers, NEW, reload=True)
    assert reported == [] and cfg.unmapped_scales == set()
    assert _served(layers) == [(4.0, 6.0), (8.0, 10.0)]


def test_a_reload_with_a_corrupt_k_scale_keeps_every_layer_and_raises(build_layers):
    from kvscale_plugin.hosts.vllm.reload import check_reload

    vllm_config, layers = build_layers()
    _load(vllm_config, layers, GOOD, reload=False)
    _load(vllm_config, layers, {**NEW, (0, "k_scale"): float("inf")}, reload=True)
    with pytest.raises(CorruptScaleError, match="model.layers.0.self_attn.attn.k_scale"):
        check_reload(layers, draft=False)
    assert _served(layers) == [(2.0, 3.0), (4.0, 5.0)]


@pytest.mark.parametrize(
    ("quant_total", "model_total", "tp", "rank", "local", "heads"),
    [
        # TP larger than the KV heads: vLLM replicates them (2 heads on 4 ranks: ranks 2
        # and 3 hold head 1). Local x TP would say 4 heads and misplace every scale.
        (None, 2, 4, 2, 1, (1,)),
        (2, None, 4, 3, 1, (1,)),
        (None, 8, 4, 1, 2, (2, 3)),  # partitioned
        # A layer whose head count is not the model's (a heterogeneous model): its own.
        (None, 8, 2, 1, 1, (1,)),
    ],
)
def test_a_rank_serves_the_heads_vllm_gives_it(
    monkeypatch, quant_total, model_total, tp, rank, local, heads
):
    """``served.head_layout`` reads the model's KV-head count where vLLM sets it."""
    from types import SimpleNamespace

    import vllm.config
    import vllm.distributed

    from kvscale_plugin.hosts.vllm.served import head_layout

    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(vllm.distributed, "get_tensor_model_parallel_rank", lambda: rank)
    model = SimpleNamespace(get_total_num_kv_heads=lambda: model_total)
    current = SimpleNamespace(model_config=model if model_total else None)
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none", lambda: current)
    cfg = SimpleNamespace(total_num_kv_heads=quant_total, total_num_heads=None)
    layer = SimpleNamespace(num_kv_heads=local, num_heads=local * 2)
    assert head_layout(cfg, layer).heads == heads
