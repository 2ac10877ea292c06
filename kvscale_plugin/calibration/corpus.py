"""Calibration text (imports no torch).

A built-in corpus of English prose (``kvscale_plugin/data/calibration_corpus.jsonl``:
prose of the Python documentation, PSF License; see ``calibration_corpus.LICENSE.txt``
next to it), split into a ``calibration`` and a ``heldout`` part; or ``--samples FILE``: a
``.jsonl`` file (one JSON object with a ``"text"`` field, or a JSON string, per line) or a
plain text file (split at blank lines; consecutive paragraphs are packed into samples of
about ``--max-len`` tokens).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from kvscale_plugin.calibration.common import CalibrationError

DATA_DIR = Path(__file__).parent.parent / "data"
CORPUS_FILE = DATA_DIR / "calibration_corpus.jsonl"


def builtin_corpus(split: str = "calibration") -> list[str]:
    """Texts of the built-in corpus: ``"calibration"``, ``"heldout"`` or ``"all"``."""
    if split not in ("calibration", "heldout", "all"):
        raise ValueError(f"unknown split {split!r}")
    texts = []
    with open(CORPUS_FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if split == "all" or row["split"] == split:
                texts.append(row["text"])
    return texts


def read_samples(path: str | os.PathLike[str], max_len: int = 512) -> list[str]:
    """Calibration texts from a ``.jsonl`` file or a plain text file (see module doc)."""
    p = Path(path)
    try:
        raw = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(f"{p}: cannot read samples: {exc}") from exc
    texts: list[str] = []
    if p.suffix.lower() in (".jsonl", ".ndjson"):
        for n, line in enumerate(raw.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{p}:{n}: not valid JSON ({exc})") from exc
            text = row.get("text") if isinstance(row, dict) else row
            if not isinstance(text, str):
                raise CalibrationError(
                    f'{p}:{n}: expected a JSON string or an object with a "text" string'
                )
            if text.strip():
                texts.append(text)
    else:
        # ~4 characters per token for English: pack paragraphs up to about max_len tokens.
        budget = 4 * max_len
        current: list[str] = []
        for para in re.split(r"\n\s*\n", raw):
            para = " ".join(para.split())
            if not para:
                continue
            current.append(para)
            if sum(len(x) + 1 for x in current) >= budget:
                texts.append("\n\n".join(current))
                current = []
        if current:
            texts.append("\n\n".join(current))
    if not texts:
        raise CalibrationError(f"{p}: no calibration text found")
    return texts


def pick_texts(texts: Sequence[str] | None, num_samples: int | None, purpose: str) -> list[str]:
    """The samples a run uses: ``texts`` (default: the built-in corpus' calibration split),
    the first ``num_samples`` of them (all when None or 0); an empty set is an error."""
    if texts is None:
        texts = builtin_corpus("calibration")
    picked = list(texts)[:num_samples] if num_samples else list(texts)
    if not picked:
        raise CalibrationError(f"no samples to {purpose} with")
    return picked
