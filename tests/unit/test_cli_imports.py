"""What the ``kvscale`` command imports: ``--help`` and ``inspect`` load no host engine.

Each command runs in a fresh interpreter with ``-X importtime``, which lists every module
the process imported; the assertions are about those modules, not about time
(``benchmarks/cli_startup.py`` measures the time).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from kvscale_testing.scale_checkpoint import scale_only_checkpoint

from kvscale_plugin.cli import build_parser

HOSTS = ("vllm", "sglang")
#: What building the parser must not cost: torch and what imports it.
HEAVY = ("torch", "transformers", "compressed_tensors", *HOSTS)


def _imported(*argv: str) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    """Run ``kvscale ARGV`` (the console script's ``main``) in a fresh interpreter; its
    result and the top-level packages it imported."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "kvscale_plugin.cli", *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    return proc, {m.split(".")[0] for m in modules}


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("argv", [["--help"], ["inspect", "--help"], ["calibrate", "--help"]])
def test_help_imports_no_torch_and_no_host(argv):
    proc, packages = _imported(*argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage: kvscale" in proc.stdout
    assert "kvscale_plugin" in packages
    assert not packages & set(HEAVY), sorted(packages & set(HEAVY))


@pytest.fixture(scope="module")
def inspected(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], set[str]]:
    model = scale_only_checkpoint(tmp_path_factory.mktemp("cli-imports") / "tiny")
    return _imported("inspect", str(model))


@pytest.mark.slow  # fresh interpreters
@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_of_a_local_checkpoint_imports_no_torch(tmp_path, strategy, as_json):
    """A local checkpoint declaring llm-compressor's scheme: the scale bytes are decoded
    without torch, the scheme read without compressed-tensors (which imports torch and
    transformers)."""
    model = scale_only_checkpoint(tmp_path / "tiny", strategy=strategy)
    proc, packages = _imported("inspect", str(model), *(["--json"] if as_json else []))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert '"supported": true' in proc.stdout if as_json else "PROBLEMS: none" in proc.stdout
    assert not packages & set(HEAVY), sorted(packages & set(HEAVY))


@pytest.mark.slow  # a fresh interpreter
def test_inspect_imports_no_host(inspected):
    proc, packages = inspected
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "PROBLEMS: none" in proc.stdout
    assert "kvscale_plugin" in packages
    assert not packages & set(HOSTS), sorted(packages & set(HOSTS))


def test_demo_arguments_are_loaded_when_demo_is_parsed(capsys):
    """``demo``'s arguments and description come from ``kvscale_plugin.demo.runner``, added
    only when ``demo`` is parsed: its ``--help`` is the runner's."""
    from kvscale_plugin.demo import runner

    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvscale demo ")
    assert runner.__doc__.strip().splitlines()[0] in out
    assert "--real" in out and "--variants" in out
    args = build_parser().parse_args(["demo", "--tokens", "7", "--real"])
    assert (args.command, args.tokens, args.real) == ("demo", 7, True)
