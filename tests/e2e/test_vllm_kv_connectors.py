"""KV that leaves the block pool keeps its scales (vLLM 0.32): a KV connector's store never
gives an engine KV written under other scales than its FP8 cache is written with.

* ``test_example_connector_store_is_keyed_by_the_scale_state``: vLLM's disk connector,
  loaded as kvscale's subclass through ``kv_connector_module_path``, on an engine without
  a prefix cache (every cached token comes from the connector). A prompt stored under s1,
  scales moved to s2 by ``collective_rpc`` (as an RL loop does), then back to s1 by a
  direct ``model.load_weights`` (an in-process loop).

FP8 branch where this CPU runs vLLM's FP8 cache (AVX-512 / AMX): under s2 the store's s1
KV is not loaded, the prompt is recomputed and stored under s2; back at s1 the s1 KV is
loaded again, with the first run's log-probs. bf16 branch: a bf16 cache applies no
scales, so the store keeps vLLM's layout and is read across the change.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _run_script import run_script
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.engines import greedy_with_logprobs
from kvscale_testing.probe import vllm_engine
from kvscale_testing.server import free_port
from kvscale_testing.skips import CPU_FP8, KV_DTYPE, follows_cpu_fp8

pytestmark = pytest.mark.engine

S1 = {0: (0.05, 0.04), 1: (0.06, 0.05)}
S2 = {0: (0.5, 0.4), 1: (0.6, 0.5)}
CONNECTORS = "kvscale_plugin.hosts.vllm.connectors"


def _tensors(scales: dict[int, tuple[float, float]]) -> list[tuple[str, torch.Tensor]]:
    return [
        (f"model.layers.{i}.self_attn.{kind}", torch.tensor(value))
        for i, pair in scales.items()
        for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)
    ]


def _push_s2(worker) -> int:  # runs in the worker (collective_rpc)
    return len(worker.model_runner.model.load_weights(_tensors(S2)))


def _stores(root) -> dict[str, int]:
    """Stored prompts per folder of the store (``kvscale-<tag>`` or vLLM's own, ``.``)."""
    found: dict[str, int] = {}
    for folder in root.rglob("*.safetensors"):
        prompt = folder.parent
        group = prompt.parent.name if prompt.parent != root else "."
        found.setdefault(group, 0)
    for group in list(found):
        base = root if group == "." else root / group
        found[group] = sum(
            1 for p in base.iterdir() if p.is_dir() and not p.name.startswith("kvscale-")
        )
    return found


@follows_cpu_fp8
def test_example_connector_store_is_keyed_by_the_scale_state(tiny, tmp_path, kvscale_warnings):
    ckpt = tiny("rl-prefix-s1", scales=S1)
    prompt = (list(reference_token_ids(ckpt)) * 12)[:300]
    store = tmp_path / "store"
    kv_transfer = {
        "kv_connector": "ExampleConnector",
        "kv_connector_module_path": CONNECTORS,
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(store)},
    }
    with vllm_engine(
        ckpt,
        quantization="kvscale",
        kv_cache_dtype=KV_DTYPE,
        enable_prefix_caching=False,
        kv_transfer_config=kv_transfer,
    ) as llm:
        connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
        assert type(connector).__module__ == CONNECTORS
        state_s1 = connector.kvscale_state
        assert state_s1 is not None and state_s1.layers == 2 and state_s1.applied is CPU_FP8

        _, at_s1, stored = greedy_with_logprobs(llm, prompt)
        _, hit_s1, cached_s1 = greedy_with_logprobs(llm, prompt)
        assert stored == 0 and cached_s1 >= 256, "the connector did not serve the prompt"
        assert hit_s1 == pytest.approx(at_s1, abs=1e-5)

        # s2 through collective_rpc (the engine core asks the workers afterwards).
        assert llm.collective_rpc(_push_s2) == [4]
        state_s2 = connector.kvscale_state
        # A bf16 cache applies no scales (served unscaled): its state does not change.
        assert (state_s2.tag != state_s1.tag) is CPU_FP8
        _, at_s2, cached_s2 = greedy_with_logprobs(llm, prompt)
        _, hit_s2, cached_s2_again = greedy_with_logprobs(llm, prompt)
        assert cached_s2_again >= 256
        assert hit_s2 == pytest.approx(at_s2, abs=1e-5)

        # Back to s1 by a direct call in the worker (no RPC: the scheduler reads its
        # worker's state before its next step).
        model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.load_weights(_tensors(S1))
        _, back, cached_back = greedy_with_logprobs(llm, prompt)
        assert connector.kvscale_state == state_s1

    groups = _stores(store)
    if CPU_FP8:
        assert cached_s2 == 0, "KV stored under s1 was loaded into a cache written with s2"
        assert at_s2 != pytest.approx(at_s1, abs=1e-5)  # else the test could not fail
        assert cached_back >= 256 and back == pytest.approx(at_s1, abs=1e-5)
        assert groups == {f"kvscale-{state_s1.tag}": 1, f"kvscale-{state_s2.tag}": 1}
    else:
        # A bf16 cache's KV does not depend on the scales: vLLM's layout, read across.
        assert cached_s2 >= 256 and cached_back >= 256
        assert groups == {".": 1}
    assert not kvscale_warnings("could not tell whether the KV scales in force changed")


NIXL_SITE = Path(__file__).resolve().parents[2] / "build" / "test-nixl"


@follows_cpu_fp8
def test_nixl_pd_pair_reads_no_kv_across_scale_states(tiny, tmp_path):
    ckpt = tiny("rl-prefix-s1", scales=S1)
    prompt = (list(reference_token_ids(ckpt)) * 12)[:300]
    output: list[str] = []
    steps = run_script(
        "_pd_pair.py",
        str(ckpt),
        KV_DTYPE,
        ",".join(map(str, prompt)),
        f"{free_port()},{free_port()}",
        tmp_path=tmp_path,
        timeout=600,
        env={
            "PYTHONPATH": os.pathsep.join(
                filter(None, (str(NIXL_SITE), os.environ.get("PYTHONPATH")))
            )
        },
        output=output,
    )
    log = "\n".join(output)
    (tmp_path / "pd_pair.log").write_text(log)  # kept with the test's folder on a failure
    tags = {name: (step.get("state") or {}).get("tag") for name, step in steps.items()}
    assert tags["s1_s1"] and tags["s1_s1"] == tags["s1_s2"] == tags["s1_s1_again"]
    # A bf16 cache applies no scales (served unscaled): one state whatever was pushed.
    assert tags["s2_s2"] and (tags["s2_s2"] != tags["s1_s1"]) is CPU_FP8
    assert all(step["state"]["applied"] is CPU_FP8 for step in steps.values() if "state" in step)
    local = {"s1": steps["local_s1"]["logprobs"], "s2": steps["local_s2"]["logprobs"]}
    if CPU_FP8:  # else the test could not fail (a bf16 cache applies no scales)
        assert local["s1"] != pytest.approx(local["s2"], abs=1e-4)
    full = len(prompt)
    # (pair, what the decode side serves): same scales -> the prefill's KV is pulled.
    for name, at in (
        ("s1_s1", "s1"),
        ("s2_s2", "s2"),
        ("after_reset", "s2"),
        ("s1_s1_again", "s1"),
    ):
        assert steps[name]["decode"]["pulled"] == full, name
        assert steps[name]["decode"]["recomputed"] is None, name
        assert steps[name]["decode"]["logprobs"] == pytest.approx(local[at], abs=1e-4), name
    crossed = ("s1_s2", "held_s1_to_s2", "s1_to_s2_again")
    for name in crossed:  # the prefill wrote under s1, the decode side serves s2
        got = steps[name]["decode"]
        if CPU_FP8:
            assert got["pulled"] == 0, f"{name}: KV written under s1 read by a cache at s2"
            assert got["logprobs"] == pytest.approx(local["s2"], abs=1e-4), name
            # Recomputed by kvscale's decision (not a failed transfer), told per request.
            why = got["recomputed"]
            assert why and why["producer"]["tag"] == tags[name], (name, why)
            assert why["consumer"]["tag"] == tags["s2_s2"], (name, why)
        else:  # a bf16 cache applies no scales: the KV is read as is
            assert got["pulled"] == full and got["recomputed"] is None, name
    if CPU_FP8:
        # The prefill side's reset while it held blocks for the decode side: pending, its
        # prefix cache not read meanwhile (the prompt it had cached at s1: 0 tokens).
        assert steps["s2_s2"]["prefill"]["cached"] == 0
    assert "could not tell whether the KV scales in force changed" not in log
