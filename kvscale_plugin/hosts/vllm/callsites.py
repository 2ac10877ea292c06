"""Whether a vLLM function still calls what puts kvscale on the path vLLM takes: read from
its source (live: ``inspect``; statically: the AST of a release's sources). A name that
exists but is no longer called would otherwise pass a name-only check."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any


def called_names(tree: ast.AST) -> set[str]:
    """The names of the functions a function's body calls (``f(...)``, ``x.f(...)``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Name):
                names.add(func.id)
            elif isinstance(func, ast.Attribute):
                names.add(func.attr)
    return names


def calls_problem(callee: str, found: set[str] | None) -> str | None:
    """Why a target that must call ``callee`` is not on the path (None: it calls it, or
    its source cannot be read)."""
    if not callee or found is None or callee in found:
        return None
    return f"no longer calls {callee}(): kvscale would not be on the path vLLM takes"


def live_calls(obj: Any) -> set[str] | None:
    func = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    try:
        return called_names(ast.parse(textwrap.dedent(inspect.getsource(func))))
    except (OSError, TypeError, SyntaxError):
        return None
