"""Attention layers that read another layer's KV cache: which scales they serve.

Gemma-3n and Gemma-4 (``num_kv_shared_layers``) and the Gemma-4 assistant drafter have
attention layers that compute no K/V: each reads the cache of an earlier ("target") layer.
That cache was written with the target's k/v scales, so a reading layer must dequantize
with exactly those -- at 1.0 (what stock vLLM serves) every output still looks plausible
and is quietly wrong. The rule, for every host:

- a sharing layer serves its target's resolved scales (device tensors, floats, host
  copies), after every load and reload; never its own;
- scales a checkpoint ships under a sharing layer's own name are not what its cache uses:
  the target's win, and one warning per engine lists the pairs whose values differ;
  corrupt values there are unused, so they are warned about, never refused;
- calibration writes no scales for a sharing layer, so "scales missing" never counts one.

Pure: no host imports; hosts hand in what their layers hold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvscale_plugin.scales import ResolvedScales, ScaleSource

#: ``ResolvedScales.source`` as the load line reports a sharing layer.
SHARED_SOURCE = "shared"


@dataclass
class SharedLayers:
    """One engine's sharing layers in this process, as their loads are processed:
    the pairs whose own checkpoint scales differ from the target's, and the corrupt
    tensors found under sharing layers' names (unused)."""

    differing: dict[str, tuple[str, tuple[float, ...], tuple[float, ...]]] = field(
        default_factory=dict
    )
    unused_corrupt: dict[str, str] = field(default_factory=dict)

    def note_own_scales(
        self,
        layer: str,
        target: str,
        own_k: Sequence[float] | None,
        own_v: Sequence[float] | None,
        served: ResolvedScales,
    ) -> None:
        """Record what the checkpoint shipped under ``layer``'s own name (None: nothing)
        against what it serves (``target``'s)."""
        own = tuple(own_k or ()) + tuple(own_v or ())
        if not own or served.source is ScaleSource.UNSCALED:
            return  # nothing shipped, or a cache that uses no scales (bf16)
        theirs = tuple(served.k_heads) + tuple(served.v_heads)
        if own != theirs:
            self.differing[layer] = (target, own, theirs)

    def note_unused_corrupt(self, problems: Mapping[str, str]) -> None:
        """``problems``: tensor name -> what is wrong with it."""
        self.unused_corrupt.update(problems)

    def warnings(self) -> list[str]:
        """What to warn about (once per engine), then forgets it."""
        out = []
        if self.differing:
            pairs = "; ".join(
                f"{layer} ships {_fmt(own)}, its cache is {target}'s: {_fmt(theirs)}"
                for layer, (target, own, theirs) in sorted(self.differing.items())
            )
            out.append(
                "kvscale: layers that read another layer's KV cache serve that layer's "
                f"k/v scales, not the ones the checkpoint ships under their own names: "
                f"{pairs}. Nothing to do unless the checkpoint meant otherwise (its "
                "calibration should write no scales for these layers)."
            )
        if self.unused_corrupt:
            names = ", ".join(f"{t}: {why}" for t, why in sorted(self.unused_corrupt.items()))
            out.append(
                "kvscale: corrupt k/v scales under layers that read another layer's KV "
                f"cache are not used (the target's are): {names}. Fix or drop these "
                "tensors in the checkpoint."
            )
        self.differing.clear()
        self.unused_corrupt.clear()
        return out


def sharing_pairs(targets: Mapping[str, str | None]) -> dict[str, str]:
    """``{layer: target}`` for the layers (``{layer: its target or None}``) that read
    another layer's cache; a target that itself shares resolves to the writing layer."""
    out = {}
    for layer, target in targets.items():
        seen = {layer}
        while target is not None and targets.get(target) is not None and target not in seen:
            seen.add(target)
            target = targets[target]
        if target is not None:
            out[layer] = target
    return out


def _fmt(values: tuple[float, ...]) -> str:
    return "(" + ", ".join(f"{v:.4g}" for v in values) + ")"


def kv_sharing_targets(text_config: Mapping[str, object]) -> dict[int, int]:
    """``{layer: the layer whose cache it reads}`` from a model's (text) config.json, as
    vLLM 0.32 wires it: the last ``num_kv_shared_layers`` layers read an earlier one --
    Gemma-3n the last full-attention (sliding: second-to-last) layer before them, Gemma-4
    the last earlier layer of the same ``layer_types`` entry. Empty: no sharing."""
    shared = text_config.get("num_kv_shared_layers")
    total = text_config.get("num_hidden_layers")
    types = text_config.get("layer_types")
    if not (isinstance(shared, int) and isinstance(total, int) and 0 < shared < total):
        return {}
    if not isinstance(types, list) or len(types) < total:
        return {}
    first = total - shared
    gemma3n = str(text_config.get("model_type", "")).startswith("gemma3n")
    out = {}
    for i in range(first, total):
        if gemma3n:
            target = first - (2 if types[i] == "sliding_attention" else 1)
        else:
            earlier = [j for j in range(first) if types[j] == types[i]]
            target = earlier[-1] if earlier else -1
        if target >= 0:
            out[i] = target
    return out
