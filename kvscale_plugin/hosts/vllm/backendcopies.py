"""The copies of a layer's scales that vLLM's GPU attention backends keep for themselves
(docs/gpu-backend-scales.md, read from the sources of vLLM 0.32-0.34).

Most backends read ``layer._k_scale`` / ``_v_scale`` (tensors, updated in place by
kvscale's writer) or the ``_*_scale_float`` floats (rewritten by the writer) on every call.
Four impl classes instead compute values from the floats at their first forward with
attention metadata -- a warm-up or CUDA-graph capture, before any RL sync -- keep them,
and never recompute them (``IMPL_CACHES``). After a reload or a sync those would go on
reading the old scales while the cache write takes the new ones. kvscale's writer
recomputes them, as the backend would from the floats in force (``refresh``), and the
served-copies check compares them too.

What no Python attribute reaches: a **full CUDA graph** replays the floats (and the
decisions made from them) it captured. Where a layer's backend reads floats and the engine
replays full graphs, a scale change is said once, naming the backend and the way out
(``warn_captured_graphs``).

Nothing here imports vLLM or FlashInfer: the impls are told by their class and module
names (FlashInfer's modules do not import without FlashInfer, so they cannot be
imported next to vLLM's CPU build either)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from kvscale_plugin._log import warn_once

_BACKENDS = "vllm.v1.attention.backends"


def _quantized(impl: Any) -> bool:
    """vLLM's ``is_quantized_kv_cache`` (utils/torch_utils.py, 0.32-0.34)."""
    dtype = str(getattr(impl, "kv_cache_dtype", "auto"))
    return dtype.startswith(("fp8", "nvfp4")) or dtype.endswith("per_token_head")


def _bmm_scales(impl: Any, layer: Any, bmm2_float: str) -> dict[str, float]:
    """FlashInfer's kept pair: bmm1 from the q and k floats, bmm2 from ``bmm2_float``
    (quantized caches only; 1.0 otherwise, as the backend starts them)."""
    bmm1 = impl.scale
    bmm2 = 1.0
    if _quantized(impl):
        bmm1 *= layer._q_scale_float * layer._k_scale_float
        bmm2 *= getattr(layer, bmm2_float)
    return {"bmm1_scale": bmm1, "bmm2_scale": bmm2}


def _flashinfer(impl: Any, layer: Any) -> dict[str, float]:
    # flashinfer.py FlashInferImpl.forward (0.32 :2042-2050, 0.33 :2223-2231, 0.34
    # :2254-2262), and its output-quant step (0.32 :2092-2097): once the output scale
    # is known (``layer._o_scale_float``), an FP8 output divides bmm2 by it (``o_sf_scale``
    # stays None); an FP4 output sets ``o_sf_scale`` instead.
    kept = _bmm_scales(impl, layer, "_v_scale_float")
    o_scale = getattr(layer, "_o_scale_float", None)
    if o_scale is not None and getattr(impl, "o_sf_scale", None) is None:
        kept["bmm2_scale"] = kept["bmm2_scale"] / o_scale
    return kept


def _flashinfer_mla(impl: Any, layer: Any) -> dict[str, float]:
    # mla/flashinfer_mla.py forward_mqa (0.32/0.33 :371-379, 0.34 :381-389) and
    # mla/flashinfer_mla_sparse.py _prepare_mqa_kernel: MLA's V is the latent, so bmm2
    # takes the k scale.
    return _bmm_scales(impl, layer, "_k_scale_float")


def _tokenspeed_mla(impl: Any, layer: Any) -> dict[str, float]:
    # mla/tokenspeed_mla.py forward_mqa (:311-319): an FP8 cache is mandatory there.
    return {
        "softmax_scale": impl.scale * layer._q_scale_float * layer._k_scale_float,
        "output_scale": layer._k_scale_float,
    }


@dataclass(frozen=True)
class ImplCache:
    """An impl class that keeps values computed from a layer's scale floats: ``attrs``
    (None until its first forward with metadata, then never recomputed by vLLM) and how
    the backend computes them (``compute(impl, layer)``)."""

    backend: str  # the registry name
    module: str
    impl: str
    attrs: tuple[str, ...]
    compute: Callable[[Any, Any], dict[str, float]]

    @property
    def target(self) -> str:
        return f"{self.module}.{self.impl}"


#: Every impl cache of vLLM 0.32-0.34 (``tests/compat`` checks each release's source still
#: fills these attributes from the scale floats, under ``if self.<attr> is None``).
IMPL_CACHES: tuple[ImplCache, ...] = (
    ImplCache(
        "FLASHINFER",
        f"{_BACKENDS}.flashinfer",
        "FlashInferImpl",
        ("bmm1_scale", "bmm2_scale"),
        _flashinfer,
    ),
    ImplCache(
        "FLASHINFER_MLA",
        f"{_BACKENDS}.mla.flashinfer_mla",
        "FlashInferMLAImpl",
        ("bmm1_scale", "bmm2_scale"),
        _flashinfer_mla,
    ),
    ImplCache(
        "FLASHINFER_MLA_SPARSE",
        f"{_BACKENDS}.mla.flashinfer_mla_sparse",
        "FlashInferMLASparseImpl",
        ("bmm1_scale", "bmm2_scale"),
        _flashinfer_mla,
    ),
    ImplCache(
        "TOKENSPEED_MLA",
        f"{_BACKENDS}.mla.tokenspeed_mla",
        "TokenspeedMLAImpl",
        ("softmax_scale", "output_scale"),
        _tokenspeed_mla,
    ),
)
_BY_CLASS = {(c.module, c.impl): c for c in IMPL_CACHES}

#: Impl classes whose forward reads the scale floats (or values made from them, or a
#: decision made from them) on every call: a full CUDA graph replays what it captured.
#: (module, class) -> the backend's registry name. Tensor readers (FLASH_ATTN before
#: FA4, TRITON_ATTN, FLASHMLA, TRITON_MLA, the ROCm AITER MLA backend) are safe.
FLOAT_READERS: dict[tuple[str, str], str] = {
    **{(c.module, c.impl): c.backend for c in IMPL_CACHES},
    (f"{_BACKENDS}.flashinfer_ts", "FlashInferTSImpl"): "FLASHINFER_TS",
    (f"{_BACKENDS}.mla.flashinfer_mla_sparse_sm90", "FlashInferMLASparseSM90Impl"): (
        "FLASHINFER_MLA_SPARSE_SM90"
    ),
    (f"{_BACKENDS}.mla.cutlass_mla", "CutlassMLAImpl"): "CUTLASS_MLA",
    (f"{_BACKENDS}.rocm_aiter_fa", "AiterFlashAttentionImpl"): "ROCM_AITER_FA",
    (f"{_BACKENDS}.rocm_attn", "RocmAttentionImpl"): "ROCM_ATTN",
}


def _in_table(layer: Any, table: dict[tuple[str, str], Any]) -> Any:
    """``table``'s entry for the class of ``layer``'s impl (its own or a base's), or None."""
    impl = getattr(layer, "impl", None)
    if impl is None:
        return None
    for cls in type(impl).__mro__:
        found = table.get((cls.__module__, cls.__name__))
        if found is not None:
            return found
    return None


def _kept(layer: Any) -> list[tuple[str, float, float]]:
    """``(attr, held, in force)`` for each value ``layer``'s impl keeps (computed already:
    None is left to the backend, which computes it from the floats at its next forward)."""
    entry: ImplCache | None = _in_table(layer, _BY_CLASS)
    if entry is None:
        return []
    impl = layer.impl
    try:
        want = entry.compute(impl, layer)
    except (AttributeError, TypeError):  # floats not set yet: nothing computed from them
        return []
    return [
        (attr, float(held), float(want[attr]))
        for attr in entry.attrs
        if (held := getattr(impl, attr, None)) is not None
    ]


def stale(layer: Any) -> list[tuple[str, float, float]]:
    """``(impl.attr, held, in force)`` for each value ``layer``'s impl keeps that is not
    what the backend would compute from the floats in force."""
    return [(f"impl.{attr}", held, want) for attr, held, want in _kept(layer) if held != want]


def refresh(layer: Any) -> list[tuple[str, float, float]]:
    """Bring the values ``layer``'s impl keeps to the scales in force, computed as the
    backend computes them (never reset to None: the backend's own recomputation of a
    FlashInfer bmm2 would drop the output-quant divisor). Returns what was stale."""
    wrong = []
    for attr, held, want in _kept(layer):
        if held != want:
            setattr(layer.impl, attr, want)
            wrong.append((f"impl.{attr}", held, want))
    return wrong


def float_reader(layer: Any) -> str | None:
    """The registry name of ``layer``'s backend when its forward reads the scale floats
    (what a full CUDA graph bakes in), else None."""
    return _in_table(layer, FLOAT_READERS)


def replays_full_graphs(vllm_config: Any) -> bool:
    """Whether an engine of ``vllm_config`` replays full CUDA graphs (some batches)."""
    if vllm_config is None or getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(vllm_config.compilation_config, "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    return bool(has_full()) if callable(has_full) else False


def warn_captured_graphs(scope: str, layers: Iterable[Any], full_graphs: bool) -> list[str]:
    """After a scale change: where ``layers``' backends read the floats and the engine
    replays full CUDA graphs, say once per backend what the graphs replay and the way out.
    Returns the backends named."""
    if not full_graphs:
        return []
    backends = sorted({name for layer in layers if (name := float_reader(layer))})
    for name in backends:
        warn_once(
            f"{scope}captured-graphs:{name}",
            "kvscale: the KV scales changed, and this engine replays full CUDA graphs "
            "captured with the old ones on the %s attention backend, which reads the scales "
            "as Python floats (baked in at capture): decode batches replayed from those "
            "graphs still use the old scales while the cache write (a tensor) takes the new "
            "ones. kvscale cannot reach a captured graph; the way out: start the engine "
            "with enforce_eager=True or compilation_config={'cudagraph_mode': 'PIECEWISE'} "
            "(attention then runs eagerly and reads the new scales), or a backend that "
            "reads the scale tensors (FLASH_ATTN, TRITON_ATTN; FLASHMLA or TRITON_MLA for "
            "MLA models).",
            name,
        )
    return backends
