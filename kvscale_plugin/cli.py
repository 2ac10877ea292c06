"""The ``kvscale`` console script: ``kvscale inspect``, ``kvscale calibrate``, ``kvscale demo``.

Building the parser imports no torch and no host engine, so ``kvscale --help`` and
``kvscale inspect`` start fast: the ``demo`` subcommand's arguments (and the torch-based
modules that define them) are loaded only when ``demo`` is what is being parsed, and
each command's implementation only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from kvscale_plugin import __version__


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose arguments may be added by ``populate`` just before it
    parses (or prints its help): a subcommand whose arguments live in a heavy module
    costs nothing until that subcommand is used."""

    def __init__(
        self,
        *args: Any,
        populate: Callable[[argparse.ArgumentParser], None] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._populate = populate

    def _populated(self) -> _Parser:
        if self._populate is not None:
            populate, self._populate = self._populate, None
            populate(self)
        return self

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        return super(_Parser, self._populated()).parse_known_args(args, namespace)

    def format_usage(self) -> str:
        return super(_Parser, self._populated()).format_usage()

    def format_help(self) -> str:
        return super(_Parser, self._populated()).format_help()


def _populate_demo(parser: argparse.ArgumentParser) -> None:
    from kvscale_plugin.demo import runner as demo

    parser.description = demo.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    demo.add_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    from kvscale_plugin.calibration import cli as calibrate_cli

    parser = argparse.ArgumentParser(
        prog="kvscale",
        description="Calibrated FP8 KV-cache scales for vLLM and SGLang (kvscale-plugin).",
    )
    parser.add_argument("--version", action="version", version=f"kvscale-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    inspect = sub.add_parser(
        "inspect",
        help="what a checkpoint's KV scales will do, without starting an engine",
        description="Read config.json and safetensors headers (and only the scale tensors' "
        "bytes) and report the KV scheme verdict, every scale tensor, its host name, "
        "problems, and what the stock host (the installed release, or the one named with "
        "--host) would do compared to kvscale. Exit status: "
        "0 fine, 1 problems that change what is served, 2 unusable input.",
    )
    inspect.add_argument(
        "model_dir",
        help="checkpoint directory (config.json + *.safetensors), or a Hub checkpoint "
        "ORG/NAME[@REVISION] / hf://ORG/NAME (headers and scale bytes only are fetched)",
    )
    inspect.add_argument("--json", action="store_true", help="machine-readable output")
    inspect.add_argument(
        "--host",
        default="vllm",
        metavar="HOST[==VERSION]",
        help="vllm (default) or sglang; reported against the installed release, or the one "
        "named (vllm==0.31.0)",
    )

    calibrate = sub.add_parser(
        "calibrate",
        help="measure FP8 KV-cache scales with transformers and write a checkpoint with them",
        description=calibrate_cli.DESCRIPTION,
    )
    calibrate_cli.add_arguments(calibrate)

    # Its arguments and description come from kvscale_plugin.demo.runner, which imports
    # torch: added when "demo" is parsed (kvscale demo, kvscale demo --help).
    sub.add_parser(
        "demo",
        help="stock vLLM vs kvscale on real engines, on built-in tiny checkpoints",
        populate=_populate_demo,
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        from kvscale_plugin.inspection import run_inspect

        return run_inspect(args.model_dir, as_json=args.json, host=args.host)
    if args.command == "calibrate":
        from kvscale_plugin.calibration import cli as calibrate_cli

        return calibrate_cli.run(args)
    from kvscale_plugin.demo import runner as demo

    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
