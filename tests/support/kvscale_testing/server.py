"""Start-up of a local vLLM OpenAI server, shared by the e2e tests (``tests/e2e/_server.py``)
and the serving benchmark (``benchmarks/serving.py``): a free port, and the wait until the
server serves.

Standard library only, and nothing of vLLM: the caller starts the server process (its own
command line, environment and log) and stops it; this module only picks a port and waits.

* ``free_port`` -- a port that was free a moment ago: a candidate only. vLLM's server
  binds the port it is given (with ``--port 0`` it binds a free one but never reports
  which), so a port is picked here, and another process can take it before the server
  binds it; callers that must survive that race retry on a fresh port (``_server``).
* ``wait_until_serving`` -- polls the server until ``/health`` answers 200 and
  ``GET /v1/models`` lists the model: a ``/health`` answer from another process that holds
  the port is not this server's. Fails early (``ServerExited``) when the process exits,
  and with ``TimeoutError`` when it does not serve in time; what to make of either (a
  lost port race, the log's causes) is the caller's.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request


class ServerExited(RuntimeError):
    """The server process exited before it served."""

    def __init__(self, returncode: int) -> None:
        super().__init__(f"the server exited with status {returncode} before it served")
        self.returncode = returncode


def free_port() -> int:
    """A port on 127.0.0.1 that was free a moment ago: a candidate only (module docstring)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serves_model(base: str, model: str) -> bool:
    """``{base}/health`` answers 200 and ``{base}/v1/models`` lists ``model`` (its id)."""
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
            if r.status != 200:
                return False
        with urllib.request.urlopen(f"{base}/v1/models", timeout=5) as r:
            models = json.loads(r.read())
    except (OSError, ValueError):
        return False
    return any(m.get("id") == model for m in models.get("data", []))


def wait_until_serving(
    proc: subprocess.Popen, base: str, model: str, ready_s: float, poll_s: float = 1.0
) -> None:
    """Return once the server at ``base`` (``http://127.0.0.1:PORT``) serves ``model``.

    Raises ``ServerExited`` as soon as ``proc`` has exited, and ``TimeoutError`` when it
    does not serve within ``ready_s`` seconds. Every wait is bounded: a poll's requests
    time out after a few seconds, and the loop ends at the deadline.
    """
    deadline = time.monotonic() + ready_s
    while True:
        returncode = proc.poll()
        if returncode is not None:
            raise ServerExited(returncode)
        if time.monotonic() > deadline:
            raise TimeoutError(f"the server at {base} did not serve {model!r} in {ready_s} s")
        if serves_model(base, model):
            return
        time.sleep(poll_s)
