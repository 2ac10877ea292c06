"""Start one CPU ``sglang.Engine``, run one prompt, write what happened as JSON.

Run by tests/sglang_engine/conftest.py as ``python engine_driver.py SPEC.json OUT.json``
in its own process group (SGLang's Engine installs signal handlers, switches
multiprocessing to ``spawn`` and starts a scheduler and a detokenizer process: none of
that belongs in the pytest process, and the group is killed whole afterwards).

SPEC: ``{"engine": {...Engine kwargs...}, "input_ids": [...], "max_new_tokens": N}``, and
optionally ``"steps"``: weight updates run after that first request, each followed by the
same request again -- ``{"update_weights_from_disk": PATH}``, or
``{"update_weights_from_tensor": PATH}`` (a session: ``begin_weight_update``, the
checkpoint's tensors without its ``*_scale`` ones, as a trainer sends them,
``end_weight_update``), ``{"session_tensors": {name: value}}`` (a session sending these
scalar tensors only), ``{"tensors_without_session": {name: value}}`` (the same without
``begin_weight_update``), ``{"distributed": {name: value}}`` (a session whose tensors a
trainer process broadcasts over a gloo group: ``init_weights_update_group`` once, then
``update_weights_from_distributed``) or ``{"rpc": METHOD, "params": {...}}``
(``collective_rpc``).
After the first request and after each step, ``get_server_info()``'s
``internal_states[0]["kvscale"]`` is kept (``"kvscale"``).
OUT: ``{"pid", "start_s", "input_token_logprobs", "output_token_logprobs"}`` (each a list
of ``[logprob, token_id]``) and ``"steps"`` (each ``{"answer", "output_token_logprobs"}``),
or ``{"pid", "start_s", "error"}`` when the Engine did not start or a request failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _pairs(entries: list[Any]) -> list[list[Any]]:
    return [[lp, tok] for lp, tok, *_ in entries]


def _generate(engine: Any, spec: dict[str, Any]) -> dict[str, Any]:
    out = engine.generate(
        input_ids=spec["input_ids"],
        sampling_params={"max_new_tokens": spec["max_new_tokens"], "temperature": 0.0},
        return_logprob=True,
        logprob_start_len=0,
    )
    meta = out["meta_info"]
    return {
        "input_token_logprobs": _pairs(meta["input_token_logprobs"]),
        "output_token_logprobs": _pairs(meta["output_token_logprobs"]),
    }


def _trainer_weights(path: str) -> list[tuple[str, Any]]:
    from pathlib import Path

    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    return [(n, t) for n, t in tensors.items() if not n.endswith("_scale")]


def _tensors(values: dict[str, Any]) -> list[tuple[str, Any]]:
    import torch

    return [(n, torch.tensor(v, dtype=torch.float32)) for n, v in values.items()]


_GROUP = "kvscale_rl_sync"
_trainer: list[Any] = []  # (process, pipe) of the trainer, once started


def trainer_main(port: int, conn: Any) -> None:
    """A trainer: rank 0 of a gloo weight-update group with the Engine (rank 1), which
    broadcasts each list of float32 scalars it is sent. (Top level: spawned.)"""
    import torch
    from sglang.srt.utils import init_custom_process_group

    group = init_custom_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        world_size=2,
        rank=0,
        group_name=_GROUP,
    )
    while (values := conn.recv()) is not None:
        for value in values:
            torch.distributed.broadcast(torch.tensor(value, dtype=torch.float32), 0, group=group)
        conn.send("sent")


def _distributed(engine: Any, values: dict[str, float]) -> Any:
    """A session whose tensors come through ``update_weights_from_distributed`` (gloo)."""
    if not _trainer:
        import multiprocessing
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=trainer_main, args=(port, child), daemon=True)
        proc.start()
        _trainer.extend([proc, parent])
        joined = engine.init_weights_update_group("127.0.0.1", port, 1, 2, _GROUP, backend="gloo")
        if not joined[0]:
            return list(joined)
    names = list(values)
    engine.begin_weight_update()
    _trainer[1].send([values[n] for n in names])
    answer = engine.update_weights_from_distributed(
        names, ["float32"] * len(names), [[] for _ in names], group_name=_GROUP
    )
    _trainer[1].recv()
    engine.end_weight_update()
    return list(answer)


def _step(engine: Any, step: dict[str, Any]) -> Any:
    if "distributed" in step:
        return _distributed(engine, step["distributed"])
    if "update_weights_from_disk" in step:
        return list(engine.update_weights_from_disk(step["update_weights_from_disk"]))
    if "session_tensors" in step:  # a session that sends these tensors only
        engine.begin_weight_update()
        answer = engine.update_weights_from_tensor(_tensors(step["session_tensors"]))
        engine.end_weight_update()
        return list(answer)
    if "tensors_without_session" in step:
        return list(engine.update_weights_from_tensor(_tensors(step["tensors_without_session"])))
    if "rpc" in step:  # a scheduler method (the probe's, see kvscale_engine_probe)
        engine.collective_rpc(step["rpc"], **step.get("params", {}))
        return [True, "rpc"]
    engine.begin_weight_update()
    answer = engine.update_weights_from_tensor(_trainer_weights(step["update_weights_from_tensor"]))
    engine.end_weight_update()
    return list(answer)


def _kvscale_info(engine: Any) -> Any:
    """What kvscale returns through ``get_server_info`` (its scale fingerprint)."""
    states = engine.get_server_info().get("internal_states") or [{}]
    return states[0].get("kvscale")


_quit_signals: list[int] = []


def on_sigquit(signum: int, frame: object) -> None:
    """A child that fails sends SIGQUIT; SGLang's default handler kills this whole process
    tree before the failure can be reported. The Engine constructor raises on its own
    once the scheduler is gone. (Top level: SGLang pickles it into its subprocesses.)"""
    _quit_signals.append(signum)


def main(spec_path: str, out_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    result: dict[str, Any] = {"pid": os.getpid()}

    import sglang

    start = time.monotonic()
    try:
        engine = sglang.Engine(**spec["engine"], custom_sigquit_handler=on_sigquit)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which judges it
        result.update(start_s=time.monotonic() - start, error=f"{type(exc).__name__}: {exc}")
        result["sigquit"] = bool(_quit_signals)
        open(out_path, "w").write(json.dumps(result))
        return 0
    result["start_s"] = time.monotonic() - start
    try:
        result.update(_generate(engine, spec))
        result["kvscale"] = _kvscale_info(engine)
        result["steps"] = []
        for step in spec.get("steps", []):
            answer = _step(engine, step)
            kvscale = _kvscale_info(engine)
            out = _generate(engine, spec)["output_token_logprobs"]
            result["steps"].append(
                {"answer": answer, "output_token_logprobs": out, "kvscale": kvscale}
            )
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if _trainer:
            _trainer[1].send(None)
            _trainer[0].join(timeout=10)
        engine.shutdown()
    open(out_path, "w").write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
