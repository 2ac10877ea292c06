"""Verdict on a checkpoint's ``kv_cache_scheme`` (pure; imports no host).

The scheme is parsed with compressed-tensors' own ``QuantizationArgs`` so that
its defaults and validation are the library's, not ours. A scheme is
*supported* when it is static, symmetric, 8-bit float, with one calibrated
scale per layer (``strategy: tensor``) or per KV head (``strategy: attn_head``,
llm-compressor's other KV recipe): what an FP8 (e4m3) KV cache can serve.
Anything else gets a one-line reason and the caller serves an unscaled cache.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: What llm-compressor 0.14.0.1 writes for an FP8 per-tensor static KV cache (its
#: ``examples/quantization_kv_cache`` recipe; ``attn_head`` differs only in ``strategy``),
#: field for field. Its scale tensors are bf16 ``[1]`` (``[H, 1, 1]`` per head).
FP8_KV_SCHEME: dict[str, Any] = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": None,
    "num_bits": 8,
    "observer": None,
    "observer_kwargs": {},
    "scale_dtype": None,
    "strategy": "tensor",
    "symmetric": True,
    "type": "float",
    "zp_dtype": None,
}

# Fields a real llm-compressor checkpoint sometimes leaves out; when missing,
# compressed-tensors fills them in and we report them as "assumed".
_DEFAULTABLE_FIELDS = ("strategy", "symmetric", "dynamic")


@dataclass(frozen=True)
class SchemeVerdict:
    """What a ``kv_cache_scheme`` means for the KV cache.

    ``declared`` is False when the checkpoint has no scheme at all (the
    plugin then changes nothing). ``assumed`` maps each field the checkpoint
    omitted to the library default that was applied.
    """

    declared: bool
    supported: bool
    reason: str
    assumed: Mapping[str, Any] = field(default_factory=dict)
    # The parsed compressed-tensors ``QuantizationArgs``, when parsing worked.
    args: Any = None
    #: Supported and ``strategy: attn_head``: one k/v scale per KV head.
    per_head: bool = False

    def describe(self) -> str:
        """One line for logs and the CLI."""
        if not self.declared:
            return "no kv_cache_scheme declared"
        text = ("supported: " if self.supported else "unsupported: ") + self.reason
        if self.assumed:
            defaults = ", ".join(f"{k}={_show(v)}" for k, v in self.assumed.items())
            text += f" (not in the checkpoint, library defaults assumed: {defaults})"
        return text


def _show(value: Any) -> str:
    value = getattr(value, "value", value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def judge_kv_cache_scheme(scheme: Any) -> SchemeVerdict:
    """Decide whether ``scheme`` (the ``kv_cache_scheme`` JSON value) is served.

    Never raises: malformed input is an unsupported verdict naming the field.
    """
    if scheme is None:
        return SchemeVerdict(declared=False, supported=False, reason="no kv_cache_scheme")
    if not isinstance(scheme, Mapping):
        return SchemeVerdict(
            declared=True,
            supported=False,
            reason=f"kv_cache_scheme must be a JSON object, got {type(scheme).__name__}",
        )

    from compressed_tensors.quantization import (
        QuantizationArgs,
        QuantizationStrategy,
        QuantizationType,
    )
    from pydantic import ValidationError

    try:
        args = QuantizationArgs.model_validate(dict(scheme))
    except ValidationError as exc:
        problems = "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '?'}': {err['msg']}"
            for err in exc.errors()
        )
        return SchemeVerdict(
            declared=True, supported=False, reason=f"malformed kv_cache_scheme ({problems})"
        )
    except Exception as exc:  # noqa: BLE001 - any library refusal of the input is "malformed"
        # compressed-tensors also raises NotImplementedError (e.g. a float scheme that is
        # neither 8 nor 4 bits), TypeError and ValueError on values it cannot take.
        return SchemeVerdict(
            declared=True,
            supported=False,
            reason=f"malformed kv_cache_scheme ({type(exc).__name__}: {exc})",
        )

    assumed = {name: getattr(args, name) for name in _DEFAULTABLE_FIELDS if name not in scheme}

    strategy = QuantizationStrategy(args.strategy) if args.strategy is not None else None
    problems: list[str] = []
    if args.type != QuantizationType.FLOAT or args.num_bits != 8:
        problems.append(
            f"type={_show(args.type)} num_bits={args.num_bits} (only 8-bit float maps to an "
            "FP8 e4m3 cache)"
        )
    if strategy not in (QuantizationStrategy.TENSOR, QuantizationStrategy.ATTN_HEAD):
        problems.append(
            f"strategy={_show(strategy)} (only per-tensor 'tensor' and per-head 'attn_head' "
            "scales are supported)"
        )
    if args.dynamic:
        problems.append(
            f"dynamic={_show(args.dynamic)} (runtime-estimated scales are not used; "
            "a static calibrated scale is required)"
        )
    if not args.symmetric:
        problems.append("symmetric=false (an FP8 cache has no zero point)")

    if problems:
        return SchemeVerdict(
            declared=True,
            supported=False,
            reason="; ".join(problems),
            assumed=assumed,
            args=args,
        )
    per_head = strategy == QuantizationStrategy.ATTN_HEAD
    return SchemeVerdict(
        declared=True,
        supported=True,
        reason=(
            "static symmetric per-head (attn_head) 8-bit float: FP8 e4m3 cache with "
            "calibrated scales per KV head"
            if per_head
            else "static symmetric per-tensor 8-bit float: FP8 e4m3 cache with calibrated scales"
        ),
        assumed=assumed,
        args=args,
        per_head=per_head,
    )
