"""What vLLM's GPU attention backends keep of a layer's scales (``hosts/vllm/backendcopies``)
and the data-parallel client's by-name answers (``hosts/vllm/extension``).

FlashInfer's modules do not import without FlashInfer (not installable next to vLLM's CPU
build), so the impl classes here are stand-ins named as vLLM names them (the real classes
where they import: a GPU machine with FlashInfer); what they keep is
computed by **vLLM's own code**: the ``if self.<attr> is None:`` blocks of the installed
vLLM's source, run on the stand-in (so a release that changes the formula fails here)."""

from __future__ import annotations

import ast
import asyncio
import importlib
import importlib.util
import types
from pathlib import Path

import pytest
import torch
from kvscale_testing.backend_source import fill_blocks, find_class

from kvscale_plugin.hosts.vllm import backendcopies
from kvscale_plugin.hosts.vllm.backendcopies import IMPL_CACHES, ImplCache

VLLM = Path(importlib.util.find_spec("vllm").origin).parent


def _source(entry: ImplCache) -> Path:
    return VLLM.joinpath(*entry.module.split(".")[1:]).with_suffix(".py")


def _fill_blocks(entry: ImplCache) -> list[ast.If]:
    """The impl's ``if self.<attr> is None:`` blocks (where the backend computes a kept
    value from the layer's floats), from the installed vLLM's source."""
    cls = find_class(ast.parse(_source(entry).read_text()), entry.impl)
    assert cls is not None, entry.impl
    return fill_blocks(cls, entry.attrs)


def _backend_fills(entry: ImplCache, impl: object, layer: object) -> None:
    """Run vLLM's own blocks on ``impl`` (as its first forward with metadata would)."""
    from vllm.utils.torch_utils import is_quantized_kv_cache

    for block in _fill_blocks(entry):
        code = compile(ast.Module([block], []), str(_source(entry)), "exec")
        exec(code, {"is_quantized_kv_cache": is_quantized_kv_cache}, {"self": impl, "layer": layer})


def _impl_class(entry: ImplCache) -> type:
    """The real impl class where its module imports (FlashInfer installed: a GPU machine),
    else a stand-in of the same module and name."""
    try:
        return getattr(importlib.import_module(entry.module), entry.impl)
    except ImportError:
        return type(entry.impl, (), {"__module__": entry.module})


def _stand_in(entry: ImplCache, dtype: str = "fp8") -> object:
    impl = object.__new__(_impl_class(entry))  # the attributes the kept values need only
    impl.scale = 0.125
    impl.kv_cache_dtype = dtype
    impl.o_sf_scale = None
    for attr in entry.attrs:
        setattr(impl, attr, None)
    return impl


def _layer(impl: object, q: float, k: float, v: float) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        impl=impl,
        layer_name="model.layers.0.self_attn.attn",
        _q_scale_float=q,
        _k_scale_float=k,
        _v_scale_float=v,
        _o_scale_float=None,
    )


@pytest.mark.parametrize("entry", IMPL_CACHES, ids=[e.backend for e in IMPL_CACHES])
def test_the_installed_vllm_fills_what_the_table_names(entry):
    blocks = _fill_blocks(entry)
    filled = {b.test.left.attr for b in blocks}
    # TOKENSPEED_MLA computes output_scale inside the softmax_scale block.
    assert filled == set(entry.attrs) or filled == {entry.attrs[0]}, (entry.impl, filled)


# TOKENSPEED_MLA runs an FP8 cache only: no bf16 case.
CASES = [(e, d) for e in IMPL_CACHES for d in ("fp8", "bfloat16")]
CASES = [(e, d) for e, d in CASES if not (e.backend == "TOKENSPEED_MLA" and d != "fp8")]


@pytest.mark.parametrize(("entry", "dtype"), CASES, ids=[f"{e.backend}-{d}" for e, d in CASES])
def test_refresh_gives_what_the_backend_computes_from_the_new_floats(entry, dtype):
    impl = _stand_in(entry, dtype)
    layer = _layer(impl, 1.0, 3.5, 2.25)
    _backend_fills(entry, impl, layer)  # the first forward: under the start-up scales
    assert backendcopies.stale(layer) == []
    held = {a: getattr(impl, a) for a in entry.attrs}

    layer._k_scale_float, layer._v_scale_float = 6.0, 7.0  # kvscale's writer, floats
    wrong = backendcopies.stale(layer)
    if dtype == "fp8":
        assert {name for name, _, _ in wrong} == {f"impl.{a}" for a in entry.attrs}
    else:  # a bf16 cache applies no scale: nothing kept moves
        assert wrong == []
    assert backendcopies.refresh(layer) == wrong

    # What vLLM computes afresh from the new floats (its blocks, on a fresh impl).
    fresh = _stand_in(entry, dtype)
    _backend_fills(entry, fresh, layer)
    for attr in entry.attrs:
        assert getattr(impl, attr) == getattr(fresh, attr), attr
    assert (held != {a: getattr(impl, a) for a in entry.attrs}) == (dtype == "fp8")
    assert backendcopies.stale(layer) == []


def test_flashinfer_keeps_the_output_quant_divisor():
    """FlashInfer divides bmm2 by the output scale once it is known (attention+quant
    fusion, FP8 output): a refresh keeps the divisor (vLLM's own recomputation after a
    reset to None would drop it, as its division runs only while ``_o_scale_float`` is
    None)."""
    entry = IMPL_CACHES[0]
    impl = _stand_in(entry)
    layer = _layer(impl, 1.0, 3.5, 2.25)
    _backend_fills(entry, impl, layer)
    layer._o_scale_float = 0.5
    impl.bmm2_scale = impl.bmm2_scale / layer._o_scale_float  # vLLM's FP8-output step
    assert backendcopies.stale(layer) == []
    layer._v_scale_float = 7.0
    backendcopies.refresh(layer)
    assert impl.bmm2_scale == 7.0 / 0.5


def test_values_not_computed_yet_are_left_to_the_backend():
    impl = _stand_in(IMPL_CACHES[0])
    layer = _layer(impl, 1.0, 3.5, 2.25)
    assert backendcopies.refresh(layer) == []
    assert impl.bmm1_scale is None and impl.bmm2_scale is None


def test_other_impls_keep_nothing_and_tensor_readers_are_not_float_readers():
    tensor_reader = type("TritonAttentionImpl", (), {"__module__": "x.triton_attn"})()
    layer = _layer(tensor_reader, 1.0, 3.5, 2.25)
    assert backendcopies.refresh(layer) == []
    assert backendcopies.float_reader(layer) is None
    flashinfer = _layer(_stand_in(IMPL_CACHES[0]), 1.0, 3.5, 2.25)
    assert backendcopies.float_reader(flashinfer) == "FLASHINFER"


def test_writer_refreshes_what_the_impl_keeps():
    """kvscale's writer (``served.write_kv_scales``) brings the impl's values along."""
    from kvscale_plugin.hosts.vllm.served import write_kv_scales
    from kvscale_plugin.scales import ResolvedScales, ScaleSource

    entry = IMPL_CACHES[0]
    layer = torch.nn.Module()
    layer.register_buffer("_k_scale", torch.tensor(3.5))
    layer.register_buffer("_v_scale", torch.tensor(2.25))
    layer._q_scale_float, layer._k_scale_float, layer._v_scale_float = 1.0, 3.5, 2.25
    layer._o_scale_float = None
    layer.impl = _stand_in(entry)
    _backend_fills(entry, layer.impl, layer)
    write_kv_scales(layer, ResolvedScales(6.0, 7.0, ScaleSource.CHECKPOINT))
    assert layer.impl.bmm1_scale == 0.125 * (1.0 * 6.0)
    assert layer.impl.bmm2_scale == 7.0


def test_a_scale_change_under_full_graphs_is_said_once_per_backend(kvscale_warnings):
    flashinfer = _layer(_stand_in(IMPL_CACHES[0]), 1.0, 3.5, 2.25)
    triton = _layer(type("TritonAttentionImpl", (), {"__module__": "x"})(), 1.0, 3.5, 2.25)
    assert backendcopies.warn_captured_graphs("e:", [flashinfer, triton], False) == []
    assert kvscale_warnings("CUDA graphs") == []
    for _ in range(2):
        assert backendcopies.warn_captured_graphs("e:", [flashinfer, triton], True) == [
            "FLASHINFER"
        ]
    (said,) = kvscale_warnings("CUDA graphs")
    assert "FLASHINFER" in said and "enforce_eager=True" in said and "PIECEWISE" in said


def test_full_graphs_read_from_a_real_vllm_config():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import CUDAGraphMode

    def config(mode: CUDAGraphMode, eager: bool = False) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            model_config=types.SimpleNamespace(enforce_eager=eager),
            compilation_config=CompilationConfig(cudagraph_mode=mode),
        )

    assert backendcopies.replays_full_graphs(config(CUDAGraphMode.FULL_AND_PIECEWISE))
    assert backendcopies.replays_full_graphs(config(CUDAGraphMode.FULL_DECODE_ONLY))
    assert not backendcopies.replays_full_graphs(config(CUDAGraphMode.PIECEWISE))
    assert not backendcopies.replays_full_graphs(config(CUDAGraphMode.FULL, eager=True))
    assert not backendcopies.replays_full_graphs(None)


# -- every data-parallel engine answers kvscale's by-name calls --------------------------


class _Client:
    """vLLM's data-parallel client, as the wrapper uses it: its engines, one utility call
    per engine, and the config that says whether it serves kvscale."""

    def __init__(self, quantization: str, engines: int = 2) -> None:
        self.vllm_config = types.SimpleNamespace(
            model_config=types.SimpleNamespace(quantization=quantization)
        )
        self.core_engines = [f"engine-{i}".encode() for i in range(engines)]
        self.calls: list[tuple] = []

    async def _call_utility_async(self, method, *args, engine):
        self.calls.append((method, args[0], engine))
        rank = self.core_engines.index(engine)
        return [{"dp_rank": rank, "dp_size": 1, "tp_rank": tp} for tp in (0, 1)]


async def _vllm_collective_rpc(self, method, timeout=None, args=(), kwargs=None):
    """vLLM's own: the first engine's answers (DPLBAsyncMPClient.call_utility_async)."""
    answers = [
        await self._call_utility_async("collective_rpc", method, timeout, args, kwargs, engine=e)
        for e in self.core_engines
    ]
    return answers[0]


def test_every_engine_answers_kvscale_by_name_and_nothing_else_changes():
    from kvscale_plugin.hosts.vllm.extension import _all_answers

    wrapped = _all_answers(_vllm_collective_rpc)
    client = _Client("kvscale")
    answers = asyncio.run(wrapped(client, "kvscale_fingerprint"))
    assert [(a["dp_rank"], a["tp_rank"], a["dp_size"]) for a in answers] == [
        (0, 0, 2),
        (0, 1, 2),
        (1, 0, 2),
        (1, 1, 2),
    ]
    # Any other call, or a stock engine's: vLLM's answer (engine 0's), unchanged.
    assert [a["dp_rank"] for a in asyncio.run(wrapped(client, "other"))] == [0, 0]
    stock = _Client("fp8")
    assert [a["dp_rank"] for a in asyncio.run(wrapped(stock, "kvscale_fingerprint"))] == [0, 0]


def test_only_a_front_end_installs_the_client_wrapper(monkeypatch):
    from vllm.v1.engine.core_client import DPLBAsyncMPClient

    from kvscale_plugin.hosts.vllm import extension, internals
    from kvscale_plugin.hosts.vllm.process import HOST

    before = DPLBAsyncMPClient.__dict__.get("collective_rpc_async")
    monkeypatch.setattr(HOST, "front_end", False)
    assert extension.install_all_answers() is False
    assert DPLBAsyncMPClient.__dict__.get("collective_rpc_async") is before
    monkeypatch.setattr(HOST, "front_end", True)
    with pytest.raises(RuntimeError, match="undo"):  # rolled back at the end
        with internals.transaction():
            assert extension.install_all_answers() is True
            wrapped = DPLBAsyncMPClient.__dict__["collective_rpc_async"]
            assert getattr(wrapped, "__kvscale_all_answers__", False)
            raise RuntimeError("undo")
    assert DPLBAsyncMPClient.__dict__.get("collective_rpc_async") is before
