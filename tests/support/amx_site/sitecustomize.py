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


# Third duty: ``KVSCALE_TEST_CPU_WITHOUT_FP8=1`` makes this process -- and every process it
# starts, which inherits the variable -- see a CPU without AVX-512 and AMX, as most laptops
# and many cloud VMs are: torch's two capability checks (``torch.cpu._is_avx512_supported``,
# ``_is_amx_tile_supported``), which vLLM's CPU attention asks before it refuses an FP8 KV
# cache ("FP8 KV cache on CPU requires x86 with AVX-512 or AMX") and the tests ask to declare
# their skips, answer False once torch is imported. `make test-without-fp8-cpu` runs engine
# tests so, to prove they skip or pass there, never fail.
if os.environ.get("KVSCALE_TEST_CPU_WITHOUT_FP8") == "1":
    import importlib.machinery  # noqa: E402

    def _answer_no(*_args, **_kwargs):  # noqa: ANN002, ANN003, ANN202
        return False

    _WITHOUT_FP8_CHECKS = (
        "_is_avx512_supported",
        "_is_amx_tile_supported",
        "_is_avx512_bf16_supported",
        "_is_vnni_supported",
        "_is_amx_fp16_supported",
    )

    class _TorchWithoutFp8Cpu:
        """A meta-path entry that lets ``import torch`` run, then patches the two checks."""

        def find_spec(self, name, path=None, target=None):  # noqa: ANN001, ANN201
            # Stays on the meta path until torch is imported: a bare
            # ``importlib.util.find_spec("torch")`` (vLLM asks one first) imports nothing.
            if name != "torch":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            exec_module = spec.loader.exec_module
            finder = self

            def exec_and_patch(module):  # noqa: ANN001, ANN202
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                exec_module(module)
                import torch.cpu as torch_cpu

                # The two vLLM asks, and the rest of that family (AVX-512 BF16 / VNNI, AMX
                # FP16), so that nothing asks torch about a CPU that is half AVX-512.
                for check in _WITHOUT_FP8_CHECKS:
                    if hasattr(torch_cpu, check):
                        setattr(torch_cpu, check, _answer_no)

            spec.loader.exec_module = exec_and_patch
            return spec

    sys.meta_path.insert(0, _TorchWithoutFp8Cpu())


# Fourth duty: ``KVSCALE_TEST_FP8_GUARD=1`` (set by tests/conftest.py for the test session,
# inherited by every process it starts): a test that reaches vLLM's FP8 CPU path without
# declaring it fails, on every machine (kvscale_fp8_guard, beside this file).
if os.environ.get("KVSCALE_TEST_FP8_GUARD") == "1":
    try:
        import kvscale_fp8_guard  # noqa: E402

        kvscale_fp8_guard.install()
    except ImportError:  # this folder is not on the path as a folder: nothing to guard
        pass
