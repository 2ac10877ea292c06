"""Logging with once-per-cause warnings (each process warns once per distinct cause)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable

logger = logging.getLogger("kvscale_plugin")


class Notices:
    """The causes this process has warned (or told) about, each said once: one per process
    (``notices``); a test installs a fresh one to hear its own."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def first(self, cause: str) -> bool:
        """Whether ``cause`` is new (from now on it is not)."""
        with self._lock:
            new = cause not in self._seen
            self._seen.add(cause)
        return new


notices = Notices()


def warn_once(cause: str, message: str, *args: object) -> bool:
    """Log ``message`` at WARNING the first time ``cause`` is seen; return whether it was."""
    if not notices.first(cause):
        return False
    logger.warning(message, *args, stacklevel=2)
    return True


def info_once(cause: str, message: str, *args: object) -> bool:
    """Log ``message`` at INFO the first time ``cause`` is seen; return whether it was."""
    if not notices.first(cause):
        return False
    logger.info(message, *args, stacklevel=2)
    return True


class _HostHandlers(logging.Handler):
    """Hands each kvscale record to the host logger's handlers as they are when the record
    is emitted, at the host's level then: a host may configure its logging after plugins
    load (vLLM 0.32 does, in an in-process engine). Without host handlers (and none on the
    root), warnings still reach Python's last-resort handler, as they would without this."""

    def __init__(self, host_logger: str) -> None:
        super().__init__()
        self.host_logger = host_logger

    def emit(self, record: logging.LogRecord) -> None:
        host = logging.getLogger(self.host_logger)
        if host.handlers:
            if record.levelno < host.getEffectiveLevel():
                return
            # A handler the host shares with the root gets the record by propagation.
            shared = set(logging.getLogger().handlers) if logger.propagate else set()
            for handler in host.handlers:
                if handler not in shared and record.levelno >= handler.level:
                    handler.handle(record)
        elif not logging.getLogger().handlers and record.levelno >= logging.lastResort.level:
            logging.lastResort.handle(record)


def follow_host_logging(host_logger: str) -> bool:
    """Show kvscale's records the way the host shows its own (its handlers and level, as
    they are when a record is logged), when the user has not configured kvscale's logger:
    without this a host that keeps its logs to itself (vLLM's ``vllm`` logger does not
    propagate) shows only kvscale's warnings, through Python's last-resort handler, and
    never its INFO lines.

    Records still propagate (to whatever the user or a test attached to the root).
    Returns whether kvscale's logger now follows ``host_logger``."""
    if logger.handlers or logger.level != logging.NOTSET:
        return False  # configured by the user already (or following a host already)
    logger.addHandler(_HostHandlers(host_logger))
    # INFO lines are made (the host's own default level); the handler above applies the
    # host's level when it hands them on, and propagation is left as Python does it.
    logger.setLevel(logging.INFO)
    return True


def shorten(names: Iterable[str], noun: str = "layers", most: int = 4) -> str:
    """``names`` sorted, the first ``most`` shown, then how many there are in all."""
    ordered = sorted(names)
    more = f", ... ({len(ordered)} {noun})" if len(ordered) > most else ""
    return ", ".join(ordered[:most]) + more
