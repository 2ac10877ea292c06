"""Run by test_vllm_pd_pair.py in its own process (NIXL's CPU worker sets the process's CPU
affinity: never inside a pytest worker): a prefill/decode pair on loopback, two vLLM
engines (each its engine core in its own process) joined by kvscale's ``NixlConnector``,
their scales moved between requests in both directions. Prints what each step saw as a
``RESULT {json}`` line.

argv: checkpoint dir, KV cache dtype, the prompt's token ids (comma-separated), two free
ports (the engines' NIXL side channels, comma-separated).
"""

import json
import os
import sys

S1 = {0: (0.05, 0.04), 1: (0.06, 0.05)}
S2 = {0: (0.5, 0.4), 1: (0.6, 0.5)}


def _tensors(scales):
    import torch

    return [
        (f"model.layers.{i}.self_attn.{kind}", torch.tensor(value))
        for i, pair in scales.items()
        for kind, value in zip(("k_scale", "v_scale"), pair, strict=True)
    ]


def _push_s1(worker):
    return len(worker.model_runner.model.load_weights(_tensors(S1)))


def _push_s2(worker):
    return len(worker.model_runner.model.load_weights(_tensors(S2)))


if __name__ == "__main__":
    os.environ.update(
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        UCX_NET_DEVICES="lo",
        UCX_TLS="self,sm,tcp",
        VLLM_ENABLE_V1_MULTIPROCESSING="1",
        VLLM_ALLOW_INSECURE_SERIALIZATION="1",  # collective_rpc with a function
    )
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from kvscale_plugin.demo.probe import ENGINE_DEFAULTS
    from kvscale_plugin.scalestate import PARAMS_KEY

    model_dir, kv_cache_dtype = sys.argv[1], sys.argv[2]
    prompt = [int(t) for t in sys.argv[3].split(",")]
    ports = sys.argv[4].split(",")

    def engine(role, port, prefix_caching):
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = port
        return LLM(
            model=model_dir,
            quantization="kvscale",
            kv_cache_dtype=kv_cache_dtype,
            enforce_eager=True,
            enable_prefix_caching=prefix_caching,
            disable_log_stats=False,  # the decode side's pulled-token count
            kv_transfer_config=KVTransferConfig(
                kv_connector="NixlConnector",
                kv_connector_module_path="kvscale_plugin.hosts.vllm.connectors",
                kv_role=role,
                kv_buffer_device="cpu",
            ),
            **ENGINE_DEFAULTS,
        )

    # The prefill side keeps its prefix cache (its reset is what a held block stalls);
    # the decode side has none, so every token it serves is pulled or computed there.
    prefill_llm = engine("kv_producer", ports[0], True)
    decode_llm = engine("kv_consumer", ports[1], False)

    def prefill():
        params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            extra_args={"kv_transfer_params": {"do_remote_decode": True}},
        )
        [got] = prefill_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return {"params": got.kv_transfer_params, "cached": got.num_cached_tokens}

    def pulled():
        """Prompt tokens the decode side took from a transfer so far (vLLM's metric)."""
        return sum(
            getattr(m, "value", 0)
            for m in decode_llm.get_metrics()
            if m.name == "vllm:prompt_tokens_by_source"
            and m.labels.get("source") == "external_kv_transfer"
        )

    def decode(transfer=None):
        before = pulled()
        extra = {"kv_transfer_params": transfer} if transfer is not None else None
        params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=0, extra_args=extra)
        [got] = decode_llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        done = got.outputs[0]
        return {
            "tokens": list(done.token_ids),
            "logprobs": [next(iter(s.values())).logprob for s in done.logprobs],
            "cached": got.num_cached_tokens,
            "pulled": pulled() - before,
            "recomputed": (got.kv_transfer_params or {}).get("kvscale_recomputed"),
        }

    def state(prefilled):
        return (prefilled["params"] or {}).get(PARAMS_KEY)

    steps = {}
    # 1. Both at s1: the transfer is read.
    steps["local_s1"] = decode()
    p = prefill()
    steps["s1_s1"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}

    # 2. The decode side moves to s2; the prefill side still writes with s1.
    assert decode_llm.collective_rpc(_push_s2) == [4]
    steps["local_s2"] = decode()
    p = prefill()
    steps["s1_s2"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}

    # 3. A prefill finished at s1 whose blocks the prefill side holds for the decode side;
    # then the prefill side moves to s2: its prefix-cache reset cannot run yet (pending).
    held = prefill()
    assert prefill_llm.collective_rpc(_push_s2) == [4]
    p = prefill()  # at s2, while the reset is pending: the prefix cache is not read
    steps["s2_s2"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}
    # The held s1 request reaches the decode side now (s2): not read; its blocks freed.
    steps["held_s1_to_s2"] = {
        "prefill": held,
        "state": state(held),
        "decode": decode(held["params"]),
    }
    p = prefill()  # the pending reset ran before this step
    steps["after_reset"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}

    # 4. The other direction: the prefill side back to s1, the decode side still at s2.
    assert prefill_llm.collective_rpc(_push_s1) == [4]
    p = prefill()
    steps["s1_to_s2_again"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}
    # ... and the decode side follows: read again.
    assert decode_llm.collective_rpc(_push_s1) == [4]
    p = prefill()
    steps["s1_s1_again"] = {"prefill": p, "state": state(p), "decode": decode(p["params"])}

    print("RESULT " + json.dumps(steps), flush=True)
    for llm in (decode_llm, prefill_llm):
        llm.llm_engine.engine_core.shutdown()
