#!/usr/bin/env bash
# Build .venv-llmcompressor: llm-compressor 0.14.0.1 next to the CPU torch, used only to
# make real llm-compressor checkpoints for the tests
# (tests/fixtures/llmcompressor/make_checkpoints.py).
#
# Why a separate venv: llm-compressor pins compressed-tensors 0.19 and transformers 5.17;
# the project's .venv has vLLM's compressed-tensors 0.17. kvscale is NOT installed here:
# the checkpoints are made by llm-compressor alone, as a user would make them.
#
# Idempotent: a marker file records a hash of this script; when it matches, the script
# returns at once. Usage: scripts/setup_llmcompressor_venv.sh [VENV_DIR]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV="${1:-${LLMCOMPRESSOR_VENV:-.venv-llmcompressor}}"
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.kvscale-llmcompressor-installed"
STAMP="$(sha256sum < "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
LLMCOMPRESSOR_VERSION=0.14.0.1
TORCH_VERSION=2.13.0

if [[ -x "$VENV/bin/python" && -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]]; then
    exit 0
fi

# pip's local mirrors print a line per package they lack; keep the log readable
# without hiding pip's own exit status.
quiet() {
    "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}

start=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)

# CPU torch first and alone (the local +cpu wheel): a plain or newer torch requirement
# would pull a multi-GB CUDA build. Then llm-compressor constrained to that torch.
quiet "${PIP[@]}" "torch==$TORCH_VERSION"
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
echo "torch==$TORCH_VERSION" > "$constraints"
quiet "${PIP[@]}" -c "$constraints" "llmcompressor==$LLMCOMPRESSOR_VERSION"
"$VENV/bin/python" -m pip check

"$VENV/bin/python" -W ignore -c '
import sys
from importlib.metadata import version
import torch
if "+cpu" not in torch.__version__:
    sys.exit(f"setup_llmcompressor_venv: expected the CPU torch build, got torch {torch.__version__}")
import llmcompressor  # noqa: F401  (imports cleanly)
names = ("llmcompressor", "compressed-tensors", "transformers", "datasets")
print("setup_llmcompressor_venv:", ", ".join(f"{n} {version(n)}" for n in names), "torch", torch.__version__)
'
echo "$STAMP" > "$MARKER"
echo "setup_llmcompressor_venv: ready in $((SECONDS - start)) s ($VENV)"
