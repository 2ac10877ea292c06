"""What every step of ``kvscale calibrate`` shares (imports no torch): the error, the
choices, the names of the files written, and the order layers are listed in."""

from __future__ import annotations

import re
from collections.abc import Iterable

SCHEMES = ("tensor", "attn_head")
#: ``--dtype`` choices; ``auto`` is the dtype of the stored weights.
DTYPE_CHOICES = ("auto", "bfloat16", "float16", "float32")
#: Written into OUT_DIR: how the scales were obtained (samples, tokens, per-layer maxima).
CALIBRATION_RECORD = "kvscale_calibration.json"
#: Shard that receives the scale tensors of a sharded checkpoint.
SCALES_SHARD = "model-kvscale-kv-scales.safetensors"


class CalibrationError(Exception):
    """Unusable input or output (the message says what to do); the CLI exits with 2."""


def check_scheme(scheme: str, error: type[Exception] = ValueError) -> None:
    """Raise ``error`` unless ``scheme`` is one of ``SCHEMES``."""
    if scheme not in SCHEMES:
        raise error(f"unknown scheme {scheme!r}; choose one of {', '.join(SCHEMES)}")


def _layer_number(name: str) -> int:
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name + ".")
    return int(m.group(1)) if m else -1


def sorted_modules(names: Iterable[str]) -> list[str]:
    """Attention module names in layer order (``layers.2`` before ``layers.10``)."""
    return sorted(names, key=lambda n: (_layer_number(n), n))
