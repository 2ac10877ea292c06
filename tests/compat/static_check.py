"""Resolve a host's internals in a release's *sources* (an unpacked wheel), without importing.

Used for host releases that cannot run here (vLLM 0.33's GPU build, SGLang 0.5.21 /
0.5.22): each target's module file is parsed, the attribute chain followed through
top-level definitions, re-exports (``from x import y``, relative or absolute), class
bodies and their base classes, and the parameters of a function target compared with the
ones kvscale passes or reads.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any


class Sources:
    """The Python sources of one release, rooted at the folder holding its package."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def module_file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    @functools.cache  # noqa: B019 - one Sources per release, kept for the run
    def tree(self, module: str) -> ast.Module | None:
        path = self.module_file(module)
        return ast.parse(path.read_text(encoding="utf-8")) if path is not None else None

    def resolve(self, module: str, attr: str) -> ast.AST | str:
        """The AST node ``module.attr`` names, or a string saying why it is missing."""
        tree = self.tree(module)
        if tree is None:
            return f"module {module} not found"
        if not attr:
            return tree
        parts = attr.split(".")
        found = self._in_module(module, parts[0], depth=0)
        if isinstance(found, str):
            return found
        owner_module, node = found
        for part in parts[1:]:
            if not isinstance(node, ast.ClassDef):
                return f"{'.'.join(parts[: parts.index(part)])} is not a class"
            member = self._in_class(owner_module, node, part, depth=0)
            if isinstance(member, str):
                return member
            owner_module, node = member
        return node

    def _in_module(self, module: str, name: str, depth: int) -> tuple[str, ast.AST] | str:
        if depth > 12:
            return f"{module}.{name}: re-export chain too deep"
        tree = self.tree(module)
        if tree is None:
            # ``from package import submodule``
            return f"module {module} not found"
        for node in _top_level(tree):
            if _defines(node, name):
                return module, node
            if isinstance(node, ast.ImportFrom):
                if any(alias.name == "*" for alias in node.names):
                    source = _absolute(module, node, self.module_file(module))
                    found = self._in_module(source, name, depth + 1)
                    if not isinstance(found, str):
                        return found
                    continue
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        source = _absolute(module, node, self.module_file(module))
                        sub = f"{source}.{alias.name}"
                        if self.module_file(sub) is not None:
                            return sub, self.tree(sub)  # type: ignore[return-value]
                        return self._in_module(source, alias.name, depth + 1)
        if self.module_file(f"{module}.{name}") is not None:
            return f"{module}.{name}", self.tree(f"{module}.{name}")  # type: ignore[return-value]
        if any(
            isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in _top_level(tree)
        ) and _mentions(tree, name):
            return module, ast.Name(id=name)  # a lazy module attribute (PEP 562)
        return f"{module} has no {name}"

    def _in_class(
        self, module: str, cls: ast.ClassDef, name: str, depth: int
    ) -> tuple[str, ast.AST] | str:
        for node in cls.body:
            if _defines(node, name):
                return module, node
        if depth > 12:
            return f"{cls.name}.{name}: class chain too deep"
        for base in cls.bases:
            base_name = base.id if isinstance(base, ast.Name) else None
            if base_name is None:
                continue
            found = self._in_module(module, base_name, depth + 1)
            if isinstance(found, str) or not isinstance(found[1], ast.ClassDef):
                continue
            member = self._in_class(found[0], found[1], name, depth + 1)
            if not isinstance(member, str):
                return member
        return f"{cls.name} has no {name}"


def _defines(node: ast.AST, name: str) -> bool:
    """Whether a statement defines ``name`` (def, class, or assignment to the bare name)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name == name
    if isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return any(isinstance(t, ast.Name) and t.id == name for t in targets)
    return False


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Module statements, including those under top-level ``if`` / ``try``."""
    out: list[ast.stmt] = []
    stack = list(tree.body)
    while stack:
        node = stack.pop(0)
        out.append(node)
        if isinstance(node, ast.If):
            stack.extend(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            stack.extend(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                stack.extend(handler.body)
    return out


def _mentions(tree: ast.Module, name: str) -> bool:
    return any(
        isinstance(n, ast.Constant) and n.value == name or isinstance(n, ast.Name) and n.id == name
        for n in ast.walk(tree)
    )


def _absolute(module: str, node: ast.ImportFrom, path: Path | None) -> str:
    if not node.level:
        return node.module or ""
    package = (
        module if path is not None and path.name == "__init__.py" else module.rsplit(".", 1)[0]
    )
    parts = package.split(".")
    if node.level > 1:
        parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def param_names(node: ast.AST) -> list[str] | None:
    """A function node's parameter names without ``self`` / ``cls`` (None: not a function)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    args = node.args
    if args.vararg is not None:
        return None  # takes anything positionally
    names = [a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs)]
    return [n for n in names if n not in ("self", "cls")]


def target_problem(
    sources: Sources,
    module: str,
    attr: str,
    params: tuple[str, ...] = (),
    leading: bool = True,
) -> str | None:
    """Why ``module.attr`` does not resolve in ``sources`` with ``params`` (None: it does).

    ``leading``: ``params`` are the target's first parameters in order; else each must
    merely exist."""
    node = sources.resolve(module, attr)
    if isinstance(node, str):
        return node
    found = param_names(node)
    if not params or found is None:
        return None
    if leading and tuple(found[: len(params)]) != params:
        return f"parameters ({', '.join(found)}), expected ({', '.join(params)}, ...)"
    if not leading and (missing := [p for p in params if p not in found]):
        return f"parameters ({', '.join(found)}) lack {', '.join(missing)}"
    return None


def fetch_sources(requirement: str, package: str, cache: Path) -> Sources:
    """``pip download --no-deps requirement`` (once) and unpack its ``package`` sources
    (``*.py`` only) into ``cache``. Raises ``RuntimeError`` with pip's output.

    Safe when several processes fetch into one cache at once (pytest-xdist workers, the
    SGLang side of ``make test``): one fetch per requirement at a time (a file lock), each
    into a download folder of its own, so nobody opens a wheel another is still writing."""
    name = requirement.replace("==", "-")
    unpacked = cache / name
    marker = unpacked / ".complete"
    if marker.exists():
        return Sources(unpacked)
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not marker.exists():
            with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as wheels:
                proc = subprocess.run(
                    [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels]
                    + [requirement],
                    capture_output=True,
                    text=True,
                    timeout=1200,
                )
                dist, version = requirement.split("==")
                stem = dist.replace("-", "_")
                matches = sorted(Path(wheels).glob(f"{stem}-{version}-*.whl"))
                if proc.returncode != 0 or not matches:
                    raise RuntimeError(f"pip download {requirement} failed: {proc.stderr[-2000:]}")
                with zipfile.ZipFile(matches[0]) as zf:
                    for member in zf.namelist():
                        if member.startswith(f"{package}/") and member.endswith(".py"):
                            zf.extract(member, unpacked)
            marker.touch()
    return Sources(unpacked)


def internal_problem(sources: Sources, internal: Any) -> str | None:
    """Why one of kvscale's ``internals.Internal`` targets does not hold in ``sources``:
    it resolves in none of its modules (``module``, then each of ``moved``), its
    parameters changed, or it no longer calls what puts kvscale on vLLM's path."""
    first: str | None = None
    for module in internal.modules:
        why = target_problem(sources, module, internal.attr, internal.params)
        if why is None:
            return _calls_problem(sources, module, internal)
        first = first or why
    return first


def resolved_module(sources: Sources, internal: Any) -> str | None:
    """The module (of ``internal.modules``) the target resolves in, or None."""
    for module in internal.modules:
        if not isinstance(sources.resolve(module, internal.attr), str):
            return module
    return None


def _calls_problem(sources: Sources, module: str, internal: Any) -> str | None:
    from kvscale_plugin.hosts.vllm.callsites import called_names, calls_problem

    if not internal.calls:
        return None
    node = sources.resolve(module, internal.attr)
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    return calls_problem(internal.calls, called_names(node))


def definitions_named(sources: Sources, name: str, package: str = "vllm") -> list[str]:
    """Every module-level or class-level definition of ``name`` in the release, as
    ``module.name`` / ``module.Class.name``: where a moved target may live now."""
    found = []
    for path in sorted((sources.root / package).rglob("*.py")):
        module = ".".join(path.relative_to(sources.root).with_suffix("").parts)
        module = module.removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in _top_level(tree):
            if _defines(node, name):
                found.append(f"{module}.{name}")
            if isinstance(node, ast.ClassDef):
                found.extend(
                    f"{module}.{node.name}.{name}" for member in node.body if _defines(member, name)
                )
    return found
