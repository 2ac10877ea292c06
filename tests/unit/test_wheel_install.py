"""The wheel built from this checkout, installed outside it, as a user installs it.

The wheel is built (``pip wheel --no-deps``) from a copy of the checkout's files (what git
tracks, plus new files it does not ignore), so the build writes no ``build/`` or
``*.egg-info`` into the checkout. It is installed with ``pip install --no-deps --target``
into a temporary folder, never into ``.venv``. A fresh interpreter started there imports
``kvscale_plugin`` from that folder: it runs with ``-S`` (no ``site``, so no ``.pth`` file
runs and the editable install's finder in ``.venv`` is never installed), cwd outside the
checkout, ``PYTHONPATH`` only the install folder; ``.venv``'s site-packages is appended
after it only for the dependencies (pluggy and the standard library's own).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from fnmatch import fnmatch
from importlib.metadata import Distribution
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # pip builds and installs, fresh interpreters

REPO = Path(__file__).resolve().parents[2]
PACKAGE = "kvscale_plugin"
#: (group, name, value) every install must register (pyproject.toml's entry points).
ENTRY_POINTS = {
    ("vllm.general_plugins", "kvscale", "kvscale_plugin.hosts.vllm:register"),
    ("sglang.srt.plugins", "kvscale", "kvscale_plugin.hosts.sglang:register"),
    ("console_scripts", "kvscale", "kvscale_plugin.cli:main"),
}
#: Folders never copied when the checkout is not a git repository.
_NOT_SOURCE = (".git", ".venv*", "build", "dist", "*.egg-info", "__pycache__", ".*_cache")

# Run by the fresh interpreter (``-S``): argv[1] = the install folder, argv[2:] = folders
# holding the dependencies, appended after everything else.
_CHILD = r"""
import importlib.metadata, json, sys
site_dir, deps = sys.argv[1], sys.argv[2:]
sys.path.extend(d for d in deps if d not in sys.path)
import kvscale_plugin
from kvscale_plugin.calibration.corpus import builtin_corpus
from kvscale_plugin.kernels.cpu_native import SOURCE

dist = importlib.metadata.distribution("kvscale-plugin")
loaded = []
for ep in dist.entry_points:
    ep.load()  # the target exists in the installed tree
    loaded.append([ep.group, ep.name, ep.value])
print(json.dumps({
    "file": kvscale_plugin.__file__,
    "dist": str(dist.locate_file("")),
    "entry_points": loaded,
    "corpus_texts": len(builtin_corpus("all")),
    "c_source": str(SOURCE),
    "c_source_exists": SOURCE.is_file(),
    "sys_path": sys.path,
    "meta_path": [repr(f) for f in sys.meta_path],
}))
"""


@dataclass(frozen=True)
class Installed:
    tmp: Path
    wheel: Path
    site: Path
    dist_info: Path


def _run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


def _source_files(under: str = ".") -> list[str] | None:
    """Files git tracks (as in the working tree) plus untracked ones it does not ignore,
    relative to the checkout; None when the checkout is not a git repository."""
    try:
        proc = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", under],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except OSError:
        return None
    if proc.returncode != 0:
        return None
    names = sorted({n for n in proc.stdout.split("\0") if n})
    return [n for n in names if (REPO / n).is_file()]  # a deleted, not yet staged file


def _package_files() -> list[str]:
    names = _source_files(PACKAGE)
    if names is None:
        names = [
            p.relative_to(REPO).as_posix()
            for p in (REPO / PACKAGE).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
        ]
    return sorted(names)


def _copy_checkout(dest: Path) -> None:
    names = _source_files()
    if names is None:
        shutil.copytree(REPO, dest, ignore=shutil.ignore_patterns(*_NOT_SOURCE))
        return
    for name in names:
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)


def _has_setuptools() -> bool:
    import importlib.util

    return importlib.util.find_spec("setuptools") is not None


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    tmp = tmp_path_factory.mktemp("wheel-install")
    assert not tmp.resolve().is_relative_to(REPO)
    src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
    _copy_checkout(src)
    pip = [sys.executable, "-m", "pip"]
    # The build backend (setuptools) from this environment when it has one: no registry
    # needed. An isolated build fetches setuptools from the package registry.
    isolation = ["--no-build-isolation"] if _has_setuptools() else []
    _run([*pip, "wheel", "--no-deps", *isolation, "-w", str(dist), str(src)], cwd=tmp)
    wheels = sorted(dist.glob("kvscale_plugin-*.whl"))
    assert len(wheels) == 1, wheels
    _run([*pip, "install", "--no-deps", "--target", str(site), str(wheels[0])], cwd=tmp)
    dist_infos = sorted(site.glob("kvscale_plugin-*.dist-info"))
    assert len(dist_infos) == 1, dist_infos
    return Installed(tmp=tmp, wheel=wheels[0], site=site, dist_info=dist_infos[0])


def _child_env(site: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(PYTHONPATH=str(site), PYTHONNOUSERSITE="1", PYTHONDONTWRITEBYTECODE="1")
    return env


def test_imports_from_the_install_not_the_checkout(installed: Installed) -> None:
    site = installed.site
    paths = sysconfig.get_paths()
    deps = list(dict.fromkeys([paths["purelib"], paths["platlib"]]))
    proc = _run(
        [sys.executable, "-S", "-c", _CHILD, str(site), *deps],
        cwd=installed.tmp,
        env=_child_env(site),
    )
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    where = Path(seen["file"]).resolve()
    assert where == (site / PACKAGE / "__init__.py").resolve(), seen["file"]
    assert not where.is_relative_to(REPO), seen["file"]
    # The metadata the interpreter finds first is the wheel's, not the editable install's.
    assert Path(seen["dist"]).resolve() == site.resolve(), seen["dist"]
    # Nothing of the checkout's editable install was active.
    assert str(REPO) not in seen["sys_path"], seen["sys_path"]
    assert not [p for p in seen["sys_path"] if "__editable__" in p], seen["sys_path"]
    assert not [f for f in seen["meta_path"] if "editable" in f.lower()], seen["meta_path"]
    # Data files are read from the installed tree.
    assert seen["corpus_texts"] > 0
    assert seen["c_source_exists"], seen["c_source"]
    assert Path(seen["c_source"]).resolve().is_relative_to(site.resolve()), seen["c_source"]
    assert {tuple(ep) for ep in seen["entry_points"]} == ENTRY_POINTS


def test_every_package_file_is_installed(installed: Installed) -> None:
    files = _package_files()
    assert f"{PACKAGE}/__init__.py" in files
    data = [f for f in files if not f.endswith(".py")]
    assert data, "no data files found under kvscale_plugin/"
    missing_data = [f for f in data if not (installed.site / f).is_file()]
    assert not missing_data, (
        f"not in the wheel: {missing_data}; add them to [tool.setuptools.package-data] "
        "in pyproject.toml"
    )
    modules = [f for f in files if f.endswith(".py")]
    missing_modules = [f for f in modules if not (installed.site / f).is_file()]
    assert not missing_modules, (
        f"not in the wheel: {missing_modules}; is an __init__.py missing, or "
        "[tool.setuptools.packages.find] too narrow?"
    )


def test_package_data_patterns_each_match_a_file(installed: Installed) -> None:
    """Each package-data pattern in pyproject.toml still names a shipped file."""
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    patterns = config["tool"]["setuptools"]["package-data"][PACKAGE]
    shipped = [
        p.relative_to(installed.site / PACKAGE).as_posix()
        for p in (installed.site / PACKAGE).rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    unmatched = [pat for pat in patterns if not any(fnmatch(f, pat) for f in shipped)]
    assert not unmatched, f"package-data patterns that ship nothing: {unmatched}"


def test_entry_points_in_the_wheel_metadata(installed: Installed) -> None:
    assert (installed.dist_info / "entry_points.txt").is_file()
    eps = Distribution.at(installed.dist_info).entry_points
    assert {(ep.group, ep.name, ep.value) for ep in eps} >= ENTRY_POINTS
