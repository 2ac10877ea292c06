"""Where a vLLM attention impl computes the values it keeps from a layer's scale floats:
its ``if self.<attr> is None:`` blocks, read from a release's source (``ast``, no import:
FlashInfer's modules do not import without FlashInfer)."""

from __future__ import annotations

import ast
from collections.abc import Iterable


def fill_blocks(cls: ast.ClassDef, attrs: Iterable[str]) -> list[ast.If]:
    """The ``if self.<attr> is None:`` blocks of ``cls`` for ``attrs``, in source order."""
    wanted = set(attrs)
    found = []
    for node in ast.walk(cls):
        test = getattr(node, "test", None)
        if (
            isinstance(node, ast.If)
            and isinstance(test, ast.Compare)
            and isinstance(test.ops[0], ast.Is)
            and isinstance(test.left, ast.Attribute)
            and isinstance(test.left.value, ast.Name)
            and test.left.value.id == "self"
            and test.left.attr in wanted
        ):
            found.append(node)
    return sorted(found, key=lambda n: n.lineno)


def find_class(tree: ast.Module, name: str) -> ast.ClassDef | None:
    return next((n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == name), None)


def layer_floats_read(blocks: Iterable[ast.If]) -> set[str]:
    """The ``layer.<attr>`` names the blocks read."""
    return {
        n.attr
        for block in blocks
        for n in ast.walk(block)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "layer"
    }
