"""Run by test_vllm_rl_shapes.py under ``torchrun --nproc-per-node 2``: a colocated SPMD
engine (TRL's colocate mode, verl's in-process rollout): each rank builds
``LLM(..., tensor_parallel_size=2, distributed_executor_backend="external_launcher")`` in
its own process and calls its own model's ``load_weights`` directly -- no engine core, no
``collective_rpc``. Each rank writes ``rank<N>.json`` into the output folder.

argv: checkpoint dir, KV cache dtype, output folder, the prompt's token ids (comma-separated).
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from vllm import LLM, SamplingParams

    from kvscale_plugin.demo.probe import ENGINE_DEFAULTS
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint
    from kvscale_plugin.scales import CorruptScaleError

    model_dir, kv_cache_dtype, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    prompt = [int(t) for t in sys.argv[4].split(",")]
    rank = int(os.environ["RANK"])
    llm = LLM(
        model=model_dir,
        quantization="kvscale",
        enforce_eager=True,
        tensor_parallel_size=2,
        distributed_executor_backend="external_launcher",
        kv_cache_dtype=kv_cache_dtype,
        **ENGINE_DEFAULTS,
    )
    worker = llm.llm_engine.model_executor.driver_worker.worker
    model = worker.model_runner.model

    def generate():
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0)
        [got] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        done = got.outputs[0]
        logprobs = [next(iter(step.values())).logprob for step in done.logprobs]
        return {
            "tokens": list(done.token_ids),
            "logprobs": logprobs,
            "cached": got.num_cached_tokens,
        }

    def send(scales):
        tensors = [
            (f"model.layers.{i}.self_attn.{kind}", torch.tensor(value))
            for i, pair in scales.items()
            for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)
        ]
        try:
            return {"names": sorted(model.load_weights(tensors)), "refused": None}
        except CorruptScaleError as exc:
            return {"names": None, "refused": str(exc)}

    s1 = {0: (0.05, 0.04), 1: (0.06, 0.05)}
    s2 = {0: (0.5, 0.4), 1: (0.6, 0.5)}
    result = {"rank": rank, "start": worker_fingerprint(worker)}
    result["s1"] = generate()
    result["s1_again"] = generate()
    result["to_s2"] = send(s2)  # a direct call: no RPC, no engine core
    result["s2"] = generate()
    result["s2_again"] = generate()
    result["fp_s2"] = worker_fingerprint(worker)
    result["back_to_s1"] = send(s1)
    result["s1_back"] = generate()
    # A NaN k_scale for layer 0 beside a valid v_scale for layer 1: one decision on both
    # ranks (FP8: both refuse, nothing taken; bf16: both warn and return).
    result["corrupt"] = send({0: (float("nan"), 0.04), 1: (0.06, 0.7)})
    result["fp_after_corrupt"] = worker_fingerprint(worker)
    result["after_corrupt"] = generate()
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    print(f"RESULT rank {rank} done", flush=True)
