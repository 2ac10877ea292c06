"""The engine arm of ``benchmarks/rl_drift.py``: the same steps read through a real
``-q kvscale`` vLLM engine with an FP8 KV cache (where this CPU runs one: AVX-512 / AMX).

At every step the trainer's weights and arm (b)'s scales are synced into the engine as an
RL loop's full sync does (``collective_rpc`` -> vLLM's ``reload_weights`` with the
tensors), then arm (c)'s scales alone as a scales-only sync does (``model.load_weights``;
vLLM's CPU build repacks linear weights after loading, so a bare ``load_weights`` cannot
take them). The
fingerprint the engine then reports is checked against ``scale_fingerprint`` of the scales
sent. Teacher-forced log-probs of the evaluation texts (vLLM's ``prompt_logprobs``) give
the engine's gap against the trainer's unquantized float32 model, beside the simulated
cache's. The engine holds bf16 weights, so its gaps include bf16 rounding (a floor both
arms share); the paired difference (b) - (c) cancels most of it.

Arms (b) step-0 scales and (c) fresh scales only (two evaluations per step). Per-tensor
scales only (the calibrated checkpoint's scheme).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _push(tensors: list[tuple[str, torch.Tensor]]) -> Any:
    def load(worker: Any) -> int:
        return len(worker.model_runner.model.load_weights(tensors))

    return load


def _reload(tensors: list[tuple[str, torch.Tensor]]) -> Any:
    def reload(worker: Any) -> None:
        worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)

    return reload


class EngineArm:
    """One in-process ``-q kvscale`` engine on the calibrated copy of the model."""

    def __init__(self, model_dir: Path, say: Any) -> None:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # in-process: no pickling
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        sys.path.insert(0, str(HERE))
        from cpu_write_quality import prepare_variants
        from vllm import LLM

        from kvscale_plugin.demo.probe import ENGINE_DEFAULTS

        threads = torch.get_num_threads()
        work = ROOT / "build" / "bench-rl-drift"
        calibrated = prepare_variants(model_dir, work / model_dir.name)["calibrated"]
        defaults = {**ENGINE_DEFAULTS, "max_model_len": 512}
        self.llm = LLM(
            model=str(calibrated),
            quantization="kvscale",
            kv_cache_dtype="auto",
            enforce_eager=True,
            enable_prefix_caching=False,  # every evaluation computes its KV afresh
            **defaults,
        )
        torch.set_num_threads(threads)  # the trainer's setting again
        say(f"# engine arm: -q kvscale vLLM engine, FP8 cache, on {calibrated}")

    def evaluate(
        self,
        model: Any,
        scales: dict[str, torch.Tensor],
        ev: dict[str, torch.Tensor],
        ref: torch.Tensor,
        *,
        weights: bool,
    ) -> dict[str, Any]:
        """Sync ``scales`` (with ``weights``: every weight of ``model`` too, through vLLM's
        ``reload_weights``, as a full RL sync; else through ``model.load_weights``, a
        scales-only sync), check the fingerprint, and return the engine's gap per
        evaluation token (``[texts, seq - 1]``, 0 on padding)."""
        from vllm import SamplingParams

        from kvscale_plugin.fingerprint import scale_fingerprint
        from kvscale_plugin.hosts.vllm.live import worker_fingerprint

        sent = [(n, t.detach().reshape(()).clone()) for n, t in scales.items()]
        if weights:
            full = [(n, p.detach().to(torch.bfloat16).clone()) for n, p in model.named_parameters()]
            self.llm.collective_rpc(_reload(full + sent))
        else:
            self.llm.collective_rpc(_push(sent))
        [fp] = self.llm.collective_rpc(worker_fingerprint)
        expected = scale_fingerprint(sent)
        ids, mask = ev["input_ids"], ev["attention_mask"]
        prompts = [
            {"prompt_token_ids": ids[i, : int(mask[i].sum())].tolist()} for i in range(len(ids))
        ]
        outs = self.llm.generate(
            prompts,
            SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
            use_tqdm=False,
        )
        lp = torch.zeros_like(ref)
        for i, out in enumerate(outs):
            tokens = prompts[i]["prompt_token_ids"]
            for j, (tok, entry) in enumerate(zip(tokens[1:], out.prompt_logprobs[1:], strict=True)):
                lp[i, j] = entry[tok].logprob
        return {
            "gap": (lp - ref).abs() * mask[:, 1:],
            "fingerprint_ok": fp["fingerprint"] == expected,
        }
