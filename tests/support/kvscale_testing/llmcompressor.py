"""Real llm-compressor checkpoints for the tests: find them, or make them once.

``tests/fixtures/llmcompressor/make_checkpoints.py`` makes them with llm-compressor's own
``oneshot`` in ``.venv-llmcompressor`` (``scripts/setup_llmcompressor_venv.sh``; another
venv: ``$KVSCALE_LLMCOMPRESSOR_VENV``). They are cached under
``build/llmcompressor/<key>/`` (``key``: the script's hash), so the script runs once per
change of the script. Without the venv and without a cached set, the caller is skipped,
saying how to get one.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import subprocess
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "tests" / "fixtures" / "llmcompressor" / "make_checkpoints.py"
ROOT = REPO / "build" / "llmcompressor"
SETUP = "scripts/setup_llmcompressor_venv.sh"
#: Seconds the script may take (it takes ~10 s for the tiny set on 2 CPU cores).
MAKE_TIMEOUT = 900


def venv_python() -> Path:
    """The llm-compressor venv's interpreter (which may not exist)."""
    venv = os.environ.get("KVSCALE_LLMCOMPRESSOR_VENV") or str(REPO / ".venv-llmcompressor")
    return Path(venv) / "bin" / "python"


@cache
def _script() -> ModuleType:
    """make_checkpoints.py as a module: its recipe names and cache key (stdlib only at
    import time, so any interpreter can load it)."""
    spec = importlib.util.spec_from_file_location("kvscale_lc_make_checkpoints", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def checkpoint_names() -> tuple[str, ...]:
    """The seven checkpoints' names, in the script's order."""
    return tuple(_script().RECIPES)


def checkpoint_folder() -> Path:
    """Where the current script's tiny set is (or will be) cached."""
    return ROOT / _script().cache_key(SCRIPT, None)


def llmcompressor_checkpoints() -> dict[str, Path]:
    """name -> checkpoint dir of the tiny set, made now if not cached.

    Skips the calling test (``pytest.skip``) when neither a cached set nor the venv is
    there; a failing script is an error, with its output.
    """
    import pytest

    folder = checkpoint_folder()
    names = checkpoint_names()
    if not (folder / "manifest.json").is_file():
        python = venv_python()
        if not python.is_file():
            pytest.skip(
                f"no llm-compressor venv ({python} missing) and no cached checkpoints in "
                f"{folder}: run {SETUP} (what `make envs` does) to make them"
            )
        ROOT.mkdir(parents=True, exist_ok=True)
        with open(ROOT / ".lock", "w") as lock:  # one maker at a time (parallel sessions)
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "manifest.json").is_file():
                _make(python)
    missing = [n for n in names if not (folder / n / "config.json").is_file()]
    if missing:
        raise RuntimeError(f"{folder}: manifest.json written but {', '.join(missing)} missing")
    return {n: folder / n for n in names}


def _make(python: Path) -> None:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [str(python), str(SCRIPT), "--root", str(ROOT)],
        capture_output=True,
        text=True,
        timeout=MAKE_TIMEOUT,
        env=env,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{SCRIPT.name} failed (exit {proc.returncode}) in {python}:\n"
            + (proc.stdout + proc.stderr)[-4000:]
        )


def manifest(folder: Path) -> dict:
    """What the script recorded: versions, seconds per checkpoint."""
    return json.loads((folder / "manifest.json").read_text())


def quantization_config(ckpt: Path) -> dict:
    """``config.json``'s ``quantization_config`` as llm-compressor wrote it."""
    return json.loads((ckpt / "config.json").read_text())["quantization_config"]


def attention_tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every ``self_attn.*_scale`` / ``*_zero_point`` tensor directly on an attention
    module (not a projection's ``weight_scale`` / ``input_scale``), by checkpoint name."""
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    for path in sorted(ckpt.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                parent, _, leaf = name.rpartition(".")
                if parent.endswith("self_attn") and leaf.endswith(("_scale", "_zero_point")):
                    out[name] = f.get_tensor(name)
    return out
