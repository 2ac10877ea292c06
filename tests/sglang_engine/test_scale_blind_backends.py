"""kvscale on SGLang attention backends that ignore KV scales (no Engine start).

The decision (``kvscale_plugin.hosts.sglang.backends``) rests on a fact about SGLang's
sources: which backends pass the layers' k/v scales to the KV pool. These tests read it
from the installed SGLang, check that its pool does not apply a layer's scales by itself,
and check the decision. The Engine tests (test_engine.py) run it end to end: ``auto`` on
torch_native keeps bf16 with one warning, an explicit FP8 cache there is refused.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvscale_plugin.hosts.sglang.backends import (
    SCALE_APPLYING_BACKENDS,
    SCALE_BLIND_BACKENDS,
    BackendAction,
    judge_attention_backends,
)

SITE = Path(__file__).resolve().parent / "site"
#: Backend modules that write the cache without a k/v scale but are not MHA backends
#: kvscale's per-layer FP8 scales apply to (MLA caches are not written by MHA pools).
NOT_MHA = {"sglang.srt.layers.attention.flashinfer_mla_backend"}


def source(module: str) -> str:
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, f"SGLang has no module {module}"
    return Path(spec.origin).read_text()


@pytest.fixture(scope="module")
def registered_backends() -> set[str]:
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    return set(ATTENTION_BACKENDS)


@pytest.mark.parametrize("name", sorted(SCALE_BLIND_BACKENDS))
def test_blind_backends_write_the_cache_without_scales(name, registered_backends):
    assert name in registered_backends
    text = source(SCALE_BLIND_BACKENDS[name])
    assert "set_kv_buffer(" in text
    assert "k_scale" not in text and "v_scale" not in text


@pytest.mark.parametrize("name", sorted(SCALE_APPLYING_BACKENDS))
def test_named_alternatives_pass_the_layer_scales(name, registered_backends):
    assert name in registered_backends
    text = source(SCALE_APPLYING_BACKENDS[name])
    assert "set_kv_buffer" in text
    assert "layer.k_scale" in text and "layer.v_scale" in text


def test_no_other_sglang_backend_writes_the_cache_without_scales():
    """An SGLang upgrade that adds a scale-blind backend makes this fail (add it to
    SCALE_BLIND_BACKENDS, or to NOT_MHA with the reason)."""
    import sglang.srt.layers.attention as attention

    blind = set()
    for path in Path(attention.__path__[0]).glob("*.py"):
        text = path.read_text()
        if "set_kv_buffer(" in text and "k_scale" not in text:
            blind.add(f"{attention.__name__}.{path.stem}")
    assert blind == set(SCALE_BLIND_BACKENDS.values()) | NOT_MHA


def test_sglang_pool_does_not_apply_a_layers_scales_by_itself():
    """SGLang's MHA pool divides by the scales it is passed, never by ``layer.k_scale``:
    a backend that passes none stores K and V at scale 1.0."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(
        size=8,
        page_size=1,
        dtype=torch.float8_e4m3fn,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    layer = SimpleNamespace(
        layer_id=0,
        k_scale=torch.tensor(4.0),
        v_scale=torch.tensor(2.0),
        k_scale_float=4.0,
        v_scale_float=2.0,
    )
    k = torch.linspace(-900, 900, 3 * 2 * 8).reshape(3, 2, 8).to(torch.bfloat16)
    v = k.flip(0).contiguous()
    loc = torch.tensor([1, 2, 3])

    def stored() -> tuple[torch.Tensor, torch.Tensor]:
        return pool.get_key_buffer(0)[1:4].float(), pool.get_value_buffer(0)[1:4].float()

    def fp8(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float8_e4m3fn).float()

    pool.set_kv_buffer(layer, loc, k.clone(), v.clone())  # what torch_native calls
    blind_k, blind_v = stored()
    assert torch.equal(blind_k, fp8(k)) and torch.equal(blind_v, fp8(v))
    pool.set_kv_buffer(layer, loc, k.clone(), v.clone(), 4.0, 2.0)  # what triton calls
    scaled_k, scaled_v = stored()
    assert torch.equal(scaled_k, fp8(k / 4)) and torch.equal(scaled_v, fp8(v / 2))
    assert not torch.equal(blind_k, scaled_k * 4)  # the two differ: scales matter here


@pytest.mark.parametrize("requested", [None, "auto"])
def test_auto_on_a_blind_backend_keeps_the_model_dtype(requested):
    verdict = judge_attention_backends(requested, ("torch_native", "torch_native"))
    assert verdict.action is BackendAction.MODEL_DTYPE
    assert verdict.blind == ("torch_native",)
    assert "torch_native attention backend" in verdict.message
    assert "model dtype" in verdict.message and "--attention-backend triton" in verdict.message


@pytest.mark.parametrize("requested", ["fp8_e4m3", "fp8_e5m2"])
def test_explicit_fp8_on_a_blind_backend_is_refused(requested):
    verdict = judge_attention_backends(requested, ("triton", "flex_attention"))
    assert verdict.action is BackendAction.REFUSE
    assert verdict.blind == ("flex_attention",)
    assert f"--kv-cache-dtype {requested}" in verdict.message
    assert "flex_attention attention backend" in verdict.message


def test_every_blind_backend_is_named():
    verdict = judge_attention_backends("auto", ("flex_attention", "torch_native"))
    assert verdict.blind == ("flex_attention", "torch_native")
    assert "flex_attention and torch_native attention backends write" in verdict.message


@pytest.mark.parametrize(
    "requested, backends",
    [
        ("auto", ("triton", "triton")),
        ("fp8_e4m3", ("fa3", "flashinfer")),
        ("auto", ()),  # outside a server: nothing known, nothing changed
        ("bf16", ("torch_native", "torch_native")),  # no FP8 cache asked for
        ("bfloat16", ("wave", "qsa")),
    ],
)
def test_nothing_changes_otherwise(requested, backends):
    verdict = judge_attention_backends(requested, backends)
    assert verdict.action is BackendAction.SERVE and verdict.message is None


#: Run in a fresh interpreter: publishing server args replaces this process's SGLang
#: runtime context, which tests/sglang_host's session fixture owns when both folders run.
WIRING_SCRIPT = """
import json, runpy, sys
runpy.run_path(sys.argv[1])  # the torchvision shim
from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
from sglang.srt.server_args import ServerArgs
from kvscale_plugin.hosts.sglang import method
from kvscale_plugin.hosts.sglang.backends import configured_attention_backends
out = []
for fields, kv_cache_dtype in json.loads(sys.argv[2]):
    reset_context()
    args = ServerArgs(model_path="dummy", device="cpu", kv_cache_dtype=kv_cache_dtype, **fields)
    publish(args, role="test", ranks=SpawnRanks(world_rank=0))
    out.append([list(configured_attention_backends()), method._backend_verdict().action.value,
                method._cache_may_be_fp8()])
print("RESULT", json.dumps(out))
"""


def test_decision_reads_the_published_server_args():
    """In a process with published server args (as SGLang's scheduler has), kvscale sees
    SGLang's own ``(prefill, decode)`` backend pair and ``--kv-cache-dtype``."""
    cases = [
        ({"attention_backend": "torch_native"}, "auto"),
        ({"attention_backend": "torch_native"}, "fp8_e4m3"),
        ({"attention_backend": "triton"}, "auto"),
        (
            {"prefill_attention_backend": "triton", "decode_attention_backend": "flex_attention"},
            "auto",
        ),
        ({"attention_backend": "torch_native"}, "bf16"),
    ]
    expected = [
        [["torch_native", "torch_native"], "model_dtype", False],
        [["torch_native", "torch_native"], "refuse", True],
        [["triton", "triton"], "serve", True],
        [["triton", "flex_attention"], "model_dtype", False],
        [["torch_native", "torch_native"], "serve", False],
    ]
    proc = subprocess.run(
        [sys.executable, "-c", WIRING_SCRIPT, str(SITE / "sitecustomize.py"), json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert json.loads(lines[-1][len("RESULT ") :]) == expected
