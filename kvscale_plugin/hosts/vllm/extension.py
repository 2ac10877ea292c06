"""kvscale's checks callable by name, through vLLM's public worker extension:
``LLM(..., worker_extension_cls="kvscale_plugin.hosts.vllm.extension.KVScaleWorkerExtension")``
(``vllm serve --worker-extension-cls ...``), or this class as a base of a framework's own
worker extension (verl's, NeMo-RL's: vLLM takes one). Then
``llm.collective_rpc("kvscale_fingerprint")`` and ``llm.collective_rpc("kvscale_check")``
run ``live.worker_fingerprint`` / ``live.worker_check`` on every worker: a method name
travels as a string, so no ``VLLM_ALLOW_INSECURE_SERIALIZATION`` is needed, and vLLM's dev
``/collective_rpc`` endpoint reaches them too. Nothing of vLLM is patched for it."""

from __future__ import annotations

from typing import Any

#: The qualified name to pass as ``worker_extension_cls``.
QUALNAME = "kvscale_plugin.hosts.vllm.extension.KVScaleWorkerExtension"


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
