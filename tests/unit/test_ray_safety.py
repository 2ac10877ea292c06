"""``kvscale_plugin.hosts.vllm.register()`` is safe where a Ray worker calls it.

vLLM's CPU build refuses Ray (``ValueError: current platform cpu does not support ray``),
so no Ray run is claimed here. What a Ray worker does with the plugin is read from vLLM
0.32's code:

* ``RayDistributedExecutor`` (``vllm/v1/executor/ray_executor.py``,
  ``_init_workers_ray``) sends ``collective_rpc("init_worker", args=(all_kwargs,))`` to
  each ``RayWorkerWrapper`` actor (``vllm/v1/executor/ray_utils.py``, a
  ``WorkerWrapperBase``); ``RayExecutorV2``'s ``RayWorkerProc`` (a ``WorkerProc``,
  ``vllm/v1/executor/multiproc_executor.py``) calls ``wrapper.init_worker(all_kwargs)``.
* ``WorkerWrapperBase.init_worker`` (``vllm/v1/worker/worker_base.py``) calls
  ``vllm.plugins.load_general_plugins()`` -- *after* its arguments, the pickled
  ``VllmConfig`` with our ``KVScaleConfig`` inside, were unpickled in the actor.
* ``load_general_plugins`` (``vllm/plugins/__init__.py``) loads every
  ``vllm.general_plugins`` entry point (``load_plugins_by_group``) and calls it:
  ``kvscale = kvscale_plugin.hosts.vllm:register``. Once per process (module flag), but
  a worker may also import and call it itself.

So ``register()`` must work in a fresh process with no driver state (no engine, no
config, no environment from the driver), after a ``KVScaleConfig`` was unpickled, any
number of times, from any thread.
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from kvscale_plugin.scheme import FP8_KV_SCHEME

QUANT_CONFIG = {
    "quant_method": "compressed-tensors",
    "config_groups": {},
    "format": "dense",
    "ignore": [],
    "kv_cache_scheme": dict(FP8_KV_SCHEME),
}

# Run in a fresh interpreter: a pickled KVScaleConfig (what a Ray actor receives) is
# unpickled first (a kvscale engine's process: it activates kvscale, registering the
# method), then vLLM's own plugin loader runs, twice, then register() from 8 threads at
# once, then twice more.
WORKER = r"""
import pickle, sys, threading
import kvscale_plugin.hosts.vllm.install as impl
calls = []
real = impl._scales
impl._scales = lambda: (calls.append(1), real())[1]
config = pickle.load(open(sys.argv[1], "rb"))          # the actor's arguments
from vllm.plugins import load_general_plugins
load_general_plugins(); load_general_plugins()         # WorkerWrapperBase.init_worker
from kvscale_plugin.hosts.vllm import register
barrier = threading.Barrier(8)
errors = []
def worker():
    try:
        barrier.wait(timeout=30)
        register()
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=worker) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join(timeout=60)
register(); register()
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
assert not errors, errors
assert calls == [1], calls                              # registered exactly once
assert QUANTIZATION_METHODS.count("kvscale") == 1, QUANTIZATION_METHODS
assert get_quantization_config("kvscale") is type(config), get_quantization_config("kvscale")
assert config.kv_verdict.supported and config.get_name() == "kvscale"
# Exposed for an FP8 pool, unless this CPU runs none (then `auto` keeps bf16).
assert isinstance(config.kv_cache_scheme, dict) or config.fp8_cache_unavailable
print("WORKER-OK", len(threads))
"""


def _clean_env(tmp_path: Path) -> dict[str, str]:
    """Only what a bare process has: no VLLM_* / KVSCALE_* settings from a driver."""
    keep = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k in keep}
    env["TMPDIR"] = str(tmp_path)
    env["HF_HUB_OFFLINE"] = "1"
    return env


# A bare process ("driver" side): nothing imported beforehand, no config, no engine;
# register() twice, then a KVScaleConfig is built and pickled, as vLLM ships it to workers.
BARE = r"""
import json, pickle, sys
from kvscale_plugin.hosts import vllm as host
host.register(); host.register()
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
assert QUANTIZATION_METHODS.count("kvscale") == 1, QUANTIZATION_METHODS
assert host.HOST.registered
print("BARE-OK")
from kvscale_plugin.hosts.vllm.method import KVScaleConfig
pickle.dump(KVScaleConfig.from_config(json.loads(sys.argv[2])), open(sys.argv[1], "wb"))
"""


@pytest.fixture(scope="module")
def bare_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp_path = tmp_path_factory.mktemp("ray")
    path = tmp_path / "config.pkl"
    proc = subprocess.run(
        [sys.executable, "-c", BARE, str(path), json.dumps(QUANT_CONFIG)],
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    return proc, path


@pytest.fixture(scope="module")
def pickled_config(bare_run: tuple[subprocess.CompletedProcess, Path]) -> Path:
    proc, path = bare_run
    assert proc.returncode == 0 and path.is_file(), proc.stderr[-3000:]
    return path


@pytest.mark.slow
def test_register_twice_in_a_bare_process(bare_run: tuple[subprocess.CompletedProcess, Path]):
    """Nothing else in the process: no config, no engine, no vLLM import beforehand."""
    proc, _ = bare_run
    assert proc.returncode == 0 and "BARE-OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_register_in_a_fresh_worker_process(pickled_config: Path, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, str(pickled_config)],
        env=_clean_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0 and "WORKER-OK 8" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
def test_pickled_config_carries_no_live_layers(pickled_config: Path) -> None:
    """What travels to a worker: the verdict and names, not the driver's layer registry
    (checked in a fresh process by test_register_in_a_fresh_worker_process; here the
    pickle's state is read without vLLM: the registry is not in it)."""

    class _Peek(pickle.Unpickler):
        def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
            if name == "KVScaleConfig":
                return _State
            return super().find_class(module, name)

    class _State:
        def __setstate__(self, state: dict) -> None:
            self.state = state

    with open(pickled_config, "rb") as f:
        peeked = _Peek(f).load()
    assert "_attention_layers" not in peeked.state
    assert peeked.state["kv_verdict"].supported
