"""The documents of the lm-eval task ``kvscale_prose`` (``corpus.jsonl`` next to this file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).resolve().parent / "corpus.jsonl"
FIELDS = ("text", "source", "licence")


def read_corpus(path: Path = CORPUS) -> list[dict[str, str]]:
    """Every document, checked: a JSON object per line with non-empty string fields
    ``text``, ``source`` and ``licence``."""
    docs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from exc
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            bad = [k for k in FIELDS if not isinstance(row.get(k), str) or not row[k].strip()]
            if bad:
                raise ValueError(f"{path}:{n}: field(s) {bad} missing or not a non-empty string")
            docs.append({k: row[k] for k in FIELDS})
    if not docs:
        raise ValueError(f"{path}: no documents")
    return docs


def load(**_: Any) -> dict[str, Any]:
    """lm-eval's ``custom_dataset``: ``{"test": datasets.Dataset}`` (lm-eval passes the
    task metadata as keyword arguments; none is needed)."""
    import hashlib

    import datasets
    import pyarrow

    # An explicit fingerprint: datasets would otherwise hash the table with dill, which
    # fails once vLLM is imported (pyarrow's MonthDayNano type cannot be pickled then).
    fingerprint = hashlib.sha256(CORPUS.read_bytes()).hexdigest()[:16]
    table = pyarrow.Table.from_pylist(read_corpus())
    return {"test": datasets.Dataset(table, fingerprint=fingerprint)}
