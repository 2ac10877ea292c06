"""kvscale's checks callable by name, through vLLM's public worker extension:
``LLM(..., worker_extension_cls="kvscale_plugin.hosts.vllm.extension.KVScaleWorkerExtension")``
(``vllm serve --worker-extension-cls ...``), or this class as a base of a framework's own
worker extension (verl's, NeMo-RL's: vLLM takes one). Then
``llm.collective_rpc("kvscale_fingerprint")`` and ``llm.collective_rpc("kvscale_check")``
run ``live.worker_fingerprint`` / ``live.worker_check`` on every worker: a method name
travels as a string, so no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is needed, and vLLM's dev
``/collective_rpc`` endpoint reaches them too. Nothing of vLLM's workers is patched for it.

**Every data-parallel replica answers.** vLLM sends a ``collective_rpc`` to every engine of
an internally load-balanced data-parallel deployment (``vllm serve --data-parallel-size
N``, ``AsyncLLM``) and hands back the first engine's answers only
(``DPLBAsyncMPClient.call_utility_async``), so an update reaches every replica while its
check would be heard from replica 0 alone. In a front end that serves kvscale, the
``dp-answers`` feature (``install_all_answers``) makes a call of kvscale's by-name methods
return every engine's workers' answers, in engine order; every other call is vLLM's as
before. Each answer names its replica (``dp_rank``; ``dp_size``: the replicas that answered
the call, or the engine's data-parallel size, the larger). Externally balanced replicas are
separate servers, each answering for itself: ask each.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from kvscale_plugin.hosts.vllm.layers import serves_kvscale

#: The qualified name to pass as ``worker_extension_cls``.
QUALNAME = "kvscale_plugin.hosts.vllm.extension.KVScaleWorkerExtension"

#: kvscale's by-name worker methods: the calls every data-parallel engine answers.
BY_NAME = frozenset({"kvscale_fingerprint", "kvscale_check"})
_WRAPPED = "__kvscale_all_answers__"


class KVScaleWorkerExtension:
    """Mixed into vLLM's worker class by vLLM (``worker_extension_cls``)."""

    def kvscale_fingerprint(self) -> dict[str, Any]:
        """``live.worker_fingerprint`` of this worker."""
        from kvscale_plugin.hosts.vllm.live import worker_fingerprint

        return worker_fingerprint(self)

    def kvscale_check(self) -> list[str]:
        """``live.worker_check`` of this worker (e.g. right after ``wake_up``)."""
        from kvscale_plugin.hosts.vllm.live import worker_check

        return worker_check(self)


def _all_answers(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    async def collective_rpc_async(
        self: Any,
        method: Any,
        timeout: float | None = None,
        args: tuple = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if not (isinstance(method, str) and method in BY_NAME and serves_kvscale(self)):
            return await original(self, method, timeout, args, kwargs)
        import asyncio

        per_engine = await asyncio.gather(
            *(
                self._call_utility_async(
                    "collective_rpc", method, timeout, args, kwargs, engine=engine
                )
                for engine in self.core_engines
            )
        )
        # A dense model's replicas run as independent engines whose workers see a
        # data-parallel size of 1: the answers say how many replicas answered here.
        replicas = len(per_engine)
        return [
            {**answer, "dp_size": max(int(answer.get("dp_size", 1)), replicas)}
            if isinstance(answer, dict)
            else answer
            for answers in per_engine
            for answer in answers
        ]

    setattr(collective_rpc_async, _WRAPPED, True)
    return collective_rpc_async


def install_all_answers() -> bool:
    """The ``dp-answers`` feature, in a front end that serves kvscale: a by-name call of
    kvscale's methods (``BY_NAME``) through an internally load-balanced data-parallel
    client returns every engine's answers (vLLM returns engine 0's). Idempotent. Returns
    False (not installed, nothing lost) in an engine-core or worker process: only a front
    end holds the client."""
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from kvscale_plugin.hosts.vllm.internals import replace
    from kvscale_plugin.hosts.vllm.process import HOST

    if not HOST.front_end:
        return False

    original = DPLBAsyncMPClient.collective_rpc_async  # AsyncMPClient's, inherited
    if not getattr(original, _WRAPPED, False):
        replace(DPLBAsyncMPClient, "collective_rpc_async", _all_answers(original))
    return True
