"""Run by test_vllm_parallel.py in a fresh interpreter: a kvscale engine with vLLM's
multiprocessing executor and pipeline (``pp``) or data (``dp``) parallelism on the CPU
build. The plugin is found only through its installed entry point. Prints one line
``RESULT {json}``: each worker's k/v scales (read inside the worker with
``llm.apply_model``) and the teacher-forced logprobs of ``ids``; on a start-up failure
``ERROR {json}`` with the exception type and message, and exit status 3.

Usage: _multiproc_pp.py MODEL_DIR IDS_JSON pp|dp SIZE
"""

import json
import os
import sys
import traceback
from pathlib import Path

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # One NUMA node here: let the CPU workers share it.
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # kvscale_testing (tests/support): a fresh interpreter, outside pytest. Worker
    # processes inherit this sys.path, so they can unpickle the apply_model target.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    from kvscale_testing.engines import model_kv_scales
    from kvscale_testing.probe import ENGINE_DEFAULTS
    from vllm import LLM, SamplingParams

    model_dir, ids, mode, size = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    parallel = {"pipeline_parallel_size": size} if mode == "pp" else {"data_parallel_size": size}
    try:
        # PP on CPU needs the compiled path: in eager mode the CPU worker skips the warm-up
        # that allocates the inter-stage buffers and the first generate fails.
        llm = LLM(
            model=model_dir,
            quantization="kvscale",
            enforce_eager=False,
            compilation_config={"mode": 2, "backend": "eager"},
            **ENGINE_DEFAULTS,
            **parallel,
        )
    except Exception as exc:  # noqa: BLE001 - reported to the test as data
        traceback.print_exc()
        print("ERROR " + json.dumps({"type": type(exc).__name__, "message": str(exc)}), flush=True)
        sys.exit(3)
    scales = llm.apply_model(model_kv_scales)
    out = llm.generate(
        [{"prompt_token_ids": ids}],
        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0),
        use_tqdm=False,
    )
    logprobs = [
        float(entry[tok].logprob)
        for tok, entry in zip(ids[1:], out[0].prompt_logprobs[1:], strict=True)
    ]
    print("RESULT " + json.dumps({"scales": scales, "logprobs": logprobs}), flush=True)
    # Stop the engine core and its PP workers, then leave without interpreter teardown:
    # there, vLLM's CPU build aborts about one exit in six ("terminate called without an
    # active exception", SIGABRT after RESULT was printed; seen in CI and reproduced
    # here: 1 of 6 runs), which is vLLM's teardown, not what this probe measures.
    llm.llm_engine.engine_core.shutdown()
    print("SHUTDOWN OK", flush=True)
    sys.stderr.flush()
    os._exit(0)
