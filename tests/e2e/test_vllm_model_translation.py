"""A scale name is judged by where the model's own translation takes it, not by kvscale's
rules: an architecture registered with vLLM's ``ModelRegistry`` whose weights mapper
renames its attention module from a name no kvscale rule knows is served its scales."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from kvscale_testing.probe import FP8_CPU_REFUSAL, layer_index, layer_scales, vllm_engine

from kvscale_plugin.names import map_scale_name

pytestmark = [pytest.mark.engine, pytest.mark.follows_cpu_fp8]

ARCH = "KvscaleTestBlockAttnLlamaForCausalLM"
#: The checkpoint's own name for the attention module (kvscale has no rule for it).
OWN = "blk_attn"


def _register() -> None:
    from vllm import ModelRegistry
    from vllm.model_executor.models.llama import LlamaForCausalLM
    from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper

    class BlockAttnLlama(LlamaForCausalLM):
        """Llama whose checkpoint calls the attention module ``blk_attn``."""

        hf_to_vllm_mapper = WeightsMapper(orig_to_new_substr={f".{OWN}.": ".self_attn."})

        def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
            return AutoWeightsLoader(self).load_weights(weights, mapper=self.hf_to_vllm_mapper)

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, BlockAttnLlama)


@pytest.fixture(scope="module")
def renamed_checkpoint(tiny, tmp_path_factory) -> tuple[Path, dict[int, tuple[float, float]]]:
    from safetensors.torch import load_file, save_file

    src = tiny("llama-for-renaming")
    out = tmp_path_factory.mktemp("blk-attn")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    renamed = {name.replace(".self_attn.", f".{OWN}."): t for name, t in tensors.items()}
    scales = {}
    for name in renamed:
        if name.endswith(f".{OWN}.k_scale"):
            i = int(name.split(".")[2])
            k, v = 1.25 + i, 2.5 + i  # distinct per layer, k != v, none 1.0
            renamed[name] = torch.tensor(k)
            renamed[name.replace("k_scale", "v_scale")] = torch.tensor(v)
            scales[i] = (k, v)
    assert scales, "the tiny checkpoint stores no k_scale"
    save_file(renamed, str(out / "model.safetensors"))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            (out / f.name).write_bytes(f.read_bytes())
    config = json.loads((out / "config.json").read_text())
    config["architectures"] = [ARCH]
    (out / "config.json").write_text(json.dumps(config))
    return out, scales


def test_registered_architecture_with_its_own_attention_name(renamed_checkpoint):
    ckpt, scales = renamed_checkpoint
    # No kvscale rule knows the name: only the model's own translation can place it.
    assert map_scale_name(f"model.layers.0.{OWN}.k_scale", "vllm", "llama") is None
    _register()
    try:
        with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8") as llm:
            served = layer_scales(llm)
    except Exception as exc:  # noqa: BLE001 - only this CPU's FP8 refusal, read after load
        served = getattr(exc, "kvscale_loaded_scales", None)
        if served is None or FP8_CPU_REFUSAL not in str(exc):
            raise
    got = {layer_index(name): (s.k, s.v, s.k_float, s.v_float) for name, s in served.items()}
    assert got == {i: pytest.approx((k, v, k, v)) for i, (k, v) in scales.items()}
