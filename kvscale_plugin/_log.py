"""Logging with once-per-cause warnings (each process warns once per distinct cause)."""

from __future__ import annotations

import logging
import threading

logger = logging.getLogger("kvscale_plugin")

_seen: set[str] = set()
_lock = threading.Lock()


def warn_once(cause: str, message: str, *args: object) -> bool:
    """Log ``message`` at WARNING the first time ``cause`` is seen; return whether it was."""
    with _lock:
        if cause in _seen:
            return False
        _seen.add(cause)
    logger.warning(message, *args)
    return True


def reset_warnings() -> None:
    """Forget which causes were warned about (tests, and a new engine in the same process)."""
    with _lock:
        _seen.clear()


def info_once(cause: str, message: str, *args: object) -> bool:
    """Log ``message`` at INFO the first time ``cause`` is seen; return whether it was."""
    with _lock:
        if cause in _seen:
            return False
        _seen.add(cause)
    logger.info(message, *args)
    return True
