"""Stand-in for SGLang's ``sgl_kernel`` (its CPU kernels), for tests/sglang_engine only.

The real package is a CUDA / AMX build that PyPI has no plain-CPU wheel of. SGLang 0.5.23
on a CPU without AMX imports a few names from it at module import time -- the KV-cache
move and request-to-token writes (``sglang/kernels/ops/kvcache/cache_move.py``,
``sglang/srt/mem_cache/allocation.py``) and the speculative-decoding tree kernels
(``sglang/kernels/ops/speculative/``) -- and calls them only for speculative decoding,
which these tests never run. Every name resolves to a function that raises, so a code
path that does reach one fails loudly, naming it, instead of computing anything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(
            f"sgl_kernel.{name}: this is the test suite's stand-in for SGLang's CPU "
            "kernels (tests/sglang_engine/site/sgl_kernel); SGLang calls it only for "
            "speculative decoding, which the CPU Engine tests do not run"
        )

    missing.__name__ = missing.__qualname__ = name
    return missing
