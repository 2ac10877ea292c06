"""The JSON output of ``kvscale inspect --json`` as pydantic models: they produce it.

The JSON schema generated from these models is the documentation; it is committed as
``kvscale_plugin/inspection/schema.json`` (a test keeps it in sync). Regenerate it with::

    python -m kvscale_plugin.inspection.schema > kvscale_plugin/inspection/schema.json

``schema_version`` 1: keys are only ever added (``DESCRIPTION`` lists those added without
a version bump; readers of the earlier keys see the same values). With weight schemes,
``outcome`` is the engine's (``unverified`` or ``fails``, see ``weights``) and the KV-cache
verdict it had is ``kv_cache_outcome``.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, RootModel, TypeAdapter

from kvscale_plugin.inspection.problems import CATALOGUE, ProblemCode
from kvscale_plugin.inspection.records import (
    Kind,
    Naming,
    Outcome,
    Severity,
    Source,
)
from kvscale_plugin.inspection.weights import WeightOutcome

SCHEMA_VERSION = 1
DESCRIPTION = (
    "Output of `kvscale inspect MODEL_DIR --json` (kvscale-plugin): InspectOutput for a "
    "readable checkpoint (exit status 0 or 1), InspectError for unusable input (exit "
    "status 2). schema_version 1: keys are only ever added; the per-head keys (num_kv_heads, "
    "num_attention_heads, scheme.per_head, k_heads / v_heads, heads / values of scales and "
    "tensors, a tensor problem's head) and the weight-scheme keys (weights, "
    "stock / kvscale kv_cache_outcome and kv_cache_summary) were added without a version "
    "bump, and so were hub (only for a Hub checkpoint, `kvscale inspect ORG/NAME`) and a "
    "tensor's engine_layer."
)


class Value(RootModel[float | Literal["nan", "inf", "-inf"]]):
    """A number; "nan", "inf", "-inf" for those (JSON has no such literals)."""


_OUTCOMES = (
    "none: no scheme, nothing is scaled; starts: (engine) starts and serves; refuses: "
    "refuses to start (unsupported scheme / corrupt scales); fails: crashes at start-up "
    "while loading; loads: (layer) serves the k/v shown, from the checkpoint; default: "
    "(layer) serves 1.0, scales missing or dropped by the loader; broken: serves a cache "
    "corrupted by a bad scale (NaN / inf / zeros); unscaled: serves an unscaled cache, "
    "checkpoint scales ignored; unverified: not known"
)
_SOURCES = (
    "checkpoint: k and v from the checkpoint; duplicated: one scale (legacy kv_scale) for k "
    "and v; default: none loaded, 1.0 (one warning); unscaled: scheme unsupported, checkpoint "
    "ignored; shared: the layer reads another layer's KV cache and serves that layer's "
    "scales; error: start-up stops (CorruptScaleError); none: no scale parameter"
)
_CODES = "; ".join(f"{code} ({sev}): {what}" for code, (sev, what) in CATALOGUE.items())


class _Model(BaseModel):
    model_config = ConfigDict(use_attribute_docstrings=True)


class FileEntry(_Model):
    """One safetensors file."""

    name: str
    tensors: int
    """Tensors in its header."""
    bytes: int
    """File size."""


class CheckpointSummary(_Model):
    """The safetensors files and what inspect read of them."""

    sharded: bool
    num_tensors: int
    files: list[FileEntry]
    total_bytes: int
    """Size of all safetensors files."""
    bytes_read: int
    """Headers and scale tensors actually read."""


class SchemeSummary(_Model):
    """The declared ``kv_cache_scheme`` and kvscale's verdict (``scheme.judge_kv_cache_scheme``)."""

    declared: bool
    supported: bool
    reason: str
    assumed: dict[str, bool | int | float | str | None]
    """Library defaults for the fields the checkpoint omits."""
    description: str
    kv_cache_scheme: Any
    """As declared in config.json (null: none)."""
    quant_method: str | None
    per_head: bool
    """The scheme has strategy attn_head (supported or not)."""


_ENGINE_OUTCOME = (
    "The engine's outcome: the KV-cache verdict (kv_cache_outcome), except that weight "
    "schemes inspect does not judge (weights.outcome not_checked) turn 'starts' into "
    "'unverified', and weight schemes measured to fail on the installed platform "
    "(weights.outcome unsupported) make it 'fails'. "
)


class StockSummary(_Model):
    """What the unmodified host does with this checkpoint."""

    engine: str
    """The host and the release reported against, e.g. "vllm 0.31.0", "sglang 0.5.23"."""
    outcome: Outcome = Field(description=_ENGINE_OUTCOME + _OUTCOMES)
    summary: str
    basis: str
    """What the model of the stock host rests on (source read, measurements, reports)."""
    kv_cache_outcome: Outcome = Field(description="The KV-cache part alone. " + _OUTCOMES)
    kv_cache_summary: str
    """The KV-cache part alone (the summary without the weight verdict)."""


class KvscaleSummary(_Model):
    """What the host with kvscale does with this checkpoint."""

    outcome: Outcome = Field(description=_ENGINE_OUTCOME + _OUTCOMES)
    summary: str
    kv_cache_outcome: Outcome = Field(description="The KV-cache part alone. " + _OUTCOMES)
    kv_cache_summary: str
    """The KV-cache part alone (the summary without the weight verdict)."""


class WeightGroupEntry(_Model):
    """One quantization_config.config_groups entry."""

    name: str
    targets: list[str]
    weights: str | None
    """E.g. "static FP8 per channel" (null: weights not quantized by this group)."""
    input_activations: str | None
    output_activations: str | None


class WeightsSummary(_Model):
    """The weight / activation schemes (config_groups): inspect judges the KV cache, not
    these."""

    declared: bool
    outcome: WeightOutcome = Field(
        description="none: no config_groups; not_checked: declared, not judged (the host's "
        "compressed-tensors code serves them; start-up not predicted); unsupported: "
        "measured to stop the installed host's start-up on its platform (e.g. static FP8 "
        "input activations on vLLM's CPU build 0.32.0)"
    )
    summary: str
    platform: str | None
    """The installed host's platform the verdict used ("cpu": vLLM's CPU build); null when
    the release is named or the platform is unknown."""
    groups: list[WeightGroupEntry]


class NameMapping(_Model):
    """Checkpoint names with the layer index as {i}, and the host parameter they map to."""

    pattern: str
    target: str | None
    """Null: no rule maps it."""
    count: int


class ProblemEntry(_Model):
    """One problem; errors come first."""

    severity: Severity
    """error: changes what is served (exit status 1); warning: does not."""
    code: ProblemCode = Field(description=_CODES)
    message: str
    tensors: list[str]
    layers: list[str]


class Scale(_Model):
    """A scale tensor of a layer."""

    tensor: str
    value: Value | None
    """Null when not a single element."""
    dtype: str
    shape: list[int]
    naming: Naming
    heads: int | None
    """H when it has the per-head layout the attn_head scheme expects; else null."""
    values: list[Value] | None
    """Every element (null: not decoded)."""


class StockView(_Model):
    """What the unmodified host serves for the layer."""

    k: Value | None
    """Per-layer number (max over heads for per-head scales)."""
    v: Value | None
    outcome: Outcome = Field(description=_OUTCOMES)
    note: str
    k_heads: list[Value] | None
    """Per head; null unless the scheme is attn_head."""
    v_heads: list[Value] | None


class KvscaleView(_Model):
    """What kvscale serves for the layer (``scales.resolve_kv_scales``)."""

    k: Value | None
    """Per-layer number (max over heads for per-head scales)."""
    v: Value | None
    source: Source = Field(description=_SOURCES)
    note: str
    k_heads: list[Value] | None
    """Per head; null unless the scheme is attn_head."""
    v_heads: list[Value] | None


class Layer(_Model):
    """One attention layer; rows with problems first, then by index."""

    layer: str
    """Attention module, e.g. model.layers.0.self_attn."""
    index: int | None
    mtp: bool
    k: Scale | None
    v: Scale | None
    q: Scale | None
    stock: StockView
    kvscale: KvscaleView
    problems: list[ProblemCode]


class TensorProblemEntry(_Model):
    """One problem of one tensor."""

    code: ProblemCode
    detail: str
    head: int | None
    """The bad element of a per-head scale."""


class Tensor(_Model):
    """A scale-like tensor (scale or zero point); tensors with problems first."""

    name: str
    file: str
    dtype: str
    shape: list[int]
    value: Value | None
    """Null when not a single element."""
    values: list[Value] | None
    """Every element (null: not decoded)."""
    heads: int | None
    """As in a layer's scale."""
    kind: Kind | None
    naming: Naming
    target: str | None
    """Host parameter name (null: unmapped)."""
    layer: str | None
    engine_layer: str | None
    """vLLM: the attention layer the engine serves it on, as the engine names it, where
    the architecture's translation on that release is measured; null otherwise."""
    problems: list[TensorProblemEntry]


class HubFile(_Model):
    """Fetched of one file (size: as the Hub lists it): per safetensors file, at most 8 +
    the header + the scale tensors' bytes."""

    file: str
    size: int | None
    bytes: int
    requests: int


class HubFetch(_Model):
    """Where a Hub checkpoint's report came from: the commit read and the HF_ENDPOINT (from
    the local Hub cache: its snapshot and folder)."""

    repo_id: str
    revision: str | None
    commit: str | None
    endpoint: str
    from_cache: bool
    files: list[HubFile]
    bytes: int
    requests: int


class InspectOutput(_Model):
    """``kvscale inspect --json`` on a readable checkpoint (exit status 0 or 1)."""

    schema_version: Literal[1]
    tool: Literal["kvscale inspect"]
    kvscale_version: str
    model_dir: str
    host: Literal["vllm", "sglang"]
    host_version: str | None
    """The host release reported against: the installed one, or the one named with
    ``--host vllm==X`` (null: none installed, none named)."""
    host_note: str
    """What the report rests on for that release (tested, checked statically, or modelled)."""
    model_type: str | None
    """config.json model_type (given to the name-mapping hooks)."""
    num_hidden_layers: int | None
    """text_config's for multimodal configs."""
    attention_layers: list[int] | None
    """Layer indices expected to hold a KV cache."""
    mtp_layers: int
    """MTP / draft layers the config declares."""
    num_kv_heads: int | None
    """num_key_value_heads (else num_attention_heads)."""
    num_attention_heads: int | None
    checkpoint: CheckpointSummary
    scheme: SchemeSummary
    stock: StockSummary
    kvscale: KvscaleSummary
    weights: WeightsSummary
    mapping: list[NameMapping]
    problems: list[ProblemEntry]
    layers: list[Layer]
    tensors: list[Tensor]
    exit_status: Literal[0, 1]
    """1: an error in problems (it changes what is served)."""
    hub: HubFetch | None = None  # only for a Hub checkpoint


class ErrorInfo(_Model):
    type: str
    """The exception class (CheckpointError)."""
    message: str
    """Names the file and what to do."""


class InspectError(_Model):
    """``kvscale inspect --json`` on unusable input (exit status 2): not a directory,
    no / invalid config.json, no safetensors files, a safetensors file the library
    refuses, index and shards disagreeing."""

    schema_version: Literal[1]
    model_dir: str
    host: str
    error: ErrorInfo
    exit_status: Literal[2]


def json_schema() -> dict[str, Any]:
    """The JSON schema of ``kvscale inspect --json`` output (either form)."""
    adapter: TypeAdapter[InspectOutput | InspectError] = TypeAdapter(InspectOutput | InspectError)
    schema = adapter.json_schema()
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvscale inspect --json",
        "description": DESCRIPTION,
        **schema,
    }


if __name__ == "__main__":
    print(json.dumps(json_schema(), indent=2))
