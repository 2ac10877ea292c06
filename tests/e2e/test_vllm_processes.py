"""Discovery through the installed entry point, in vLLM's own processes.

No test here imports the plugin into the engine by hand: the engine core and the
OpenAI server find `kvscale` through the `vllm.general_plugins` entry point.
"""

from __future__ import annotations

import json
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from _run_script import run_script
from _server import openai_server
from kvscale_testing.checkpoints import read_stored_scales, reference_token_ids
from kvscale_testing.probe import layer_index, vllm_engine
from kvscale_testing.skips import KV_DTYPE, follows_cpu_fp8, needs_avx512_cpu_for_tp

from kvscale_plugin.hosts.vllm import internals

pytestmark = pytest.mark.engine


def test_entry_point_is_installed():
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("kvscale") == "kvscale_plugin.hosts.vllm:register"


def _greedy_tokens_in_process(model_dir: Path, ids: list[int]) -> list[int]:
    from vllm import SamplingParams

    with vllm_engine(model_dir, quantization="kvscale", kv_cache_dtype=KV_DTYPE) as llm:
        out = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=8, temperature=0.0),
            use_tqdm=False,
        )
        return list(out[0].outputs[0].token_ids)


@follows_cpu_fp8
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=needs_avx512_cpu_for_tp)])
def test_multiprocessing_mode_loads_scales(tiny, tmp_path, tp):
    ckpt = tiny("default", num_layers=2)
    ids = list(reference_token_ids(ckpt))[:24]
    # Workers share the one NUMA node (docs/running-engines-on-cpu.md), and a run that lost
    # a port race to another process (TP=2: vLLM's distributed port) is run again.
    args = (str(ckpt), json.dumps(ids), str(tp))
    env = {"KVSCALE_TEST_KV_DTYPE": KV_DTYPE}
    result = run_script("_multiproc_engine.py", *args, tmp_path=tmp_path, timeout=300, env=env)
    assert len(result["scales"]) == tp  # one answer per worker (TP rank)
    stored = read_stored_scales(ckpt)
    for scales in result["scales"]:
        assert len(scales) == len(stored)
        for name, (k, v) in scales.items():
            # The checkpoint's scales with the FP8 cache; 1.0 with a bf16 cache (on a CPU
            # without AVX-512 / AMX), where no scale is applied.
            want = stored[layer_index(name)] if KV_DTYPE == "auto" else {"k": 1.0, "v": 1.0}
            assert k == pytest.approx(want["k"], rel=1e-6)
            assert v == pytest.approx(want["v"], rel=1e-6)
    assert result["tokens"] == _greedy_tokens_in_process(ckpt, ids)
    # A kvscale engine's worker: at most six patched places, each one in the checked list
    # with the upstream limitation that forces it (docs/compatibility.md).
    listed = {i.target for i in internals.PATCHED}
    for places in result["patched"]:
        assert len(places) <= 6, places
        assert {p.removesuffix("['kvscale']") for p in places} <= listed, places
        assert "vllm.v1.worker.gpu_worker.Worker.reload_weights" in places, places


@follows_cpu_fp8
def test_openai_server_answers_like_in_process_engine(tiny, tmp_path):
    # `k_proj.output_scale` naming: stock vLLM 0.32 refuses to start on it (an
    # AttributeError, test_vllm_engine.py), so a server that answers at all has run the
    # plugin's name mapping in its engine-core process, and `-q kvscale` would be an
    # unknown method in the API-server process without the entry point.
    ckpt = tiny("output_scale", num_layers=2, naming="output_scale")
    ids = list(reference_token_ids(ckpt))[:24]
    with openai_server(ckpt, tmp_path, extra=("--kv-cache-dtype", KV_DTYPE)) as server:
        body = {
            "model": str(ckpt),
            "prompt": ids,
            "max_tokens": 8,
            "temperature": 0.0,
            "return_token_ids": True,
        }
        answer = server.post("/v1/completions", body)
    choice = answer["choices"][0]
    tokens = choice.get("token_ids")
    assert tokens, answer
    assert "Failed to load plugin" not in server.log.read_text()
    assert tokens == _greedy_tokens_in_process(ckpt, ids)
