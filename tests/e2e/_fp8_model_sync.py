"""Probe script (a fresh interpreter, ``run_script``): a real vLLM model of a ``-q kvscale``
engine with an FP8 KV cache, built and loaded without an engine -- vLLM's CPU build
refuses an FP8 cache only when its attention backend is set up, which this never does,
so it runs on every CPU -- and the RL-sync steps a trainer drives through
``model.load_weights`` (what ``collective_rpc`` runs in a worker). Prints ``RESULT {json}``.

argv: checkpoint dir (2 layers, per-tensor k/v scales); ``keep`` as a second argument:
the KV method keeps its scale placeholders after loading, as on vLLM >= 0.34 (whose
direct reload loads into them again), so "inside the host's own load" cannot be told from
them.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
import types
from pathlib import Path

import torch

_KEEP = contextlib.ExitStack()


def build(ckpt: str):
    torch.accelerator.empty_cache = lambda: None  # CPU torch: nothing to empty
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.model_loader import get_model
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    vc = EngineArgs(
        model=ckpt,
        quantization="kvscale",
        kv_cache_dtype="fp8",
        enforce_eager=True,
        max_model_len=256,
    ).create_engine_config()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    _KEEP.enter_context(set_current_vllm_config(vc))  # for the process's life
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    return vc, get_model(vllm_config=vc)


def main() -> None:
    from safetensors.torch import load_file

    from kvscale_plugin.fingerprint import scale_fingerprint
    from kvscale_plugin.hosts.vllm import live, prefixcache
    from kvscale_plugin.scales import CorruptScaleError

    ckpt = sys.argv[1]
    if sys.argv[2:] == ["keep"]:
        from kvscale_plugin.hosts.vllm import method, runtime

        method.keeps_placeholders = runtime.keeps_placeholders = lambda: True
    vc, model = build(ckpt)
    context = vc.compilation_config.static_forward_context
    layers = {int(name.split(".")[2]): m for name, m in context.items() if hasattr(m, "_k_scale")}
    cfg = layers[0].quant_method.quant_config
    stored = load_file(str(next(Path(ckpt).glob("*.safetensors"))))
    embed = stored["model.embed_tokens.weight"]

    def held() -> dict[int, dict[str, float]]:
        return {
            i: {
                "k": float(m._k_scale),
                "v": float(m._v_scale),
                "k_float": m._k_scale_float,
                "v_float": m._v_scale_float,
                "k_cpu": float(m._k_scale_cpu),
                "v_cpu": float(m._v_scale_cpu),
            }
            for i, m in sorted(layers.items())
        }

    def sent(scales: dict[int, tuple[float, float]]) -> list[tuple[str, torch.Tensor]]:
        out = []
        for i, (k, v) in scales.items():
            out.append((f"model.layers.{i}.self_attn.k_scale", torch.tensor(k)))
            out.append((f"model.layers.{i}.self_attn.v_scale", torch.tensor(v)))
        return out

    def snapshot(**extra) -> dict:
        return {
            "held": held(),
            "fingerprint": live.layers_fingerprint(layers.values()),
            "updates": live.state(cfg).updates,
            **extra,
        }

    # What the engine core asks each worker after a collective_rpc (``prefixcache.scale_epoch``):
    # the scales its FP8 caches are written with. A worker's only field it reads is
    # ``vllm_config``.
    worker = types.SimpleNamespace(vllm_config=vc)
    epochs = {"start": prefixcache.scale_epoch(worker)}

    result: dict = {
        "placeholders": sorted(
            f"{name}.{kind}"
            for name, m in context.items()
            if hasattr(m, "_k_scale")
            for kind in ("k_scale", "v_scale")
            if hasattr(m, kind)
        )
    }
    start = {i: (held()[i]["k"], held()[i]["v"]) for i in layers}
    result["start"] = snapshot(trainer=scale_fingerprint(sent(start)))

    # A scales-only update of every layer (what a trainer sends when only they change).
    new = {0: (6.0, 7.0), 1: (8.0, 9.0)}
    t0 = time.perf_counter()
    names = model.load_weights(sent(new))
    ms = (time.perf_counter() - t0) * 1e3
    result["all"] = snapshot(names=sorted(names), ms=ms, trainer=scale_fingerprint(sent(new)))
    epochs["all"] = prefixcache.scale_epoch(worker)

    # Buckets: every k_scale in one call, every v_scale in the next.
    bucket = {0: (5.0, 5.5), 1: (6.5, 7.5)}
    both = sent(bucket)
    model.load_weights([item for item in both if item[0].endswith("k_scale")])
    result["k_bucket"] = snapshot()
    model.load_weights([item for item in both if item[0].endswith("v_scale")])
    result["v_bucket"] = snapshot(trainer=scale_fingerprint(both))

    # One layer only, in another naming (k_proj.k_scale), and the legacy single kv_scale.
    model.load_weights([("model.layers.1.self_attn.k_proj.k_scale", torch.tensor(3.25))])
    result["partial"] = snapshot()
    model.load_weights([("model.layers.0.self_attn.kv_scale", torch.tensor(2.75))])
    result["legacy"] = snapshot()

    # Weights and scales in one call: both taken.
    doubled = embed * 2
    names = model.load_weights([("model.embed_tokens.weight", doubled), *sent(new)])
    result["mixed"] = snapshot(
        names=sorted(names),
        embed_loaded=bool(
            torch.equal(model.model.embed_tokens.weight.data[: len(doubled)], doubled)
        ),
    )

    # Corrupt: every tensor named, nothing served changes, the counter does not move.
    try:
        model.load_weights(
            [
                ("model.layers.0.self_attn.k_scale", torch.tensor(float("nan"))),
                ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor(0.0)),
                ("model.layers.1.self_attn.k_scale", torch.tensor(4.0)),
            ]
        )
        refused = None
    except CorruptScaleError as exc:
        refused = str(exc)
    result["corrupt"] = snapshot(refused=refused)

    # A scale for a layer the model lacks: dropped with a warning, the rest taken.
    model.load_weights([("model.layers.7.self_attn.k_scale", torch.tensor(2.0)), *sent(new)])
    result["nowhere"] = snapshot()

    # Served memory cleared (as vLLM's sleep level 2 does), then a weights-only update.
    for m in layers.values():
        m._k_scale.zero_()
        m._v_scale.zero_()
        m._k_scale_cpu.zero_()
    result["cleared"] = snapshot()
    epochs["before_weights_only"] = prefixcache.scale_epoch(worker)
    model.load_weights([("model.embed_tokens.weight", embed)])
    result["after_clear"] = snapshot(trainer=scale_fingerprint(sent(new)))
    epochs["weights_only"] = prefixcache.scale_epoch(worker)

    # One copy set behind kvscale's back (a refit that wrote the device tensor only).
    layers[0]._v_scale.fill_(11.0)
    result["one_copy"] = snapshot(
        consistent=not any(line.startswith("!") for line in live.fingerprint_lines(layers.values()))
    )
    model.load_weights([("model.embed_tokens.weight", embed)])
    result["after_one_copy"] = snapshot()

    result["epochs"] = epochs
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
