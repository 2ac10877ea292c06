"""The ``kvscale`` console script: ``kvscale inspect``, ``kvscale calibrate``, ``kvscale demo``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvscale_plugin import __version__


def build_parser() -> argparse.ArgumentParser:
    from kvscale_plugin.demo import runner as demo

    parser = argparse.ArgumentParser(
        prog="kvscale",
        description="Calibrated FP8 KV-cache scales for vLLM and SGLang (kvscale-plugin).",
    )
    parser.add_argument("--version", action="version", version=f"kvscale-plugin {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    inspect = sub.add_parser(
        "inspect",
        help="what a checkpoint's KV scales will do, without starting an engine",
        description="Read config.json and safetensors headers (and only the scale tensors' "
        "bytes) and report the KV scheme verdict, every scale tensor, its host name, "
        "problems, and what the stock host (the installed release, or the one named with "
        "--host) would do compared to kvscale. Exit status: "
        "0 fine, 1 problems that change what is served, 2 unusable input.",
    )
    inspect.add_argument("model_dir", help="checkpoint directory (config.json + *.safetensors)")
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
        description="Run MODEL_DIR with transformers on calibration text, record per "
        "attention layer (and per KV head for --scheme attn_head) the abs max of the keys "
        "after rotary embedding and of the values -- exactly what the KV cache stores -- and "
        "write OUT_DIR: MODEL_DIR's weights (hard-linked or copied), a compressed-tensors "
        "kv_cache_scheme and self_attn.k_scale / v_scale = amax / 448. MODEL_DIR is never "
        "modified. Exit status: 0 written, 2 unusable input or existing OUT_DIR.",
    )
    from kvscale_plugin import calibrate as calibrate_mod

    calibrate_mod.add_arguments(calibrate)

    demo_parser = sub.add_parser(
        "demo",
        help="stock vLLM vs kvscale on real engines, on built-in tiny checkpoints",
        description=demo.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(demo_parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "inspect":
        from kvscale_plugin.inspection import run_inspect

        return run_inspect(args.model_dir, as_json=args.json, host=args.host)
    if args.command == "calibrate":
        from kvscale_plugin import calibrate

        return calibrate.run(args)
    from kvscale_plugin.demo import runner as demo

    return demo.run(args)


if __name__ == "__main__":
    sys.exit(main())
