"""``sglang.srt.plugins: kvscale``: discovery, registration, CLI, ModelConfig, quant config."""

from __future__ import annotations

from collections import Counter

import pytest

# "sglang.srt", not "sglang": this test folder itself is named sglang (see conftest).
import torch  # noqa: E402
from sglang_helpers import SCALES, build_model, resolve_kv_cache_dtype  # noqa: E402

from kvscale_plugin.scheme import FP8_KV_SCHEME  # noqa: E402

pytestmark = pytest.mark.usefixtures("sglang_runtime")

ENTRY_POINT = "kvscale_plugin.hosts.sglang:register"


def _registration_counts() -> Counter:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import CPU_QUANTIZATION_METHODS, QUANTIZATION_METHODS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvscale_plugin.hosts.sglang import method, patches

    counts = Counter(
        choices=QUANTIZATION_CHOICES.count("kvscale"),
        methods=int(QUANTIZATION_METHODS.get("kvscale") is method.KVScaleConfig),
        cpu_methods=int(CPU_QUANTIZATION_METHODS.get("kvscale") is method.KVScaleConfig),
    )
    for patch in patches.PATCHES:
        counts[patch.target] = sum(
            h is patch.hook for _, h, _ in HookRegistry._hooks.get(patch.target, ())
        )
    return counts


def test_load_plugins_discovers_the_entry_point(tiny):
    from importlib.metadata import entry_points

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization import BASE_QUANTIZATION_METHODS
    from sglang.srt.plugins.hook_registry import HookRegistry

    from kvscale_plugin.hosts.sglang import patches

    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvscale"]
    assert [ep.value for ep in eps] == [ENTRY_POINT]
    # load_plugins() (session fixture) ran it; a ModelConfig that claims a checkpoint for
    # kvscale (as every process that builds a kvscale model makes one) activates it: the
    # method is registered once, the hooks applied once, and SGLang's own base table is
    # left alone. (Before any kvscale ModelConfig: test_a_process_without_kvscale_...)
    ModelConfig(
        str(tiny("sgl-llama", family="llama", scales=SCALES)),
        quantization="kvscale",
        dtype="bfloat16",
    )
    counts = _registration_counts()
    assert set(counts.values()) == {1}, counts
    assert "kvscale" not in BASE_QUANTIZATION_METHODS
    assert {patch.target for patch in patches.PATCHES} <= HookRegistry._patched


def test_registering_again_adds_nothing():
    from sglang.srt.plugins import load_plugins

    from kvscale_plugin.hosts import sglang
    from kvscale_plugin.hosts.sglang import method, patches

    before = _registration_counts()
    sglang.register()
    sglang.register()
    load_plugins()
    # Even below the once-only guard, each registration step is idempotent on its own.
    method.register_quantization()
    patches.register_hooks()
    assert _registration_counts() == before


def test_prepare_server_args_accepts_kvscale(tiny):
    from sglang.srt.server_args import prepare_server_args

    ckpt = tiny("sgl-llama", family="llama", scales=SCALES)
    args = prepare_server_args(
        ["--model-path", str(ckpt), "--quantization", "kvscale", "--device", "cpu"]
    )
    assert args.quantization == "kvscale"
    assert args.kv_cache_dtype == "auto"
    # The choices are enforced: an unknown name is still rejected.
    with pytest.raises(SystemExit):
        prepare_server_args(
            ["--model-path", str(ckpt), "--quantization", "no-such-method", "--device", "cpu"]
        )


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_model_config_and_get_quant_config_pick_kvscale(tiny, family):
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig,
    )
    from sglang.srt.model_loader.weight_utils import get_quant_config

    from kvscale_plugin.hosts.sglang.method import KVScaleConfig

    ckpt = tiny(f"sgl-{family}", family=family, scales=SCALES)
    model_config = ModelConfig(str(ckpt), quantization="kvscale", dtype="bfloat16")
    assert model_config.quantization == "kvscale"  # claimed via override_quantization_method
    cfg = get_quant_config(model_config, LoadConfig(), {})
    assert isinstance(cfg, KVScaleConfig)
    assert cfg.kv_cache_quant_algo == "FP8"
    assert cfg.kv_verdict.supported
    assert cfg.model_type == family
    # Weight handling stays SGLang's compressed-tensors (it switches on this name).
    assert cfg.get_name() == "compressed_tensors"

    # Without --quantization nothing changes: stock compressed-tensors is detected.
    stock_config = ModelConfig(str(ckpt), dtype="bfloat16")
    assert stock_config.quantization == "compressed-tensors"
    stock = get_quant_config(stock_config, LoadConfig(), {})
    assert type(stock) is CompressedTensorsConfig


def test_auto_kv_cache_dtype_resolves_to_fp8(tiny):
    ckpt = tiny("sgl-llama", family="llama", scales=SCALES)
    model, _ = build_model(ckpt)
    assert resolve_kv_cache_dtype(model, "auto") == ("fp8_e4m3", torch.float8_e4m3fn)
    # An explicit dtype from the user wins.
    assert resolve_kv_cache_dtype(model, "bf16")[1] == torch.bfloat16


def test_unsupported_scheme_keeps_auto_at_model_dtype(tiny):
    ckpt = tiny(
        "sgl-unsupported-channel",
        kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "channel"},
        scales=SCALES,
    )
    model, _ = build_model(ckpt)
    assert model.quant_config.kv_cache_quant_algo is None
    assert resolve_kv_cache_dtype(model, "auto") == (None, torch.bfloat16)


def test_checkpoint_without_quantization_config_is_a_clear_error(tiny):
    ckpt = tiny("sgl-unquantized", quantization_config=False, kv_cache_scheme=None)
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        build_model(ckpt)


FRESH_PROCESS = r"""
import json, sys
sys.path.insert(0, sys.argv[2])
import conftest  # the torchvision shim SGLang needs on this CPU
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
from kvscale_plugin.hosts.sglang import patches
targets = [p.target for p in patches.PATCHES]
load_plugins()
def hooked():
    return sorted(t for t in targets if HookRegistry._hooks.get(t) or t in HookRegistry._patched)
before = hooked()
from sglang.srt.configs.model_config import ModelConfig
ModelConfig(sys.argv[1], dtype="bfloat16")  # another engine's config: kvscale not asked
stock = hooked()
ModelConfig(sys.argv[1], quantization="kvscale", dtype="bfloat16")
applied = sorted(t for t in targets if t in HookRegistry._patched)
print("RESULT " + json.dumps({"before": before, "stock": stock, "applied": applied}))
"""


def test_a_process_without_kvscale_keeps_sglangs_own_code(tiny, tmp_path):
    """In a fresh SGLang process, ``load_plugins()`` registers kvscale's method and no
    ``HookRegistry`` patch; a ModelConfig of another engine adds none either; the first
    ModelConfig that claims a checkpoint for kvscale registers and applies all of them."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from kvscale_plugin.hosts.sglang import patches

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            FRESH_PROCESS,
            str(tiny("sgl-llama", family="llama", scales=SCALES)),
            str(Path(__file__).parent),
        ],
        env={**os.environ, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    assert result["before"] == [] and result["stock"] == [], result
    assert result["applied"] == sorted(p.target for p in patches.PATCHES), result


def test_no_unoptimized_weights_notice_for_kvscale(tiny):
    """SGLang warns "<method> quantization is not fully optimized yet" for methods missing
    from a list local to ``_verify_quantization``; kvscale quantizes no weights, so a
    kvscale ModelConfig no longer says it (twice per Engine start before) -- while the
    same line for any other method still reaches SGLang's handlers."""
    import logging

    from sglang.srt.configs.model_config import ModelConfig

    class Keep(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    target = logging.getLogger("sglang.srt.configs.model_config")
    keep = Keep()
    target.addHandler(keep)
    try:
        ckpt = tiny("sgl-llama", family="llama", scales=SCALES)
        ModelConfig(str(ckpt), quantization="kvscale", dtype="bfloat16")
        target.warning("%s quantization is not fully optimized yet. The speed ...", "awq")
    finally:
        target.removeHandler(keep)
    notices = [m for m in keep.messages if "not fully optimized" in m]
    assert notices == ["awq quantization is not fully optimized yet. The speed ..."], notices
