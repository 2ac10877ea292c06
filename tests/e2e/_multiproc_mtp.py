"""Run by test_vllm_mtp.py in a fresh interpreter: a kvscale engine with MTP speculative
decoding, tensor parallelism and vLLM's multiprocessing executor on the CPU build.
Prints ``RESULT {json}``: each worker's k/v scales of every attention layer, draft
layers included (read inside the workers), the generated tokens and the number of
draft tokens proposed.

Usage: _multiproc_mtp.py MODEL_DIR TP
"""

import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # kvscale_testing (tests/support): a fresh interpreter, outside pytest. Worker
    # processes inherit this sys.path, so they can unpickle the collective_rpc target.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from kvscale_testing.engines import worker_kv_head_scales
    from kvscale_testing.probe import ENGINE_DEFAULTS
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=sys.argv[1],
        quantization="kvscale",
        enforce_eager=True,
        **ENGINE_DEFAULTS,
        tensor_parallel_size=int(sys.argv[2]),
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
        disable_log_stats=False,  # spec-decode counters
        # Hybrid models (Qwen3.5, Gated DeltaNet) run on vLLM's CPU build only without
        # prefix caching; the others do not need it here.
        enable_prefix_caching=False,
    )
    scales = llm.collective_rpc(worker_kv_head_scales)
    out = llm.generate(
        ["The quick brown fox"], SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False
    )
    drafts = sum(int(m.value) for m in llm.get_metrics() if m.name == "vllm:spec_decode_num_drafts")
    tokens = list(out[0].outputs[0].token_ids)
    print("RESULT " + json.dumps({"scales": scales, "tokens": tokens, "drafts": drafts}))
    sys.stdout.flush()
    # Leave without interpreter teardown, where vLLM's CPU build has been seen to abort
    # after the work is done (see _multiproc_pp.py).
    llm.llm_engine.engine_core.shutdown()
    os._exit(0)
