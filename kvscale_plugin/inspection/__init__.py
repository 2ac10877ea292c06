"""``kvscale inspect MODEL_DIR``: what a checkpoint's KV-cache scales will do, without an engine.

Reads ``config.json`` and safetensors headers, and only the bytes of the scale
tensors (``kvscale_plugin.checkpoint``), then builds the report through the same core
the host adapters use. Nothing here imports a host engine. The package, in the order
the report is built:

* ``config``   -- reading ``config.json``: layers, attention layers, MTP layers, heads;
* ``tensors``  -- classifying and decoding scale tensors (naming, values, problems);
* ``report``   -- ``inspect_checkpoint``: scheme verdict, name hooks, scale rules, and
  kvscale's view of every layer;
* ``stock``    -- the model of what stock vLLM 0.32 / SGLang 0.5.23 do instead;
* ``weights``  -- the weight / activation schemes (``config_groups``): not judged, so no
  start is predicted for them, except failures measured on the installed platform;
* ``problems`` -- the catalogue of problems (codes, severities) and their collection;
* ``records``  -- the in-memory report (dataclasses) the modules above fill;
* ``render``   -- the text table; ``schema`` -- the ``--json`` output as pydantic models
  (their JSON schema, ``schema.json``, documents it).

Exit status (``run_inspect``): 0 nothing that changes what is served; 1 problems
that change what is served (an ``error`` in ``problems``, e.g. weight schemes measured
to stop the installed host's start-up: ``unsupported_weight_scheme``); 2 unusable input (not
a directory, no/invalid ``config.json``, no safetensors files, a safetensors file
the ``safetensors`` library refuses, index and shards disagree).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from kvscale_plugin.checkpoint import CheckpointError
from kvscale_plugin.inspection.records import InspectReport
from kvscale_plugin.inspection.render import render_text
from kvscale_plugin.inspection.report import inspect_checkpoint
from kvscale_plugin.inspection.stock import stock_vllm_scheme

__all__ = [
    "SCHEMA_VERSION",
    "InspectReport",
    "inspect_checkpoint",
    "render_text",
    "report_to_json",
    "run_inspect",
    "stock_vllm_scheme",
]


def __getattr__(name: str) -> Any:
    # The schema module (pydantic models) loads on first use, so that
    # ``python -m kvscale_plugin.inspection.schema`` does not import it twice.
    if name == "SCHEMA_VERSION":
        from kvscale_plugin.inspection.schema import SCHEMA_VERSION

        return SCHEMA_VERSION
    if name == "report_to_json":
        from kvscale_plugin.inspection.output import report_to_json

        return report_to_json
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def run_inspect(model_dir: str, as_json: bool = False, host: str = "vllm") -> int:
    """The ``kvscale inspect`` command: print the report, return the exit status (0, 1, 2).

    ``model_dir`` may name a Hub checkpoint (``ORG/NAME[@REV]``, ``hf://ORG/NAME``) when no
    such local path exists (``inspection.hub``): the same report, plus what was fetched."""
    from kvscale_plugin.inspection.hub import inspect_hub, parse_hub_spec

    source = None
    try:
        spec = parse_hub_spec(model_dir)
        if spec is None:
            report = inspect_checkpoint(model_dir, host=host)
        else:
            report, source = inspect_hub(spec, host=host)
    except CheckpointError as exc:
        print(f"kvscale inspect: error: {exc}", file=sys.stderr)
        if as_json:
            from kvscale_plugin.inspection.output import error_to_json

            print(json.dumps(error_to_json(str(model_dir), host, exc), indent=2))
        return 2
    if as_json:
        from kvscale_plugin.inspection.output import report_to_json

        hub = None if source is None else source.to_json()
        print(json.dumps(report_to_json(report, hub), indent=2))
    else:
        sys.stdout.write(render_text(report) + ("" if source is None else source.describe()))
    return report.exit_status
