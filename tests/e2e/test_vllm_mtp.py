"""KV scales of MTP (multi-token prediction) draft layers on real vLLM CPU engines.

Checkpoints with MTP heads carry attention layers outside the main stack; vLLM 0.32
serves them as the speculative-decoding draft (``speculative_config={"method":
"mtp"}``). Tiny local checkpoints of three families, each with its real naming:

* MiMo: ``model.mtp_layers.0.self_attn.*`` -> draft layer ``model.layers.2.self_attn.attn``
* GLM-4-MoE: ``model.layers.2.self_attn.*`` (after a 2-layer stack) -> the same name
* Qwen3-Next: ``mtp.layers.0.self_attn.*`` -> draft layer ``mtp.layers.0.self_attn.attn``

Qwen3.5 (``mtp.layers.N``, the same draft loader as Qwen3-Next) runs in a fresh
interpreter: vLLM 0.32's ``qwen3_5`` module imports torchvision (through ``qwen3_vl``),
which the CPU venv does not have (``torchvision_site/sitecustomize.py`` says how the test
gets one). DeepSeek-V3's MTP layer is MLA, and vLLM's CPU MLA backend takes no FP8 cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from _run_script import run_script
from _weight_transfer import FileTransfer, in_process_worker
from kvscale_testing.checkpoints import read_stored_mtp_scales, read_stored_scales
from kvscale_testing.engines import reload_weights
from kvscale_testing.probe import layer_scales, vllm_engine
from kvscale_testing.skips import follows_cpu_fp8, needs_fp8_cpu_cache

from kvscale_plugin.scales import CorruptScaleError
from kvscale_plugin.scheme import FP8_KV_SCHEME

pytestmark = pytest.mark.engine

REL = 1e-6
#: family -> the engine name of its (one) MTP draft attention layer
DRAFT_LAYER = {
    "mimo": "model.layers.2.self_attn.attn",
    "glm4_moe": "model.layers.2.self_attn.attn",
    "qwen3_next": "mtp.layers.0.self_attn.attn",
}
#: family -> the checkpoint tensor of MTP layer 0's k_scale
MTP_K_SCALE = {
    "mimo": "model.mtp_layers.0.self_attn.k_scale",
    "glm4_moe": "model.layers.2.self_attn.k_scale",
    "qwen3_next": "mtp.layers.0.self_attn.k_scale",
}
MTP = {
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 1},
    # vLLM's CPU build runs hybrid (Gated DeltaNet) models only without prefix caching:
    # its "align" Mamba-state copy is a Triton kernel with no CPU fallback
    # (TypeError: 'function' object is not subscriptable, in mamba_utils).
    "enable_prefix_caching": False,
    "disable_log_stats": False,  # spec-decode counters
}


def _mtp_ckpt(tiny, family: str, name: str | None = None, **fields: Any):
    return tiny(name or f"mtp-{family}", family=family, num_layers=2, num_mtp_layers=1, **fields)


def _second_ckpt(tiny, family: str):
    """New scales for every target layer, (2, 3) and (4, 5), and MTP layer 0, (6, 7)."""
    return _mtp_ckpt(
        tiny,
        family,
        f"mtp-{family}-second",
        scales={0: (2.0, 3.0), 1: (4.0, 5.0)},
        mtp_scales={0: (6.0, 7.0)},
    )


def _generate(llm) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate(
        ["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    return list(out[0].outputs[0].token_ids)


@contextmanager
def _fails_to_start(error: type[BaseException], match: str | None = None) -> Iterator[Any]:
    """``pytest.raises`` for an engine that must not start; then the distributed state
    the half-built engine left is torn down (else the next MoE engine finds no EP group)."""
    from vllm.distributed import cleanup_dist_env_and_memory

    try:
        with pytest.raises(error, match=match) as info:
            yield info
    finally:
        cleanup_dist_env_and_memory()


def _counter(llm, name: str) -> int:
    return sum(int(m.value) for m in llm.get_metrics() if m.name == name)


@needs_fp8_cpu_cache
@pytest.mark.parametrize("family", sorted(DRAFT_LAYER))
def test_draft_layers_hold_the_checkpoint_mtp_scales(tiny, kvscale_warnings, family):
    ckpt = _mtp_ckpt(tiny, family)
    stored, stored_mtp = read_stored_scales(ckpt), read_stored_mtp_scales(ckpt)
    with vllm_engine(ckpt, quantization="kvscale", **MTP) as llm:
        scales = layer_scales(llm)
        tokens = _generate(llm)
        drafts = _counter(llm, "vllm:spec_decode_num_drafts")
    draft = scales.pop(DRAFT_LAYER[family])
    want = stored_mtp[0]
    assert (draft.k, draft.k_float, draft.k_cpu) == pytest.approx((want["k"],) * 3, rel=REL)
    assert (draft.v, draft.v_float, draft.v_cpu) == pytest.approx((want["v"],) * 3, rel=REL)
    assert draft.pool_is_fp8 and draft.source == "checkpoint"
    assert want["k"] != 1.0 and want["v"] != 1.0
    # The target model's layers hold theirs (Qwen3-Next: layer 0 is linear attention).
    assert {name.split(".")[-3]: (s.k, s.v) for name, s in scales.items()} == {
        str(i): pytest.approx((v["k"], v["v"]), rel=REL) for i, v in stored.items()
    }
    assert len(tokens) == 8
    assert drafts > 0  # the draft proposed tokens: speculative decoding ran
    assert not kvscale_warnings("name no attention layer")
    assert not kvscale_warnings("no k_scale/v_scale tensors")


@pytest.mark.parametrize(
    ("family", "error", "match"),
    [
        ("mimo", ValueError, "no module or parameter named .*mtp_block.self_attn.k_scale"),
        ("glm4_moe", KeyError, "model.layers.2.mtp_block.self_attn.k_scale"),
    ],
)
def test_stock_cannot_load_mtp_scales(tiny, family, error, match):
    with _fails_to_start(error, match):
        with vllm_engine(_mtp_ckpt(tiny, family), **MTP):
            pass


@needs_fp8_cpu_cache
def test_stock_loads_qwen3_next_mtp_scales(tiny):
    # Qwen3-Next's draft applies the quantization config's scale-name mapper: stock
    # loads its MTP scales too (MiMo's and GLM-4-MoE's drafts never apply it).
    ckpt = _mtp_ckpt(tiny, "qwen3_next")
    with vllm_engine(ckpt, kv_cache_dtype="fp8", **MTP) as llm:
        draft = layer_scales(llm)[DRAFT_LAYER["qwen3_next"]]
    want = read_stored_mtp_scales(ckpt)[0]
    assert (draft.k, draft.v) == pytest.approx((want["k"], want["v"]), rel=REL)


@needs_fp8_cpu_cache
def test_without_speculative_decoding_mtp_scales_stay_unused_silently(tiny, kvscale_warnings):
    ckpt = _mtp_ckpt(tiny, "glm4_moe")
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
        reload_weights(llm, ckpt)  # no draft: nothing to say about one either
    assert sorted(scales) == ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    # model.layers.2.* is the MTP layer (num_nextn_predict_layers: 1), not a stray name.
    assert not kvscale_warnings("name no attention layer")
    assert not kvscale_warnings("reloads the target model only")


@needs_fp8_cpu_cache
def test_mtp_scales_in_the_other_naming_do_not_reach_the_target(tiny, kvscale_warnings):
    """Both MTP namings apply to every family: a MiMo checkpoint that also names MTP
    layer 0 ``model.layers.{L}`` (L = num_hidden_layers) starts -- the target never gets
    that name (before, MiMo's loader raised ``ValueError: There is no module or parameter
    named 'layers.2' in MiMoModel``)."""
    ckpt = _mtp_ckpt(
        tiny,
        "mimo",
        "mtp-mimo-main-stack-naming",
        extra_tensors={
            "model.layers.2.self_attn.k_scale": torch.tensor(9.0),
            "model.layers.2.self_attn.v_scale": torch.tensor(9.0),
        },
    )
    with vllm_engine(ckpt, quantization="kvscale") as llm:
        scales = layer_scales(llm)
    stored = read_stored_scales(ckpt)
    assert sorted(scales) == [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    for i in range(2):
        held = scales[f"model.layers.{i}.self_attn.attn"]
        assert (held.k, held.v) == pytest.approx((stored[i]["k"], stored[i]["v"]), rel=REL)
    assert not kvscale_warnings("name no attention layer")


@needs_fp8_cpu_cache
@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_reload_keeps_the_draft_scales_and_says_so(tiny, kvscale_warnings, family):
    """vLLM 0.32's ``reload_weights`` reloads the target model only (the drafter never
    sees the weights): the target takes the new scales, the MTP draft keeps the ones it
    started with, and kvscale says so once per engine -- not silently -- naming the
    reload's MTP tensors in each family's own naming."""
    first = _mtp_ckpt(tiny, family)
    second = _second_ckpt(tiny, family)
    start = read_stored_mtp_scales(first)[0]
    with vllm_engine(first, quantization="kvscale", **MTP) as llm:
        reload_weights(llm, second)
        reload_weights(llm, second)
        scales = layer_scales(llm)
        assert len(_generate(llm)) == 8
    draft = scales.pop(DRAFT_LAYER[family])
    assert (draft.k, draft.v) == pytest.approx((start["k"], start["v"]), rel=REL)
    assert (start["k"], start["v"]) != (6.0, 7.0)
    assert {name.split(".")[-3]: (s.k, s.v) for name, s in scales.items()} == {
        "0": (2.0, 3.0),
        "1": (4.0, 5.0),
    }
    warned = kvscale_warnings("reloads the target model only")
    assert len(warned) == 1, warned  # two reloads, one warning
    assert DRAFT_LAYER[family] in warned[0], warned
    assert MTP_K_SCALE[family] in warned[0], warned


@needs_fp8_cpu_cache
@pytest.mark.parametrize("family", ["mimo", "glm4_moe"])
def test_draft_weight_sync_takes_the_new_mtp_scales(tiny, kvscale_warnings, family):
    """RL weight sync on the real worker (``_weight_transfer.FileTransfer`` in the NCCL
    engine's place): a session for the target, then one aimed at the draft
    (``start_draft_weight_update``: the draft's own ``load_weights`` gets the tensors;
    stock GLM-4-MoE's draft raises KeyError on their names). The draft takes MTP layer
    0's new scales; a corrupt one fails the draft session naming the checkpoint tensor,
    the draft keeping its scales."""
    first = _mtp_ckpt(tiny, family)
    second = _second_ckpt(tiny, family)
    bad = _mtp_ckpt(tiny, family, f"mtp-{family}-sync-bad", mtp_scales={0: (float("nan"), 2.0)})
    with vllm_engine(first, quantization="kvscale", **MTP) as llm:
        worker = in_process_worker(llm)
        FileTransfer.attach(worker)
        for start in (worker.start_weight_update, worker.start_draft_weight_update):
            start()
            worker.update_weights(second)
            worker.finish_weight_update()
        synced = layer_scales(llm)

        worker.start_draft_weight_update()
        worker.update_weights(bad)
        with pytest.raises(CorruptScaleError) as info:
            worker.finish_weight_update()
        after_bad = layer_scales(llm)
        assert len(_generate(llm)) == 8
    for scales in (synced, after_bad):
        assert {name: (s.k, s.v) for name, s in scales.items()} == {
            "model.layers.0.self_attn.attn": (2.0, 3.0),
            "model.layers.1.self_attn.attn": (4.0, 5.0),
            DRAFT_LAYER[family]: (6.0, 7.0),
        }
    assert MTP_K_SCALE[family] in str(info.value), info.value
    # Said once, at the target's session (the draft was synced after it).
    assert len(kvscale_warnings("reloads the target model only")) == 1


@follows_cpu_fp8
def test_corrupt_mtp_scale_names_the_checkpoint_tensor(tiny):
    ckpt = _mtp_ckpt(tiny, "mimo", "mtp-mimo-corrupt", mtp_scales={0: (float("nan"), 2.0)})
    # An explicit FP8 cache: the refusal comes at load, before vLLM's CPU checks it.
    with _fails_to_start(CorruptScaleError) as info:
        with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="fp8", **MTP):
            pass
    text = str(info.value)
    assert (
        "model.mtp_layers.0.self_attn.k_scale (MTP draft layer model.layers.2.self_attn.attn)"
        ": NaN" in text
    ), text
    assert "v_scale" not in text, text


@needs_fp8_cpu_cache
def test_missing_and_stray_mtp_scales_warn_once_each(tiny, kvscale_warnings):
    # MTP layer 0 has no scales; the checkpoint names an MTP layer 1 the model lacks.
    stray = {"model.mtp_layers.1.self_attn.k_scale": torch.tensor([3.0])}
    ckpt = _mtp_ckpt(tiny, "mimo", "mtp-mimo-missing", write_mtp_scales=False, extra_tensors=stray)
    with vllm_engine(ckpt, quantization="kvscale", **MTP) as llm:
        scales = layer_scales(llm)
        assert len(_generate(llm)) == 8
    draft = scales[DRAFT_LAYER["mimo"]]
    assert (draft.k, draft.v) == (1.0, 1.0) and draft.pool_is_fp8
    missing = kvscale_warnings("no k_scale/v_scale tensors")
    assert len(missing) == 1 and DRAFT_LAYER["mimo"] in missing[0], missing
    assert "model.layers.0." not in missing[0]  # the target's layers have theirs
    unmapped = kvscale_warnings("name no attention layer")
    assert len(unmapped) == 1 and "model.mtp_layers.1.self_attn.k_scale" in unmapped[0]


@needs_fp8_cpu_cache
def test_tensor_parallel_draft_ranks_hold_their_heads(tiny, tmp_path):
    """MiMo + MTP at TP=2 (multiprocessing executor) with per-head scales: each rank's
    draft layer holds its own KV head's checkpoint scale, as the target's layers do."""
    ckpt = _mtp_ckpt(
        tiny,
        "mimo",
        "mtp-mimo-heads",
        per_head=True,
        kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "attn_head"},
        scales={0: ([2.0, 3.0], [4.0, 5.0]), 1: ([6.0, 7.0], [8.0, 9.0])},
        mtp_scales={0: ([10.0, 11.0], [12.0, 13.0])},
    )
    result = run_script("_multiproc_mtp.py", str(ckpt), "2", tmp_path=tmp_path)
    stored, stored_mtp = read_stored_scales(ckpt), read_stored_mtp_scales(ckpt)
    ranks = result["scales"]
    assert len(ranks) == 2
    for rank, layers in enumerate(ranks):
        drafts = {name for name, held in layers.items() if held[4]}
        assert drafts == {DRAFT_LAYER["mimo"]}, (rank, sorted(layers))
        for name, (k, v, k_float, v_float, draft) in layers.items():
            want = stored_mtp[0] if draft else stored[int(name.split(".")[2])]
            # Two KV heads over two ranks: one head each, floats = the rank's max.
            assert (k, v) == ([want["k"][rank]], [want["v"][rank]]), (rank, name)
            assert (k_float, v_float) == (k[0], v[0]), (rank, name)
    assert len(result["tokens"]) == 8
    assert result["drafts"] > 0  # the draft proposed tokens: speculative decoding ran


#: ``make test`` installs PyPI's torchvision and the start-up shim here.
TEST_TORCHVISION = Path(__file__).resolve().parents[2] / "build" / "test-torchvision"


@needs_fp8_cpu_cache
def test_qwen3_5_draft_layer_holds_the_checkpoint_mtp_scales(tiny, tmp_path):
    assert (TEST_TORCHVISION / "sitecustomize.py").is_file(), (
        f"{TEST_TORCHVISION} is missing: run `make build/test-torchvision/.installed`"
        " (part of `make test`)"
    )
    ckpt = _mtp_ckpt(tiny, "qwen3_5")
    result = run_script(
        "_multiproc_mtp.py",
        str(ckpt),
        "1",
        tmp_path=tmp_path,
        env={"PYTHONPATH": str(TEST_TORCHVISION)},
    )
    (layers,) = result["scales"]
    stored, stored_mtp = read_stored_scales(ckpt), read_stored_mtp_scales(ckpt)
    k, v, k_float, v_float, is_draft = layers.pop("mtp.layers.0.self_attn.attn")
    want = stored_mtp[0]
    assert is_draft, "the MTP layer was not loaded as a kvscale draft layer"
    assert (*k, *v, k_float, v_float) == pytest.approx((want["k"], want["v"]) * 2, rel=REL)
    assert want["k"] != 1.0 and want["v"] != 1.0
    # The target: full attention at layer 1 only (layer 0 is Gated DeltaNet).
    assert {name: (*held[0], *held[1]) for name, held in layers.items()} == {
        f"model.layers.{i}.self_attn.attn": pytest.approx((s["k"], s["v"]), rel=REL)
        for i, s in stored.items()
    }
    assert len(result["tokens"]) == 8
    assert result["drafts"] > 0  # the draft proposed tokens: speculative decoding ran
