"""Verdict on a checkpoint's ``kv_cache_scheme`` (pure; imports no host).

compressed-tensors' own ``QuantizationArgs`` decides what a scheme means: its defaults
and validation are the library's, not ours. Importing it costs seconds (torch,
transformers), so a scheme made only of the fields and values llm-compressor writes is
read here in plain Python (``_plain_args``: what ``QuantizationArgs`` makes of exactly
those inputs; ``tests/unit/test_fuzz_core.py`` checks it against the library on the
fuzzed scheme corpus); anything else goes to the library. A scheme is
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
class KVArgs:
    """The fields of a parsed ``QuantizationArgs`` the verdict rests on, as plain values."""

    type: str
    num_bits: int
    strategy: str | None
    dynamic: bool | str
    symmetric: bool


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
    #: What ``QuantizationArgs`` parsed (plain values), when parsing worked.
    args: KVArgs | None = None
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
    args = _plain_args(scheme)
    if args is None:
        parsed = _library_args(scheme)
        if isinstance(parsed, str):
            return SchemeVerdict(
                declared=True, supported=False, reason=f"malformed kv_cache_scheme ({parsed})"
            )
        args = parsed
    return _verdict(scheme, args)


#: ``QuantizationArgs``' fields; ``_plain_args`` reads a scheme of these only.
_FIELDS = frozenset(
    {*FP8_KV_SCHEME, "num_bits", "type", "symmetric", "strategy", "dynamic", "observer"}
)
#: Must be absent or null for ``_plain_args`` (else the library's validators decide).
_NULL_FIELDS = ("group_size", "block_structure", "actorder", "scale_dtype", "zp_dtype")


def _plain_args(scheme: Mapping[Any, Any]) -> KVArgs | None:
    """What ``QuantizationArgs.model_validate(scheme)`` parses, for the inputs where that
    is plain (8 bits, ``tensor`` / ``channel`` / ``attn_head`` / dynamic ``token``,
    JSON types as llm-compressor writes them); None: only the library can tell."""
    if not scheme.keys() <= _FIELDS or any(scheme.get(f) is not None for f in _NULL_FIELDS):
        return None
    num_bits = scheme.get("num_bits", 8)
    type_ = scheme.get("type", "int")
    symmetric = scheme.get("symmetric", True)
    dynamic = scheme.get("dynamic", False)
    strategy = scheme.get("strategy")
    strategy = "tensor" if strategy is None else strategy  # group_size is None: "tensor"
    observer = scheme.get("observer")
    kwargs = scheme.get("observer_kwargs", {})
    if (
        type(num_bits) is not int
        or num_bits != 8
        or type(type_) is not str
        or type_ not in ("float", "int")
        or type(symmetric) is not bool
        or type(dynamic) is not bool
        or type(strategy) is not str
        or strategy not in (("tensor", "token") if dynamic else ("tensor", "channel", "attn_head"))
        or not (observer is None or type(observer) is str)
        # The library warns about an observer with dynamic quantization: its call.
        or (dynamic and observer not in (None, "memoryless"))
        or not (type(kwargs) is dict and all(type(k) is str for k in kwargs))
    ):
        return None
    return KVArgs(type_, num_bits, strategy, dynamic, symmetric)


def _library_args(scheme: Mapping[Any, Any]) -> KVArgs | str:
    """``scheme`` parsed by compressed-tensors' ``QuantizationArgs`` (imports torch), or
    why it refuses it."""
    from compressed_tensors.quantization import QuantizationArgs
    from pydantic import ValidationError

    try:
        args = QuantizationArgs.model_validate(dict(scheme))
    except ValidationError as exc:
        return "; ".join(
            f"field '{'.'.join(str(p) for p in err['loc']) or '?'}': {err['msg']}"
            for err in exc.errors()
        )
    except Exception as exc:  # noqa: BLE001 - any library refusal of the input is "malformed"
        # compressed-tensors also raises NotImplementedError (e.g. a float scheme that is
        # neither 8 nor 4 bits), TypeError and ValueError on values it cannot take.
        return f"{type(exc).__name__}: {exc}"
    type_, strategy, dynamic = (
        getattr(v, "value", v) for v in (args.type, args.strategy, args.dynamic)
    )
    return KVArgs(type_, args.num_bits, strategy, dynamic, args.symmetric)


def _verdict(scheme: Mapping[Any, Any], args: KVArgs) -> SchemeVerdict:
    assumed = {name: getattr(args, name) for name in _DEFAULTABLE_FIELDS if name not in scheme}
    strategy = args.strategy
    problems: list[str] = []
    if args.type != "float" or args.num_bits != 8:
        problems.append(
            f"type={_show(args.type)} num_bits={args.num_bits} (only 8-bit float maps to an "
            "FP8 e4m3 cache)"
        )
    if strategy not in ("tensor", "attn_head"):
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
    per_head = strategy == "attn_head"
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
