"""SGLang host tests: the real SGLang 0.5.23 modules on a CPU-only machine.

Run them in the SGLang venv (``scripts/setup_sglang_venv.sh``, then
``.venv-sglang/bin/python -m pytest tests/sglang_host``, or ``make test-sglang``); in
the vLLM venv this folder is excluded by tests/conftest.py (visibly, in the report
header). SGLang cannot serve on a CPU (its kernels are CUDA-only), so the tests drive
the modules a server runs: plugin discovery, argument parsing, ``ModelConfig``,
``get_quant_config``, and tiny models built and loaded by SGLang's own
``DefaultModelLoader`` under a single-process gloo group.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator

import pytest


def sglang_installed() -> bool:
    return importlib.util.find_spec("sglang") is not None


def _make_torchvision_importable() -> None:
    """SGLang imports torchvision unconditionally, and PyPI's torchvision is a CUDA
    build whose operator library cannot load next to the CPU torch; its Python part
    then fails on ``operator torchvision::nms does not exist``. Defining the two
    operator schemas it looks up lets it import (nothing here runs its operators)."""
    import torch

    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        return  # not installed: SGLang will say so itself
    except RuntimeError as exc:
        if "torchvision::" not in str(exc):
            raise
        for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
            del sys.modules[name]
        torch.library.define(
            "torchvision::nms", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
        )
        torch.library.define(
            "torchvision::qnms", "(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor"
        )
        import torchvision  # noqa: F401


if sglang_installed():
    # Before anything imports transformers or sglang (both import torchvision).
    _make_torchvision_importable()


@pytest.fixture(scope="session")
def sglang_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """What an SGLang worker process has before it loads a model: a (gloo, world size 1)
    distributed group, published server args, model-parallel groups, and the
    ``sglang.srt.plugins`` entry points loaded by ``load_plugins()``."""
    if not sglang_installed():
        pytest.skip("sglang is not installed (run tests/sglang_host in .venv-sglang)")
    import torch.distributed
    from sglang.srt.distributed import parallel_state
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    for key, value in {
        "MASTER_ADDR": "127.0.0.1",
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }.items():
        os.environ.setdefault(key, value)
    if not torch.distributed.is_initialized():
        # A file store, not env:// (a TCP port found free here, then bound by torch's
        # TCPStore: another process can take it in between). One rank needs no port.
        store = tmp_path_factory.mktemp("torch-dist") / "store"
        parallel_state.init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{store}",
            local_rank=0,
            backend="gloo",
        )
    reset_context()
    publish(
        ServerArgs(model_path="dummy", device="cpu", tp_size=1, pp_size=1, ep_size=1),
        role="test",
        ranks=SpawnRanks(world_rank=0),
    )
    get_parallel().override_permanently(world_group=parallel_state._WORLD)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(backend="gloo")

    # Without this SGLang's rotary embedding looks for vLLM's CUDA ops
    # (docs/running-engines-on-cpu.md).
    import sglang.srt.layers.rotary_embedding.base as rotary_base

    rotary_base._is_cpu = True

    from sglang.srt.plugins import load_plugins

    load_plugins()
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
