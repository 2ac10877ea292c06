"""The vLLM host's state in this process, in one object (``HOST``), as pluggy's
``PluginManager`` holds a plugin system's: made when vLLM's plugin loader imports the host
(``register``, in every vLLM process). What belongs to one engine (several are built in one
process) lives on its config, its load cycle and its layers' records instead. Tests set
what they substitute on it (``HOST.fp8_cache_write``). Imports nothing of vLLM."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class HostState:
    """Per process: registration, the features installed and lost, what the features
    built once (the CPU write's subclasses and step plans, the CUSTOM backend's classes)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.registered = False  # ``--quantization kvscale`` registered (``register``)
        self.installed: set[str] = set()  # features active here (``activation``)
        self.lost: dict[str, str] | None = None  # activation's answer (None: not yet)
        self.deployment_checked = False  # ``deployment.check_deployment`` ran
        self.cpu_write_announced = False  # the CPU write's INFO line was logged
        self.step_plans: Any = None  # ``cpu_cache_write.StepPlans``, at the first torch write
        self.cpu_subclasses: dict[type, type] = {}  # impl class -> kvscale's subclass
        self.backend_classes: dict[str, type] = {}  # the CUSTOM backend's, built on first use
        #: The CUSTOM backend's FP8 cache write (the fused kernel, bound when its classes
        #: are built; read at every call).
        self.fp8_cache_write: Callable[..., None] | None = None


HOST = HostState()
