"""In-place reloads that carry corrupt KV scales, on one real vLLM CPU engine.

vLLM 0.32's layerwise reload calls a layer's KV method only when the layer received a
tensor; a layer whose only scale tensors are refused as corrupt received nothing. What
kvscale guarantees per reload (``install_reload_check``):

* a reload with any corrupt scale is refused with ``CorruptScaleError`` naming every bad
  tensor -- also when *every* scale is corrupt (no layer's KV method runs then) -- and
  every attention layer keeps the scales it had (vLLM's reload is let finish, so the
  engine stays usable);
* the error is raised by the worker's entry point after vLLM's own after-reload steps
  (``reload_weights`` resets the LoRA / encoder / multimodal caches; a weight-transfer
  session's ``finish_weight_update`` ends the session), which a raise from inside the
  layerwise reload would skip -- the reload's other weights are in place by then;
* what a refused reload found corrupt is forgotten at the start of the next one: a later
  reload that gives the once-corrupt layer no tensor at all is not failed by it.
"""

from __future__ import annotations

import math

import pytest
import torch
from _weight_transfer import FileTransfer, in_process_worker
from kvscale_testing.engines import reload_weights
from kvscale_testing.probe import layer_scales, vllm_engine
from kvscale_testing.skips import needs_fp8_cpu_cache

from kvscale_plugin.scales import CorruptScaleError

pytestmark = pytest.mark.engine

GOOD = {0: (2.0, 3.0), 1: (4.0, 5.0)}


def _held(llm) -> dict[int, tuple[float, ...]]:
    out = {}
    for name, s in layer_scales(llm).items():
        assert (s.k, s.v) == (s.k_float, s.v_float) == (s.k_cpu, s.v_cpu), s
        out[int(name.split(".")[2])] = (s.k, s.v)
    return out


def _generates(llm) -> bool:
    from vllm import SamplingParams

    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4), use_tqdm=False)
    return len(out[0].outputs[0].token_ids) == 4


@needs_fp8_cpu_cache
def test_corrupt_reloads_are_refused_and_forgotten(tiny, kvscale_warnings):
    good = tiny("reload-good", scales=GOOD)
    one_bad = tiny("reload-one-bad", scales={0: (2.5, 3.5), 1: (math.nan, 5.5)})
    all_bad = tiny("reload-all-bad", scales={i: (math.nan, -1.0) for i in range(2)})
    layer0_only = tiny(
        "reload-layer0-only",
        write_scales=False,
        extra_tensors={
            "model.layers.0.self_attn.k_scale": torch.tensor([6.0]),
            "model.layers.0.self_attn.v_scale": torch.tensor([7.0]),
        },
    )
    with vllm_engine(good, quantization="kvscale") as llm:
        assert _held(llm) == GOOD
        runner = in_process_worker(llm).model_runner
        resets: list[str] = []
        reset_mm_cache = runner.reset_mm_cache
        runner.reset_mm_cache = lambda: (resets.append("mm"), reset_mm_cache())[1]

        with pytest.raises(CorruptScaleError) as info:
            reload_weights(llm, one_bad)
        text = str(info.value)
        assert "model.layers.1.self_attn.k_scale: NaN" in text, text
        assert "every attention layer keeps the KV scales it had" in text
        assert "other weights are in place" in text
        assert resets == ["mm"]  # the runner finished its reload before the error
        assert _held(llm) == GOOD  # layer 0's valid (2.5, 3.5) is not taken either
        assert _generates(llm)

        # Layer 1 gets no tensor now: its corrupt k_scale of the refused reload is moot.
        reload_weights(llm, layer0_only)
        assert _held(llm) == {0: (6.0, 7.0), 1: GOOD[1]}
        silent = kvscale_warnings("carry no k_scale/v_scale tensors")
        assert len(silent) == 1 and "model.layers.1.self_attn.attn" in silent[0], silent

        # Every scale corrupt: no layer's KV method runs, the reload is still refused.
        with pytest.raises(CorruptScaleError) as info:
            reload_weights(llm, all_bad)
        text = str(info.value)
        for i in range(2):
            assert f"model.layers.{i}.self_attn.k_scale: NaN" in text, text
            assert f"model.layers.{i}.self_attn.v_scale: -1.0 (negative)" in text, text
        assert _held(llm) == {0: (6.0, 7.0), 1: GOOD[1]}
        assert _generates(llm)

        reload_weights(llm, good)
        assert _held(llm) == GOOD


@needs_fp8_cpu_cache
def test_weight_transfer_session_with_corrupt_scales_is_refused_and_ended(tiny):
    """RL weight sync (``start_weight_update`` / ``update_weights`` /
    ``finish_weight_update`` on the real worker, ``_weight_transfer.FileTransfer`` in the
    NCCL engine's place): a corrupt scale fails
    ``finish_weight_update`` naming the tensor, after the worker ended the session, so
    the next session can start; the layers keep their scales meanwhile."""
    good = tiny("reload-good", scales=GOOD)
    bad = tiny("transfer-bad", scales={0: (2.5, 3.5), 1: (math.inf, 5.5)})
    newer = tiny("transfer-newer", scales={0: (8.0, 9.0), 1: (10.0, 11.0)})
    with vllm_engine(good, quantization="kvscale") as llm:
        worker = in_process_worker(llm)
        FileTransfer.attach(worker)
        worker.start_weight_update()
        worker.update_weights(bad)
        with pytest.raises(CorruptScaleError) as info:
            worker.finish_weight_update()
        text = str(info.value)
        assert "model.layers.1.self_attn.k_scale: inf (infinite)" in text, text
        assert _held(llm) == GOOD
        assert not worker._weight_update_active
        assert _generates(llm)

        worker.start_weight_update()  # "already active" if the session had not ended
        worker.update_weights(newer)
        worker.finish_weight_update()
        assert _held(llm) == {0: (8.0, 9.0), 1: (10.0, 11.0)}
