"""Run by test_vllm_rl_sync.py in a fresh interpreter: a tensor-parallel ``-q kvscale``
engine in vLLM's multiprocessing mode (engine core and one worker process per TP rank),
and a trainer's sync through ``collective_rpc``: a scales-only ``model.load_weights``
(the function and its tensors pickled to every worker), the fingerprint each rank reports,
and a corrupt update. Generates nothing (so it runs on a CPU whose AVX2 kernels fail
tensor-parallel prompts). Prints one ``RESULT`` JSON line.

argv: checkpoint dir, TP size, KV cache dtype[, a checkpoint with a corrupt scale to reload].
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import torch
    from vllm import LLM

    from kvscale_plugin.demo.probe import ENGINE_DEFAULTS
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint
    from kvscale_plugin.scales import CorruptScaleError

    model_dir, tp, kv_cache_dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    llm = LLM(
        model=model_dir,
        quantization="kvscale",
        enforce_eager=True,
        tensor_parallel_size=tp,
        kv_cache_dtype=kv_cache_dtype,
        **ENGINE_DEFAULTS,
    )
    result = {"start": llm.collective_rpc(worker_fingerprint)}
    scales = [
        (f"model.layers.{i}.self_attn.{kind}", torch.tensor(value))
        for i, pair in enumerate([(6.0, 7.0), (8.0, 9.0)])
        for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)
    ]

    def sender(tensors):
        # The tensors travel inside the pickled function (vLLM's message queue cannot
        # pickle tensors passed as collective_rpc kwargs: "cannot pickle memoryview").
        def load(worker):
            return sorted(worker.model_runner.get_model().load_weights(tensors))

        return load

    t0 = time.perf_counter()
    result["names"] = llm.collective_rpc(sender(scales))
    result["ms"] = (time.perf_counter() - t0) * 1e3
    result["after"] = llm.collective_rpc(worker_fingerprint)
    # Last: a corrupt update (every rank refuses it).
    bad = [("model.layers.1.self_attn.v_scale", torch.tensor(float("nan")))]
    try:
        llm.collective_rpc(sender(bad))
        result["refused"] = None
    except Exception as exc:  # noqa: BLE001 - what reaches the caller across processes
        result["refused"] = f"{type(exc).__name__}: {exc}"
        result["refused_is_corrupt"] = isinstance(exc, CorruptScaleError)
    # vLLM 0.32's multiprocess executor raises at the first failing rank and leaves the
    # later ranks' answers queued for the next call; every rank raises, and kvscale reads
    # the other ranks' answers to the refused call, so the channel still answers right.
    result["after_refused"] = llm.collective_rpc(worker_fingerprint)
    if len(sys.argv) > 4:  # a reload of a checkpoint with a corrupt scale: the same
        try:
            llm.collective_rpc("reload_weights", kwargs={"weights_path": sys.argv[4]})
            result["reload_refused"] = None
        except Exception as exc:  # noqa: BLE001 - what reaches the caller across processes
            result["reload_refused"] = f"{type(exc).__name__}: {exc}"
        result["after_reload_refused"] = llm.collective_rpc(worker_fingerprint)
    print("RESULT " + json.dumps(result), flush=True)
