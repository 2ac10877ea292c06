"""kvscale's SGLang host in this process (imports no SGLang): the entry point makes it,
``method.activate`` uses it."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class SGLangHost:
    """Made once ``register`` succeeded: ``activate`` installs what a kvscale model needs
    (called in a process that builds one; everywhere else SGLang runs its own code)."""

    activate: Callable[[], None]


#: This process's host (None: not registered; a test installs None to register again).
host: SGLangHost | None = None
lock = threading.Lock()
