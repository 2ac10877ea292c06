"""Start one CPU ``sglang.Engine``, run one prompt, write what happened as JSON.

Run by tests/sglang_engine/conftest.py as ``python engine_driver.py SPEC.json OUT.json``
in its own process group (SGLang's Engine installs signal handlers, switches
multiprocessing to ``spawn`` and starts a scheduler and a detokenizer process: none of
that belongs in the pytest process, and the group is killed whole afterwards).

SPEC: ``{"engine": {...Engine kwargs...}, "input_ids": [...], "max_new_tokens": N}``.
OUT: ``{"pid", "start_s", "input_token_logprobs", "output_token_logprobs"}`` (each a list
of ``[logprob, token_id]``), or ``{"pid", "start_s", "error"}`` when the Engine did not
start or the request failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def _pairs(entries: list[Any]) -> list[list[Any]]:
    return [[lp, tok] for lp, tok, *_ in entries]


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
        out = engine.generate(
            input_ids=spec["input_ids"],
            sampling_params={"max_new_tokens": spec["max_new_tokens"], "temperature": 0.0},
            return_logprob=True,
            logprob_start_len=0,
        )
        meta = out["meta_info"]
        result["input_token_logprobs"] = _pairs(meta["input_token_logprobs"])
        result["output_token_logprobs"] = _pairs(meta["output_token_logprobs"])
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.shutdown()
    open(out_path, "w").write(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
