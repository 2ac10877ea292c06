"""The vLLM host's state in this process, one object (``HOST``, as pluggy's ``PluginManager``
holds a plugin system's), made as vLLM's plugin loader imports the host (every process).
What belongs to one engine lives on its config, load cycle and layer records. Tests set
what they substitute on it (``HOST.fp8_cache_write``). Imports nothing of vLLM."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any


class Recording:
    """``scalepaths``: while a kvscale engine builds its model, where each module goes
    (weak references only) and which config builds it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # child module -> (its parent, the attribute name), for modules assigned meanwhile
        self.parents: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[Any], str]] = (
            weakref.WeakKeyDictionary()
        )
        self.handle: Any = None  # torch's module-registration hook, while recording
        self.building: Any = None  # the kvscale config whose engine builds its model
        # module -> the kvscale config of an attention layer it holds (to hand its loader)
        self.holds: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


class HostState:
    """Per process: registration, features installed and lost, what features built once."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.journal = threading.local()  # ``patching``: the open transaction, per thread
        self.registered = False  # ``--quantization kvscale`` registered (``register``)
        self.installed: set[str] = set()  # features active here (``activation``)
        self.lost: dict[str, str] | None = None  # activation's answer (None: not yet)
        # This process claimed a checkpoint for kvscale (vLLM's front end: engine cores and
        # workers get the config pickled); what only a front end installs reads it.
        self.front_end = False
        self.deployment_checked = False  # ``deployment.check_deployment`` ran
        self.cpu_write_announced = False  # the CPU write's INFO line was logged
        self.step_plans: Any = None  # ``cpu_cache_write.StepPlans``, at the first torch write
        self.cpu_subclasses: dict[type, type] = {}  # impl class -> kvscale's subclass
        self.backend_classes: dict[str, type] = {}  # the CUSTOM backend's, built on first use
        self.fp8_cache_write: Callable[..., None] | None = None  # its kernel, read per call
        self.recording = Recording()


HOST = HostState()
