"""SGLang releases beside the one the suite runs on (0.5.23): every internal the adapter
touches -- the thirteen ``HookRegistry`` patch targets with the parameters their hooks read, and
the registries and helpers ``method`` imports -- resolves in 0.5.21's and 0.5.22's sources
(fetched with ``pip download --no-deps`` into build/host-sources, read without importing).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "compat"))
from static_check import fetch_sources, target_problem  # noqa: E402

from kvscale_plugin.hosts.sglang import STATIC_SGLANG_VERSIONS, TESTED_SGLANG_VERSIONS  # noqa: E402
from kvscale_plugin.hosts.sglang.patches import PATCHES  # noqa: E402

CACHE = Path(__file__).resolve().parents[2] / "build" / "host-sources"

#: What ``hosts.sglang.method`` imports from SGLang (module, attribute).
METHOD_TARGETS = (
    ("sglang.kernels.ops.quantization.fp8_kernel", "is_fp8_fnuz"),
    ("sglang.srt.layers.quantization", "QUANTIZATION_METHODS"),
    ("sglang.srt.layers.quantization", "CPU_QUANTIZATION_METHODS"),
    (
        "sglang.srt.layers.quantization.compressed_tensors.compressed_tensors",
        "CompressedTensorsConfig",
    ),
    ("sglang.srt.layers.quantization.kv_cache", "BaseKVCacheMethod"),
    ("sglang.srt.layers.radix_attention", "RadixAttention"),
    ("sglang.srt.runtime_context", "get_parallel"),
    ("sglang.srt.runtime_context", "get_context"),
    ("sglang.srt.runtime_context", "attention_backends"),
    ("sglang.srt.arg_groups.choices", "QUANTIZATION_CHOICES"),
    ("sglang.srt.server_args", "add_quantization_method_choices"),
    ("sglang.srt.plugins.hook_registry", "HookRegistry.register"),
    ("sglang.srt.plugins.hook_registry", "_current_plugin_source"),
)


@pytest.fixture(scope="module", params=TESTED_SGLANG_VERSIONS + STATIC_SGLANG_VERSIONS)
def sources(request):
    return request.param, fetch_sources(f"sglang=={request.param}", "sglang", CACHE)


def test_every_patch_target_resolves(sources):
    version, src = sources
    problems = {
        patch.target: why
        for patch in PATCHES
        if (why := target_problem(src, patch.module, patch.attr, patch.params, patch.leading))
    }
    assert problems == {}, f"SGLang {version}: {problems}"


def test_every_method_import_resolves(sources):
    version, src = sources
    problems = {
        f"{module}.{attr}": why
        for module, attr in METHOD_TARGETS
        if (why := target_problem(src, module, attr))
    }
    assert problems == {}, f"SGLang {version}: {problems}"


def test_the_checker_sees_a_moved_target(sources):
    """The static check can fail: a renamed attribute and changed parameters are caught."""
    _, src = sources
    patch = PATCHES[0]
    assert "has no" in target_problem(src, patch.module, patch.attr + "_renamed")
    assert "expected" in target_problem(src, patch.module, patch.attr, ("no_such_param",))
