"""Which cache write kvscale's CPU-write wrapper (``kvscale_plugin.hosts.vllm.cpu_write``)
routed each attention layer to.

``model_write_routes`` is an ``llm.apply_model`` target, pickled by reference: a worker
process imports this module, so it must find ``tests/support`` on its ``sys.path``
(inherited from the process that starts the engine).
"""

from __future__ import annotations

import torch

from kvscale_plugin.hosts.vllm.cpu_write import _ROUTE_ATTR


def model_write_routes(model: torch.nn.Module) -> dict[str, dict[str, str | None]]:
    """Per attention layer, the cache write each input dtype was routed to so far
    (``"c:vec"`` / ``"torch:vec"``: kvscale's write, compiled / plain torch; None:
    vLLM's)."""
    return {
        name: {str(dtype): layout for dtype, layout in routes.items()}
        for name, m in model.named_modules()
        if (routes := getattr(getattr(m, "impl", None), _ROUTE_ATTR, None)) is not None
    }
