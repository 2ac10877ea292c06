"""``kvscale calibrate``: FP8 KV-cache scales for a checkpoint that has none.

Runs the model with transformers on calibration text and records, per attention layer
(and per KV head for ``--scheme attn_head``), the absolute maximum of exactly what the
KV cache stores: the keys after rotary embedding (and after any k-norm, e.g. Qwen3's),
and the values. The scale is ``amax / 448`` (448 = the largest FP8 e4m3 value), so the
largest observed element maps to the edge of the FP8 range; a scale is never below
``SCALE_FLOOR`` (a layer whose K or V is all zeros would otherwise get 0, which engines
reject as corrupt).

The result is a new checkpoint directory that compressed-tensors-aware engines
understand: the original weights (hard-linked, or copied across file systems),
``quantization_config.kv_cache_scheme`` added to an existing compressed-tensors config
(weight schemes kept) or a minimal new one written the way llm-compressor writes a
KV-cache-only config, and float32 scale tensors ``<attention module>.k_scale`` /
``.v_scale`` (shape ``[1]`` for ``tensor``, ``[num_kv_heads, 1, 1]`` for ``attn_head``).
The model directory is never modified.

Modules, in the order a run uses them:

* ``corpus`` -- calibration text: the built-in corpus, ``--samples FILE``;
* ``observer`` -- the transformers run that records K/V abs maxima (``KVRecorder``, the one
  recording code path; ``load_model``, ``observe``);
* ``maths`` -- scales from maxima (``scale_from_amax``, ``scales_from_observed``);
* ``write`` -- OUT_DIR (``write_checkpoint``, ``read_scales``, the config it writes);
* ``pipeline`` -- all of it in one call (``calibrate``);
* ``trainer`` -- the same recording around a trainer's own forward pass, max-reduced over
  data-parallel ranks, returning the scale tensors to send (``record_kv_scales``);
* ``drift`` -- with the scales in force, how far that forward's K / V drifted from them
  (amax ratio, clipped fraction, a refresh / keep verdict: ``Drift``, ``DriftThresholds``);
* ``simulate`` -- an FP8 KV cache simulated in transformers' attention (``simulate_fp8_cache``);
* ``check`` -- ``--check``: how a checkpoint's own k/v scales fit the text (``check.check``,
  ``check.to_json``; not re-exported here: the module is named like its function);
* ``cli`` -- the command's arguments, run and summary;
* ``common`` -- the error, choices and file names they share.

Importing this package imports no torch: the names below are loaded from their module
on first use (``corpus``, ``common`` and ``cli`` are torch-free, the others need torch).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvscale_plugin.calibration.cli import add_arguments, render_summary, run
    from kvscale_plugin.calibration.common import (
        CALIBRATION_RECORD,
        DTYPE_CHOICES,
        SCALES_SHARD,
        SCHEMES,
        CalibrationError,
    )
    from kvscale_plugin.calibration.corpus import (
        CORPUS_FILE,
        DATA_DIR,
        builtin_corpus,
        read_samples,
    )
    from kvscale_plugin.calibration.drift import Drift, DriftThresholds
    from kvscale_plugin.calibration.maths import (
        SCALE_FLOOR,
        reads_other_cache,
        scale_from_amax,
        scales_from_observed,
    )
    from kvscale_plugin.calibration.observer import (
        ATTN_IMPLEMENTATION,
        KVRecorder,
        Observed,
        load_model,
        observe,
        weights_dtype,
    )
    from kvscale_plugin.calibration.pipeline import CalibrationResult, calibrate
    from kvscale_plugin.calibration.simulate import fp8_roundtrip, simulate_fp8_cache
    from kvscale_plugin.calibration.trainer import KVScaleRecorder, record_kv_scales
    from kvscale_plugin.calibration.write import (
        kv_cache_scheme,
        quantization_config_with_kv,
        read_scales,
        write_checkpoint,
    )

#: Public name -> the module (in this package) that defines it.
_EXPORTS = {
    **dict.fromkeys(("add_arguments", "render_summary", "run"), "cli"),
    **dict.fromkeys(
        ("CALIBRATION_RECORD", "DTYPE_CHOICES", "SCALES_SHARD", "SCHEMES", "CalibrationError"),
        "common",
    ),
    **dict.fromkeys(("Drift", "DriftThresholds"), "drift"),
    **dict.fromkeys(("CORPUS_FILE", "DATA_DIR", "builtin_corpus", "read_samples"), "corpus"),
    **dict.fromkeys(
        ("SCALE_FLOOR", "reads_other_cache", "scale_from_amax", "scales_from_observed"), "maths"
    ),
    **dict.fromkeys(
        ("ATTN_IMPLEMENTATION", "KVRecorder", "Observed", "load_model", "observe", "weights_dtype"),
        "observer",
    ),
    **dict.fromkeys(("CalibrationResult", "calibrate"), "pipeline"),
    **dict.fromkeys(("fp8_roundtrip", "simulate_fp8_cache"), "simulate"),
    **dict.fromkeys(("KVScaleRecorder", "record_kv_scales"), "trainer"),
    **dict.fromkeys(
        ("kv_cache_scheme", "quantization_config_with_kv", "read_scales", "write_checkpoint"),
        "write",
    ),
}

__all__ = [
    "ATTN_IMPLEMENTATION",
    "CALIBRATION_RECORD",
    "CORPUS_FILE",
    "DATA_DIR",
    "DTYPE_CHOICES",
    "Drift",
    "DriftThresholds",
    "SCALES_SHARD",
    "SCALE_FLOOR",
    "SCHEMES",
    "CalibrationError",
    "CalibrationResult",
    "KVRecorder",
    "KVScaleRecorder",
    "Observed",
    "add_arguments",
    "builtin_corpus",
    "calibrate",
    "fp8_roundtrip",
    "kv_cache_scheme",
    "load_model",
    "observe",
    "quantization_config_with_kv",
    "read_samples",
    "read_scales",
    "reads_other_cache",
    "record_kv_scales",
    "render_summary",
    "run",
    "scale_from_amax",
    "scales_from_observed",
    "simulate_fp8_cache",
    "weights_dtype",
    "write_checkpoint",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
