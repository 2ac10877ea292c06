"""The one reversible path by which kvscale changes vLLM: ``replace`` (an attribute) and
``replace_item`` (an entry of a module-level dict), journaled inside ``transaction`` so
that a feature whose installation fails half way is rolled back. Imports nothing of vLLM.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from kvscale_plugin._log import warn_once
from kvscale_plugin.hosts.vllm.process import HOST

_MISSING = object()


def _record(entry: tuple[Any, ...]) -> None:
    log = getattr(HOST.journal, "entries", None)
    if log is not None:
        log.append(entry)


def replace(owner: Any, name: str, value: Any) -> None:
    """``setattr(owner, name, value)``, undone if the enclosing ``transaction`` fails."""
    with HOST.lock:
        original = (
            owner.__dict__.get(name, _MISSING)
            if isinstance(owner, type)
            else getattr(owner, name, _MISSING)
        )
        setattr(owner, name, value)
        _record(("attr", owner, name, original))


def replace_item(mapping: dict[Any, Any], key: Any, value: Any) -> None:
    """``mapping[key] = value`` (a module-level dict of vLLM's), undone like ``replace``."""
    with HOST.lock:
        original = mapping.get(key, _MISSING)
        mapping[key] = value
        _record(("item", mapping, key, original))


def _undo(entries: list[tuple[Any, ...]]) -> None:
    for kind, owner, name, original in reversed(entries):
        with contextlib.suppress(Exception):
            if kind == "item":
                if original is _MISSING:
                    del owner[name]
                else:
                    owner[name] = original
            elif original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


@contextlib.contextmanager
def transaction() -> Iterator[None]:
    """Every ``replace`` inside is rolled back if the block raises (then re-raised)."""
    outer = getattr(HOST.journal, "entries", None)
    entries: list[tuple[Any, ...]] = []
    HOST.journal.entries = entries
    try:
        yield
    except BaseException:
        _undo(entries)
        raise
    finally:
        HOST.journal.entries = outer
    if outer is not None:
        outer.extend(entries)


def ensure(feature: str, install: Callable[[], Any], cause: str, lost: str) -> Any:
    """Where ``feature`` is installed here: ``install()`` (idempotent), all or nothing, and
    what it returns. Never raises: a failure costs that part of ``feature`` only, said once
    (``lost`` % (exception type, exception))."""
    if feature not in HOST.installed:
        return None
    try:
        with transaction():
            return install()
    except Exception as exc:  # noqa: BLE001 - costs this part of the feature only
        warn_once(cause, lost, type(exc).__name__, exc)
        return None
