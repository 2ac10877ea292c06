"""Run by test_vllm_rl_shapes.py in a fresh interpreter: a pipeline-parallel (PP=2)
``-q kvscale`` engine in vLLM's multiprocessing mode (layer 0 on stage 0, layer 1 on
stage 1) and updates through ``collective_rpc`` -> ``model.load_weights`` that name both
stages' layers: one with a NaN k_scale for layer 0 beside a valid one for layer 1, then a
valid one. Generates nothing. Prints one ``RESULT`` JSON line.

argv: checkpoint dir, KV cache dtype.
"""

import json
import os
import sys

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    from vllm import LLM

    from kvscale_plugin.demo.probe import ENGINE_DEFAULTS
    from kvscale_plugin.hosts.vllm.extension import QUALNAME
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint

    model_dir, kv_cache_dtype = sys.argv[1], sys.argv[2]
    llm = LLM(
        model=model_dir,
        quantization="kvscale",
        enforce_eager=True,
        pipeline_parallel_size=2,
        kv_cache_dtype=kv_cache_dtype,
        worker_extension_cls=QUALNAME,
        **ENGINE_DEFAULTS,
    )

    def sender(pairs):
        tensors = [(name, torch.tensor(value)) for name, value in pairs]

        def load(worker):
            return sorted(worker.model_runner.get_model().load_weights(tensors))

        return load

    result = {"start": llm.collective_rpc(worker_fingerprint)}
    bad = [
        ("model.layers.0.self_attn.k_scale", float("nan")),
        ("model.layers.1.self_attn.k_scale", 8.0),
    ]
    try:
        llm.collective_rpc(sender(bad))
        result["refused"] = None
    except Exception as exc:  # noqa: BLE001 - what reaches the caller across processes
        result["refused"] = f"{type(exc).__name__}: {exc}"
    result["after_refused"] = llm.collective_rpc(worker_fingerprint)
    good = [
        ("model.layers.0.self_attn.k_scale", 5.0),
        ("model.layers.1.self_attn.k_scale", 6.0),
    ]
    result["names"] = llm.collective_rpc(sender(good))
    result["after_valid"] = llm.collective_rpc(worker_fingerprint)
    # The same by name (kvscale's worker extension): a string, nothing pickled.
    result["by_name"] = llm.collective_rpc("kvscale_fingerprint")
    result["check_by_name"] = llm.collective_rpc("kvscale_check")
    print("RESULT " + json.dumps(result), flush=True)
