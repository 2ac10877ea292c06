"""The vLLM attention backend: registration, selection, and which cache write
each layer gets.

Runs against the installed vLLM (the CPU build here). vLLM's Triton backend
classes import and instantiate on the CPU; its Triton cache-write kernel does
not run here (the CPU build disables Triton), so the parent's kernel is
replaced by a recorder, while our path runs the real kernel (interpreted
without a GPU) and is checked byte for byte against the reference.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fp8_helpers import DEVICE, assert_same_fp8, split_kv_cache, vllm_kv_cache
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends import triton_attn  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402

from kvscale_plugin.hosts.vllm import backend as vllm_backend  # noqa: E402
from kvscale_plugin.kernels import fp8_cache_write_reference  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 3


class KVScaleMethod:
    """Stands in for the plugin's KV method: only the class attribute matters."""

    is_kvscale = True


class OtherMethod:
    pass


class TruthyButNotOurs:
    is_kvscale = 1  # truthy, not True: must not route to our kernel


@pytest.fixture
def custom_backend_slot() -> Iterator[None]:
    """Leave AttentionBackendEnum.CUSTOM as the test found it."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES

    saved = _ATTN_OVERRIDES.get(AttentionBackendEnum.CUSTOM)
    AttentionBackendEnum.CUSTOM.clear_override()
    yield
    AttentionBackendEnum.CUSTOM.clear_override()
    if saved is not None:
        _ATTN_OVERRIDES[AttentionBackendEnum.CUSTOM] = saved


@pytest.fixture
def parent_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple]]:
    """Record the parent's cache-write kernels instead of running them."""
    calls: list[tuple[str, tuple]] = []
    for name in (
        "triton_reshape_and_cache_flash",
        "triton_reshape_and_cache_flash_per_token_head_quant",
    ):
        monkeypatch.setattr(triton_attn, name, lambda *a, _n=name, **k: calls.append((_n, a)))
    return calls


@pytest.fixture
def our_writes(monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    """Count our kernel's launches while still running it."""
    vllm_backend.KVScaleTritonAttentionImpl  # noqa: B018 - builds the classes, binds the kernel
    from kvscale_plugin.hosts.vllm.process import HOST

    kernel = HOST.fp8_cache_write
    calls: list[tuple] = []

    def recording(*args: Any, **kwargs: Any) -> None:
        calls.append(args)
        kernel(*args, **kwargs)

    monkeypatch.setattr(HOST, "fp8_cache_write", recording)
    return calls


def make_impl(kv_cache_dtype: str = "fp8", attn_type: str = AttentionType.DECODER) -> Any:
    impl_cls = vllm_backend.KVScaleTritonAttentionBackend.get_impl_cls()
    return impl_cls(
        NUM_HEADS,
        HEAD_SIZE,
        HEAD_SIZE**-0.5,
        NUM_KV_HEADS,
        None,
        None,
        kv_cache_dtype,
        attn_type=attn_type,
    )


def make_layer(method: object | None, k_scale: float = 0.37, v_scale: float = 2.9) -> Any:
    layer = SimpleNamespace(
        # vLLM keeps the scales as 0-dim float32 device tensors.
        _k_scale=torch.tensor(k_scale, device=DEVICE),
        _v_scale=torch.tensor(v_scale, device=DEVICE),
    )
    if method is not None:
        layer.quant_method = method
    return layer


def make_inputs(
    num_tokens: int = 6, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """key/value as column slices of a fused qkv output (what vLLM passes)."""
    g = torch.Generator().manual_seed(0)
    widths = [NUM_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE, NUM_KV_HEADS * HEAD_SIZE]
    qkv = (torch.randn(num_tokens, sum(widths), generator=g) * 300).to(dtype).to(DEVICE)
    _, k, v = qkv.split(widths, dim=-1)
    slots = torch.tensor([3, -1, 17, 40, 4, -1][:num_tokens], device=DEVICE)
    return k.view(-1, NUM_KV_HEADS, HEAD_SIZE), v.view(-1, NUM_KV_HEADS, HEAD_SIZE), slots


def expected_cache(kv_cache: torch.Tensor, key, value, slots, layer) -> torch.Tensor:
    expected = kv_cache.clone()
    key_cache, value_cache = split_kv_cache(expected, HEAD_SIZE)
    fp8_cache_write_reference(
        key, value, key_cache, value_cache, slots, layer._k_scale, layer._v_scale
    )
    return expected


# Registration and selection ---------------------------------------------------


def test_register_is_idempotent_and_resolves_to_our_backend(custom_backend_slot: None) -> None:
    assert vllm_backend.register_backend() is True
    assert vllm_backend.register_backend() is True
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert cls is vllm_backend.KVScaleTritonAttentionBackend
    assert issubclass(cls, triton_attn.TritonAttentionBackend)
    assert issubclass(cls.get_impl_cls(), triton_attn.TritonAttentionImpl)
    # Attention.__init__ maps the name back to the enum.
    assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
    # Class path and pickling address the classes as module attributes.
    assert pickle.loads(pickle.dumps(cls)) is cls
    assert pickle.loads(pickle.dumps(cls.get_impl_cls())) is cls.get_impl_cls()


def test_cli_value_and_cuda_selector_accept_custom(custom_backend_slot: None) -> None:
    from vllm.config import AttentionConfig
    from vllm.platforms.interface import DeviceCapability
    from vllm.v1.attention.selector import AttentionSelectorConfig

    vllm_backend.register_backend()
    assert AttentionConfig(backend="CUSTOM").backend is AttentionBackendEnum.CUSTOM
    # What CudaPlatform.get_attn_backend_cls asks a selected backend (that
    # module needs vLLM's CUDA extension, absent here, so ask the class itself).
    config = AttentionSelectorConfig(
        head_size=128, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=16
    )
    reasons = AttentionBackendEnum.CUSTOM.get_class().validate_configuration(
        device_capability=DeviceCapability(9, 0), **config._asdict()
    )
    assert reasons == []


def test_cpu_platform_ignores_the_selection(custom_backend_slot: None) -> None:
    from vllm.platforms import current_platform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    if not current_platform.is_cpu():
        pytest.skip("checks the CPU platform")
    vllm_backend.register_backend()
    config = AttentionSelectorConfig(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="fp8", block_size=32
    )
    path = current_platform.get_attn_backend_cls(AttentionBackendEnum.CUSTOM, config)
    assert path == AttentionBackendEnum.CPU_ATTN.get_path()


def test_register_leaves_another_custom_backend_alone(custom_backend_slot: None) -> None:
    from vllm.v1.attention.backends.registry import register_backend

    register_backend(AttentionBackendEnum.CUSTOM, "someone.else.Backend")
    assert vllm_backend.register_backend() is False
    assert AttentionBackendEnum.CUSTOM.get_path() == "someone.else.Backend"


# Which cache write a layer gets -------------------------------------------------


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_kvscale_layer_with_fp8_cache_uses_our_kernel(
    physical: str, parent_writes: list, our_writes: list
) -> None:
    impl = make_impl("fp8")
    layer = make_layer(KVScaleMethod())
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, physical=physical)
    expected = expected_cache(kv_cache, key, value, slots, layer)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    assert len(our_writes) == 1 and parent_writes == []
    assert_same_fp8(kv_cache, expected)


def test_in_place_scale_reload_reaches_the_next_write(our_writes: list) -> None:
    """A reload copies new scales into the same tensors: the next write uses them."""
    impl = make_impl("fp8_e4m3")
    layer = make_layer(KVScaleMethod(), k_scale=1.0, v_scale=1.0)
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    k_scale_storage = layer._k_scale
    layer._k_scale.fill_(0.37)
    layer._v_scale.fill_(2.9)
    expected = expected_cache(kv_cache, key, value, slots, layer)
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    assert layer._k_scale is k_scale_storage
    assert_same_fp8(kv_cache, expected)
    assert len(our_writes) == 2


@pytest.mark.parametrize(
    ("method", "kv_cache_dtype"),
    [
        (None, "fp8"),  # no quantization method on the layer
        (OtherMethod(), "fp8"),  # someone else's KV method
        (TruthyButNotOurs(), "fp8"),
        (KVScaleMethod(), "auto"),  # unquantized cache
        (KVScaleMethod(), "bfloat16"),
        (KVScaleMethod(), "fp8_e5m2"),  # a format our kernel does not write
    ],
    ids=["no-method", "other-method", "truthy-flag", "auto", "bfloat16", "e5m2"],
)
def test_everything_else_goes_to_the_parent(
    method: object, kv_cache_dtype: str, parent_writes: list, our_writes: list
) -> None:
    impl = make_impl(kv_cache_dtype)
    layer = make_layer(method)
    key, value, slots = make_inputs()
    dtype = torch.bfloat16 if kv_cache_dtype in ("auto", "bfloat16") else torch.uint8
    kv_cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, dtype=dtype)
    impl.do_kv_cache_update(layer, key, value, kv_cache.to(DEVICE), slots)
    assert our_writes == []
    assert [name for name, _ in parent_writes] == ["triton_reshape_and_cache_flash"]
    args = parent_writes[0][1]
    assert args[0] is key and args[1] is value and args[4] is slots
    assert args[5] == kv_cache_dtype
    assert args[6] is layer._k_scale and args[7] is layer._v_scale


def test_fp8_key_input_goes_to_the_parent(parent_writes: list, our_writes: list) -> None:
    """Already-quantized K/V (the parent stores them as they are) are not ours."""
    impl = make_impl("fp8")
    key, value, slots = make_inputs()
    key8, value8 = key.to(torch.float8_e4m3fn), value.to(torch.float8_e4m3fn)
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    impl.do_kv_cache_update(make_layer(KVScaleMethod()), key8, value8, kv_cache, slots)
    assert our_writes == [] and len(parent_writes) == 1


def test_per_token_head_cache_goes_to_the_parent(parent_writes: list, our_writes: list) -> None:
    impl = make_impl("fp8_per_token_head")
    key, value, slots = make_inputs()
    pad = 4  # one float32 scale per (token, head) after each half
    kv_cache = torch.zeros(
        NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * (HEAD_SIZE + pad), dtype=torch.uint8
    ).to(DEVICE)
    impl.do_kv_cache_update(make_layer(KVScaleMethod()), key, value, kv_cache, slots)
    assert our_writes == []
    assert [n for n, _ in parent_writes] == ["triton_reshape_and_cache_flash_per_token_head_quant"]


def test_fnuz_platform_goes_to_the_parent(
    monkeypatch: pytest.MonkeyPatch, parent_writes: list, our_writes: list
) -> None:
    """ROCm MI300's fp8 is e4m3fnuz: a different format from the one we write."""
    from vllm.platforms import current_platform

    monkeypatch.setattr(
        type(current_platform), "fp8_dtype", classmethod(lambda cls: torch.float8_e4m3fnuz)
    )
    impl = make_impl("fp8")
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    impl.do_kv_cache_update(make_layer(KVScaleMethod()), key, value, kv_cache, slots)
    assert our_writes == [] and len(parent_writes) == 1


def test_encoder_layers_write_nothing(parent_writes: list, our_writes: list) -> None:
    impl = make_impl("fp8", attn_type=AttentionType.ENCODER_ONLY)
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    before = kv_cache.clone()
    impl.do_kv_cache_update(make_layer(KVScaleMethod()), key, value, kv_cache, slots)
    assert our_writes == [] and parent_writes == []
    assert torch.equal(kv_cache, before)


# Per-head (attn_head) layers ------------------------------------------------------


def make_per_head_layer(method: object | None) -> Any:
    """A layer as kvscale's KV method leaves a per-head one: one k/v value per KV head
    in _k_scale / _v_scale (stock vLLM's layout), and the per-layer max beside them."""
    layer = make_layer(method)
    layer._k_scale = torch.tensor([0.37, 4.1], device=DEVICE)
    layer._v_scale = torch.tensor([2.9, 0.6], device=DEVICE)
    layer._kvscale_k_max = torch.tensor(4.1, device=DEVICE)
    layer._kvscale_v_max = torch.tensor(2.9, device=DEVICE)
    return layer


def test_backend_accepts_per_head_checkpoints() -> None:
    # vLLM's selector refuses backends without this for attn_head checkpoints.
    assert vllm_backend.KVScaleTritonAttentionBackend.supports_per_head_quant_scales()
    assert not triton_attn.TritonAttentionBackend.supports_per_head_quant_scales()


def test_per_head_kvscale_layer_is_written_with_the_layer_max(
    parent_writes: list, our_writes: list
) -> None:
    impl = make_impl("fp8")
    layer = make_per_head_layer(KVScaleMethod())
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    expected = kv_cache.clone()
    key_cache, value_cache = split_kv_cache(expected, HEAD_SIZE)
    fp8_cache_write_reference(
        key, value, key_cache, value_cache, slots, layer._kvscale_k_max, layer._kvscale_v_max
    )
    impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    assert len(our_writes) == 1 and parent_writes == []
    assert our_writes[0][5] is layer._kvscale_k_max and our_writes[0][6] is layer._kvscale_v_max
    assert_same_fp8(kv_cache, expected)


def test_per_head_kvscale_layer_is_read_with_the_layer_max(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Triton attention reads one scale (the first element): during our forward the
    layer shows it the max buffers, and its own per-head tensors come back afterwards."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def parent_forward(self: Any, layer: Any, *args: Any, **kwargs: Any) -> str:
        seen.append((layer._k_scale, layer._v_scale))
        return "out"

    monkeypatch.setattr(triton_attn.TritonAttentionImpl, "forward", parent_forward)
    impl = make_impl("fp8")
    layer = make_per_head_layer(KVScaleMethod())
    per_head = layer._k_scale, layer._v_scale
    assert impl.forward(layer, "q", "k", "v", "cache", "meta", "out") == "out"
    assert seen == [(layer._kvscale_k_max, layer._kvscale_v_max)]
    assert (layer._k_scale, layer._v_scale) == per_head
    per_tensor = make_layer(KVScaleMethod())
    impl.forward(per_tensor, "q", "k", "v", "cache", "meta", "out")
    assert seen[-1] == (per_tensor._k_scale, per_tensor._v_scale)


def test_per_head_layer_not_served_by_kvscale_is_refused(
    parent_writes: list, our_writes: list
) -> None:
    impl = make_impl("fp8")
    layer = make_per_head_layer(OtherMethod())
    layer.layer_name = "model.layers.0.self_attn.attn"
    key, value, slots = make_inputs()
    kv_cache = vllm_kv_cache(NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE)
    with pytest.raises(RuntimeError, match=r"model.layers.0.self_attn.attn has per-head KV"):
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
    assert our_writes == [] and parent_writes == []
