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


def follow_host_logging(host_logger: str) -> bool:
    """Show kvscale's records the way the host shows its own (its handlers and level),
    when the user has not configured kvscale's logger: without this a host that keeps
    its logs to itself (vLLM's ``vllm`` logger does not propagate) shows only kvscale's
    warnings, through Python's last-resort handler, and never its INFO lines.

    Records still propagate (to whatever the user or a test attached to the root).
    Returns whether kvscale's logger now follows ``host_logger``."""
    host = logging.getLogger(host_logger)
    if logger.handlers or logger.level != logging.NOTSET or not host.handlers:
        return False  # configured by the user already, or nothing to follow
    for handler in host.handlers:
        logger.addHandler(handler)
    logger.setLevel(host.getEffectiveLevel())
    return True
