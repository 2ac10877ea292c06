"""Write ``tasks/corpus.jsonl``: the documents the lm-eval task ``kvscale_prose`` scores.

Every document is English prose under the PSF License Agreement (the text of the licence:
``kvscale_plugin/data/calibration_corpus.LICENSE.txt``), one JSON object per line:
``{"text", "source", "licence"}``. Two parts, neither seen by ``kvscale calibrate``'s
default corpus split:

* the "heldout" split of kvscale's built-in corpus (``kvscale_plugin/data/
  calibration_corpus.jsonl``: prose of the Python 3.11 documentation);
* module docstrings of CPython's standard library (``MODULES`` below, and
  ``heapq.__about__``) as the running interpreter ships them: the paragraphs that are
  not code (no indented or ``>>>`` line), whitespace joined, when at least 500 characters
  remain. The committed file was made with CPython 3.11.7.

    python benchmarks/lm_eval/make_corpus.py      # rewrites benchmarks/lm_eval/tasks/corpus.jsonl
"""

from __future__ import annotations

import importlib
import json
import platform
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "tasks" / "corpus.jsonl"
PSF = "PSF License Agreement (kvscale_plugin/data/calibration_corpus.LICENSE.txt)"
#: Standard-library modules whose docstrings are prose (checked: >= 500 characters left).
MODULES = (
    "shelve",
    "unittest",
    "doctest",
    "sched",
    "io",
    "timeit",
    "socketserver",
    "pdb",
    "statistics",
    "fileinput",
    "site",
    "pydoc",
    "gc",
    "cmd",
)
MIN_CHARS = 500


def prose(doc: str) -> str:
    """The paragraphs of ``doc`` that are not code, each one line, joined by a blank line."""
    keep = []
    for para in doc.split("\n\n"):
        lines = [ln for ln in para.splitlines() if ln.strip()]
        if not lines or any(ln.startswith((" ", "\t", ">>>")) for ln in lines):
            continue
        keep.append(" ".join(" ".join(lines).split()))
    return "\n\n".join(keep)


def documents() -> list[dict[str, str]]:
    sys.path.insert(0, str(HERE.parent.parent))
    from kvscale_plugin.calibration.corpus import CORPUS_FILE

    docs = []
    with open(CORPUS_FILE, encoding="utf-8") as f:
        for line in f:
            row = json.loads(line)
            if row["split"] == "heldout":
                src = f"{row['source']} (kvscale built-in corpus, heldout split)"
                docs.append({"text": row["text"], "source": src, "licence": PSF})
    python = f"CPython {platform.python_version()}"
    for name, text in [("heapq.__about__", importlib.import_module("heapq").__about__)] + [
        (m, importlib.import_module(m).__doc__ or "") for m in MODULES
    ]:
        body = prose(text)
        if len(body) < MIN_CHARS:
            raise SystemExit(f"{name}: only {len(body)} characters of prose (< {MIN_CHARS})")
        docs.append({"text": body, "source": f"{python} standard library: {name}", "licence": PSF})
    return docs


def main() -> int:
    docs = documents()
    with open(CORPUS, "w", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps(d, ensure_ascii=False) + "\n")
    print(f"{CORPUS}: {len(docs)} documents, {sum(len(d['text']) for d in docs)} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
