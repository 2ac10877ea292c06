"""Read back what ``kvscale_plugin.demo.tinymodels.build_tiny_checkpoint`` wrote."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from kvscale_plugin.demo.tinymodels import REFERENCE_TEXT


def read_stored_scales(model_dir: str | os.PathLike[str]) -> dict[int, dict[str, float]]:
    """The per-layer k/v scales ``build_tiny_checkpoint`` stored."""
    meta = json.loads((Path(model_dir) / "kvscale_tiny.json").read_text())
    return {int(i): v for i, v in meta["stored_scales"].items()}


def checkpoint_scale_tensors(model_dir: str | os.PathLike[str]) -> dict:
    """A checkpoint's k/v scale tensors (every shard), named as on disk: what a trainer
    holding the same scales sends (``fingerprint.scale_kinds`` names)."""
    from safetensors.torch import load_file

    from kvscale_plugin.fingerprint import scale_kinds

    tensors = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        tensors.update({n: t for n, t in load_file(str(path)).items() if scale_kinds(n)})
    return tensors


def read_stored_mtp_scales(model_dir: str | os.PathLike[str]) -> dict[int, dict[str, float]]:
    """The k/v scales ``build_tiny_checkpoint`` stored per MTP layer (counted from 0)."""
    meta = json.loads((Path(model_dir) / "kvscale_tiny.json").read_text())
    return {int(i): v for i, v in meta.get("stored_mtp_scales", {}).items()}


def reference_token_ids(model_dir: str | os.PathLike[str]) -> Sequence[int]:
    """Token ids of ``REFERENCE_TEXT`` under the checkpoint's tokenizer."""
    import transformers

    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(Path(model_dir) / "tokenizer.json")
    )
    return tok(REFERENCE_TEXT)["input_ids"]
