"""Kernel tests run on a GPU when there is one, else in Triton's interpreter.

``TRITON_INTERPRET`` is read when ``@triton.jit`` decorates the kernel, i.e.
when ``kvscale_plugin.kernels.triton_fp8_write`` is first imported, so it is set
here, before any test module imports it. The kernel module is imported right
away to lock that decision in; the variable is then put back as it was and set
again only while a test of this directory runs, so that engine tests elsewhere
in the session (and the subprocesses they start) never inherit it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
KERNEL_MODULE = "kvscale_plugin.kernels.triton_fp8_write"

if not HAS_CUDA:
    if KERNEL_MODULE in sys.modules and not sys.modules[KERNEL_MODULE].INTERPRETER:
        raise RuntimeError(
            f"{KERNEL_MODULE} was imported before tests/kernels/conftest.py could set "
            "TRITON_INTERPRET=1; run the kernel tests in their own pytest process."
        )
    _previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        assert importlib.import_module(KERNEL_MODULE).INTERPRETER
    finally:
        if _previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = _previous


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Triton also consults the variable while an interpreted kernel runs.
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


def pytest_configure(config: pytest.Config) -> None:
    # The interpreter evaluates kernels with numpy, which warns when it divides
    # the NaN and inf inputs that the tests feed on purpose.
    config.addinivalue_line(
        "filterwarnings", r"ignore:(invalid value|overflow) encountered:RuntimeWarning"
    )
