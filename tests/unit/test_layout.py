"""The package's shape, read from its source: no import circle among its modules (lazy
imports inside functions, ``if TYPE_CHECKING:`` imports and modules named in a string --
an ``importlib`` or ``pkgutil.resolve_name`` lookup -- all count: a circle broken by any
of them is still a circle), no module over 550 lines, and a core that imports no host
engine."""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "kvscale_plugin"
MAX_LINES = 550
HOSTS = ("vllm", "sglang", "sgl_kernel", "ray")
# The core (README, architecture): whatever is not a host adapter, the demo or the CLI.
NOT_CORE = ("kvscale_plugin.hosts", "kvscale_plugin.demo", "kvscale_plugin.cli")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imports(path: Path, modules: Iterable[str] = ()) -> set[str]:
    """Every module ``path`` imports (absolute names), wherever the import is, and every
    one of ``modules`` a string constant names (``"pkg.mod"`` or ``"pkg.mod:attr"``).

    ``from pkg import mod`` names ``pkg.mod`` when that is one of ``modules`` (importing
    a submodule runs its package's ``__init__`` anyway: not an edge of its own), else
    ``pkg``."""
    modules = set(modules)
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            named = node.value.split(":")[0] if node.value.startswith("kvscale_plugin.") else ""
            while named and named not in modules:
                named = named.rpartition(".")[0]
            if named:
                names.add(named)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                names.add(full if full in modules else node.module)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {dep for dep in _imports(path, modules) if dep in modules and dep != name}
        for name, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    assert _cycles(_graph()) == []


def test_the_circle_finder_finds_one() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


def test_lazy_type_checking_and_string_imports_all_count(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text(
        "import importlib\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from kvscale_plugin.hosts.vllm.method import KVScaleConfig\n"
        "def f():\n    from kvscale_plugin.hosts.vllm import reload\n"
        "def g():\n    return importlib.import_module('kvscale_plugin.hosts.vllm.mtp')\n"
        "H = 'kvscale_plugin.hosts.vllm.backend:CustomBackend'\n"
        "NOT_A_MODULE = 'kvscale_plugin: a message'\n"
    )
    names = _imports(module, _modules())
    assert {
        "kvscale_plugin.hosts.vllm.reload",
        "kvscale_plugin.hosts.vllm.method",
        "kvscale_plugin.hosts.vllm.mtp",
        "kvscale_plugin.hosts.vllm.backend",
    } <= names
    assert not any(n.startswith("kvscale_plugin:") for n in names)


@pytest.mark.parametrize("name", sorted(_modules()))
def test_module_size(name: str) -> None:
    lines = len(_modules()[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{name} has {lines} lines (at most {MAX_LINES}): split it"


def test_core_imports_no_host() -> None:
    offenders = {
        name: sorted(dep for dep in _imports(path) if dep.split(".")[0] in HOSTS)
        for name, path in _modules().items()
        if not name.startswith(NOT_CORE)
    }
    assert {k: v for k, v in offenders.items() if v} == {}
