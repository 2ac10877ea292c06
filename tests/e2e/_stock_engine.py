"""Run by test_vllm_untouched.py in a fresh interpreter: stock engines (no
``--quantization kvscale``) with kvscale installed -- vLLM finds it through its entry point,
in this process and in each worker -- and what kvscale changed in vLLM afterwards. vLLM's
version is set to one kvscale was not tested with first. Prints one JSON line."""

import json
import logging
import os
import sys
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    import vllm

    vllm.__version__ = "0.99.0+cpu"  # a release kvscale was not tested with
    records: list[str] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(f"{record.levelname} {record.getMessage()}")

    logging.getLogger("kvscale_plugin").addHandler(_Keep(logging.DEBUG))
    from kvscale_testing.patches import patched_places, patched_places_of
    from kvscale_testing.probe import ENGINE_DEFAULTS
    from vllm import LLM, SamplingParams

    # The test's cache (kvscale_testing.skips.KV_DTYPE): bf16 on a CPU without AVX-512 /
    # AMX, where vLLM refuses the FP8 cache the compressed-tensors scheme asks for.
    KV_DTYPE = os.environ.get("KVSCALE_TEST_KV_DTYPE", "auto")

    plain, compressed = sys.argv[1], sys.argv[2]
    result: dict = {}
    params = SamplingParams(max_tokens=4, temperature=0.0)
    # In-process engines (as RL frameworks and notebooks run them): a plain checkpoint and
    # a compressed-tensors one with a KV scheme, which stock vLLM serves on its own.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for label, model in (("plain", plain), ("compressed-tensors", compressed)):
        llm = LLM(model=model, enforce_eager=True, kv_cache_dtype=KV_DTYPE, **ENGINE_DEFAULTS)
        out = llm.generate(["The quick brown fox"], params, use_tqdm=False)
        result[f"in-process {label}"] = {
            "tokens": len(out[0].outputs[0].token_ids),
            "patched": patched_places(),
            "quantization": llm.llm_engine.vllm_config.model_config.quantization,
        }
        llm.llm_engine.engine_core.shutdown()
        del llm
    # The default multiprocessing mode: the engine core and its worker in other processes.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    llm = LLM(model=compressed, enforce_eager=True, kv_cache_dtype=KV_DTYPE, **ENGINE_DEFAULTS)
    out = llm.generate(["The quick brown fox"], params, use_tqdm=False)
    result["multiprocess worker"] = {
        "tokens": len(out[0].outputs[0].token_ids),
        "patched": llm.apply_model(patched_places_of)[0],
    }
    result["front end patched"] = patched_places()
    result["kvscale records"] = records
    import kvscale_plugin.hosts.vllm as host

    result["registered"] = host.HOST.registered
    print("RESULT " + json.dumps(result))
