"""``kvscale inspect``: see ``kvscale_plugin.inspection.report`` (being split into modules)."""

from kvscale_plugin.inspection.report import (
    SCHEMA_VERSION,
    InspectReport,
    inspect_checkpoint,
    render_text,
    report_to_json,
    run_inspect,
    stock_vllm_scheme,
)

__all__ = [
    "SCHEMA_VERSION",
    "InspectReport",
    "inspect_checkpoint",
    "render_text",
    "report_to_json",
    "run_inspect",
    "stock_vllm_scheme",
]
