"""Measure where the installed vLLM serves each architecture's attention modules and write
``kvscale_plugin/data/vllm_layers.json`` (``kvscale inspect``'s table; see
``kvscale_plugin/inspection/vllm_layers.py``): a ``-q kvscale`` engine per family of the
sweep (tests/support/kvscale_testing/families.py), the layer serving each checkpoint
module's distinct scales read back from it. The family sweep checks the table against the
live engines. Run: ``.venv/bin/python scripts/gen_vllm_layer_table.py`` (~2 min)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests" / "support"), str(ROOT / "tests" / "e2e")]

from _family_sweep import served  # noqa: E402
from kvscale_testing.families import (  # noqa: E402
    FAMILIES,
    build_family_checkpoint,
    layer_rows,
    stored_scales,
)

TABLE = ROOT / "kvscale_plugin" / "data" / "vllm_layers.json"


def main() -> None:
    import vllm

    release = vllm.__version__.split("+")[0]
    table = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    measured: dict[str, list[list[str]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for family in FAMILIES:
            ckpt = build_family_checkpoint(Path(tmp) / family.name, family)
            arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
            engine = served(ckpt, "kvscale")
            if isinstance(engine, str):
                print(f"{family.name}: engine failed: {engine}", file=sys.stderr)
                continue
            measured[arch] = layer_rows(stored_scales(ckpt), engine)
            print(f"{family.name} ({arch}): {measured[arch]}")
    table[release] = dict(sorted(measured.items()))
    TABLE.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {TABLE} ({len(measured)} architectures on vLLM {release})")


if __name__ == "__main__":
    main()
