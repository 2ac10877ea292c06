"""A vLLM OpenAI server with ``--quantization kvscale`` on 127.0.0.1 for e2e tests.

The plugin is found through its installed entry point. The server always stops when
the ``with`` block ends (terminate, wait, kill), whatever happened inside it.

Ports: vLLM's server binds the port it is given (with ``--port 0`` it binds a free one,
but logs "Starting vLLM server on http://127.0.0.1:0": the port it got is not reported),
so a free port is picked here (``kvscale_testing.server.free_port``), and another process
can take it before the server binds it. A server that lost its port exits with "Address
already in use" (from its own bind or listen, or from a port vLLM picked itself for its
data-parallel or distributed processes); it is started again on a fresh port, a bounded
number of times. A server only counts as ready once ``/v1/models`` serves this model: a
``/health`` answer from another process that holds the port is not ours (the wait is
``kvscale_testing.server.wait_until_serving``, the serving benchmark's as well).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscale_testing.probe import KV_CACHE_BYTES

# The port and the wait until ready are shared with benchmarks/serving.py; ``free_port``
# stays importable from here.
from kvscale_testing.server import ServerExited, free_port, wait_until_serving

#: What a process that lost a port race logs: Python's ``OSError`` (EADDRINUSE, "[Errno
#: 98] Address already in use"), torch's TCPStore and ZMQ say it in the same words.
ADDRESS_IN_USE = "address already in use"
#: Starts on fresh ports before a lost port race counts as a failure.
PORT_ATTEMPTS = 3


def lost_port_race(text: str) -> bool:
    """Whether a failed process's output says a port it bound was taken."""
    return ADDRESS_IN_USE in text.lower()


@dataclass
class Server:
    url: str
    model: str
    log: Path
    #: The server process's id (``openai_server`` sets it): its engine core and workers
    #: are its children.
    pid: int | None = None

    def post(
        self, path: str, body: dict[str, Any], timeout: float = 60, rank: int | None = None
    ) -> dict[str, Any]:
        """POST JSON; ``rank`` pins the request to one data-parallel engine (vLLM's
        ``X-data-parallel-rank`` header)."""
        headers = {"Content-Type": "application/json"}
        if rank is not None:
            headers["X-data-parallel-rank"] = str(rank)
        req = urllib.request.Request(
            f"{self.url}{path}", data=json.dumps(body).encode(), headers=headers
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def get_text(self, path: str, timeout: float = 10) -> str:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=timeout) as r:
            return r.read().decode()

    def prompt_logprobs(
        self, ids: Sequence[int], timeout: float = 60, rank: int | None = None
    ) -> list[float]:
        """Teacher-forced logprobs of ``ids`` (first token excluded) via ``prompt_logprobs``."""
        answer = self.post(
            "/v1/completions",
            {
                "model": self.model,
                "prompt": list(ids),
                "max_tokens": 1,
                "temperature": 0.0,
                "prompt_logprobs": 0,
            },
            timeout=timeout,
            rank=rank,
        )
        entries = answer["choices"][0]["prompt_logprobs"]
        return [float(e[str(t)]["logprob"]) for t, e in zip(ids[1:], entries[1:], strict=True)]


def _command(model_dir: Path, port: int, extra: Sequence[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--quantization",
        "kvscale",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enforce-eager",
        "--block-size",
        "32",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
        "--seed",
        "0",
        *extra,
    ]


def _wait_ready(proc: subprocess.Popen, server: Server, ready_s: float) -> bool:
    """True once the server serves (``kvscale_testing.server.wait_until_serving``); False
    if it exited having lost its port; otherwise (another exit, no answer in ``ready_s``)
    an AssertionError with the log's causes."""
    try:
        wait_until_serving(proc, server.url, server.model, ready_s)
    except ServerExited:
        text = server.log.read_text()
        if lost_port_race(text):
            return False
        # The root cause (an engine-core exception) often lies before the tail.
        errors = (ln.strip() for ln in text.splitlines() if "Error: " in ln)
        causes = list(dict.fromkeys(errors))[:6]
        raise AssertionError(
            "server exited:\n" + "\n".join(causes) + "\n...\n" + text[-3000:]
        ) from None
    except TimeoutError:
        raise AssertionError(f"server not ready in {ready_s} s (log: {server.log})") from None
    return True


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


@contextmanager
def openai_server(
    model_dir: Path,
    tmp_path: Path,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_s: float = 240,
) -> Iterator[Server]:
    full_env = dict(os.environ)
    full_env["TMPDIR"] = str(tmp_path)
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    full_env.update(env or {})
    lost: list[str] = []
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        log_path = tmp_path / f"server-{port}.log"
        server = Server(f"http://127.0.0.1:{port}", str(model_dir), log_path)
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                _command(model_dir, port, extra), env=full_env, stdout=log, stderr=subprocess.STDOUT
            )
            server.pid = proc.pid
            try:
                if not _wait_ready(proc, server, ready_s):
                    lost.append(str(log_path))
                    continue  # another process took a port: start again on a fresh one
                yield server
                return
            finally:
                _stop(proc)
    raise AssertionError(
        f"server lost its port race {PORT_ATTEMPTS} times ({ADDRESS_IN_USE!r}); logs: {lost}"
    )
