"""Run by test_vllm_processes.py in a fresh interpreter: vLLM's default multiprocessing
mode (engine core in a spawned process), where the plugin is found only through its
installed entry point. Prints one JSON line."""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # kvscale_testing (tests/support): a fresh interpreter, outside pytest. Worker
    # processes inherit this sys.path, so they can unpickle the apply_model target.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from kvscale_testing.engines import model_kv_head_scales, model_kv_scales
    from kvscale_testing.patches import patched_places_of
    from kvscale_testing.probe import ENGINE_DEFAULTS
    from vllm import LLM, SamplingParams

    model_dir, ids = sys.argv[1], json.loads(sys.argv[2])
    tp = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    # "heads": every per-head value each rank holds, and the floats.
    per_head = len(sys.argv) > 4 and sys.argv[4] == "heads"
    llm = LLM(
        model=model_dir,
        quantization="kvscale",
        enforce_eager=True,
        **ENGINE_DEFAULTS,
        tensor_parallel_size=tp,
        # The test's cache: kvscale_testing.skips.KV_DTYPE (bf16 where vLLM's CPU
        # attention refuses an FP8 cache).
        kv_cache_dtype=os.environ.get("KVSCALE_TEST_KV_DTYPE", "auto"),
    )
    scales = llm.apply_model(model_kv_head_scales if per_head else model_kv_scales)
    out = llm.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    tokens = list(out[0].outputs[0].token_ids)
    patched = llm.apply_model(patched_places_of)  # what kvscale changed in each worker
    result = {"scales": scales, "tokens": tokens, "patched": patched}
    if per_head:  # the scale state KV travels with (KV connectors, P/D): the engine's
        from kvscale_plugin.hosts.vllm.connectors import worker_part
        from kvscale_plugin.scalestate import merge

        parts = llm.collective_rpc(worker_part)
        state = merge(parts)
        result["state"] = {"tag": state.tag, "layers": sorted({n for p, _ in parts for n in p})}
    print("RESULT " + json.dumps(result))
