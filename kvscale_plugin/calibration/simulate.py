"""An FP8 KV cache simulated in a transformers model's attention (for measuring what
scales cost, e.g. ``benchmarks/rl_drift.py``).

While ``simulate_fp8_cache(model, scales)`` is entered, every attention layer of
``model`` with a scale attends to its keys (after rotary embedding) and values as an FP8
cache returns them: divided by the scale, clamped to +-448, rounded to float8_e4m3fn and
multiplied back (``fp8_roundtrip``: the reference cache write,
``kernels.reference.quantize_e4m3_reference``, then the dequantization attention does).
Queries stay unquantized, as in vLLM's FP8 KV cache. Not to be entered inside a
``KVRecorder`` (nor one inside it): the two wrap the same transformers dispatch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from kvscale_plugin.calibration.observer import module_names
from kvscale_plugin.fp8 import FP8_E4M3_MAX


def fp8_roundtrip(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x`` ``[batch, kv_heads, seq, head_dim]`` through an FP8 e4m3 cache with ``scale``
    (one element, or one per KV head): ``fp8((x / scale).clamp(-448, 448)) * scale``, in
    ``x``'s dtype."""
    s = scale.to(device=x.device, dtype=torch.float32).reshape(1, -1, 1, 1)
    q = (x.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).to(x.dtype)


@contextmanager
def simulate_fp8_cache(model: torch.nn.Module, scales: Mapping[str, Any]) -> Iterator[None]:
    """Attention of ``model`` reads K / V through ``fp8_roundtrip`` with ``scales``
    (``<attention module>.k_scale`` / ``.v_scale`` -> tensor or number, as
    ``record_kv_scales(...).scales()`` returns them); layers without one are left as they
    are. The model's weights are not touched."""
    from transformers.modeling_utils import AttentionInterface

    names = module_names(model)
    by_module: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for mid, name in names.items():
        if f"{name}.k_scale" in scales and f"{name}.v_scale" in scales:
            k, v = (
                torch.as_tensor(scales[f"{name}.{kind}_scale"], dtype=torch.float32)
                for kind in ("k", "v")
            )
            by_module[mid] = (k, v)
    before = AttentionInterface.get_interface

    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
        fn = before(self, attn_implementation, default)

        def attention(
            module: torch.nn.Module, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any
        ) -> Any:
            pair = by_module.get(id(module))
            if pair is not None:
                key, value = fp8_roundtrip(key, pair[0]), fp8_roundtrip(value, pair[1])
            return fn(module, query, key, value, *args, **kwargs)

        return attention

    AttentionInterface.get_interface = get_interface  # type: ignore[method-assign]
    try:
        yield
    finally:
        AttentionInterface.get_interface = before  # type: ignore[method-assign]
