"""Test processes only (on ``PYTHONPATH`` under ``make test``): ask Linux for the AMX tile
state before anything runs.

vLLM 0.32's CPU build uses AMX tiles in its attention and linear kernels whenever the CPU
has them (``torch.cpu._is_amx_tile_supported()``) but never asks the kernel for them
(``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, which ``torch.cpu._init_amx()``
would do): a fresh process whose first AMX instruction is vLLM's -- every spawned engine
core and worker -- dies with SIGILL. A process that ran a bf16 matmul through oneDNN first
survives, which is why only some tests met it. This asks once per process, cheaply (one
system call, no import of torch); on other CPUs and platforms it does nothing.
"""

import ctypes
import platform
import sys

if sys.platform == "linux" and platform.machine() == "x86_64":
    try:
        _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA, _SYS_arch_prctl = 0x1023, 18, 158
        ctypes.CDLL(None, use_errno=True).syscall(
            _SYS_arch_prctl, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA
        )
    except Exception:  # noqa: BLE001 - no AMX, an old kernel: nothing to ask for
        pass


# Second duty, also test processes only: where the test session asks for it
# (``KVSCALE_TEST_PROCESS_LOG``, set by tests/conftest.py), a process appends one line the
# moment it first imports vLLM -- the count of fresh vLLM processes (probes, engine cores,
# workers, servers, CLI calls) that the session summary prints. Written at import, not at
# exit: vLLM ends its workers with signals, which skip ``atexit``.
import os  # noqa: E402

_PROCESS_LOG = os.environ.get("KVSCALE_TEST_PROCESS_LOG")
if _PROCESS_LOG:

    class _FirstVllmImport:
        """A meta-path entry that notes the first ``import vllm`` and finds nothing."""

        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
            if name == "vllm":
                sys.meta_path.remove(self)
                try:
                    with open(_PROCESS_LOG, "a", encoding="utf-8") as log:
                        log.write(f"{os.getpid()} {' '.join(sys.argv)[:160]}\n")
                except OSError:
                    pass
            return None

    sys.meta_path.insert(0, _FirstVllmImport())
