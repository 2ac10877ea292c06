"""A vLLM OpenAI server with ``--quantization kvscale`` on 127.0.0.1 for e2e tests.

The plugin is found through its installed entry point. The server always stops when
the ``with`` block ends (terminate, wait, kill), whatever happened inside it.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvscale_plugin.demo.probe import KV_CACHE_BYTES


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    model: str
    log: Path

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


@contextmanager
def openai_server(
    model_dir: Path,
    tmp_path: Path,
    extra: Sequence[str] = (),
    env: dict[str, str] | None = None,
    ready_s: float = 240,
) -> Iterator[Server]:
    port = free_port()
    cmd = [
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
    full_env = dict(os.environ)
    full_env["TMPDIR"] = str(tmp_path)
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    full_env.update(env or {})
    log_path = tmp_path / f"server-{port}.log"
    log = log_path.open("w")
    proc = subprocess.Popen(cmd, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}", str(model_dir), log_path)
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                text = log_path.read_text()
                # The root cause (an engine-core exception) often lies before the tail.
                causes = list(
                    dict.fromkeys(ln.strip() for ln in text.splitlines() if "Error: " in ln)
                )[:6]
                raise AssertionError(
                    "server exited:\n" + "\n".join(causes) + "\n...\n" + text[-3000:]
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready in {ready_s} s")
            try:
                with urllib.request.urlopen(f"{server.url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        yield server
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
        log.close()
