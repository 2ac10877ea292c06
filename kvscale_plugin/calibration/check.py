"""``kvscale calibrate MODEL_DIR --check``: how well a checkpoint's k/v scales fit a text.

Runs the model with transformers on the text (the built-in corpus, or ``--samples`` /
``--data`` files) through the same observer ``kvscale calibrate`` uses: the keys after
rotary embedding (and any k-norm) and the values, exactly what the KV cache stores, per
attention layer and KV head. Against the scales kvscale would serve for the checkpoint
(``kvscale inspect``'s kvscale view: per tensor or per head, legacy ``kv_scale`` used for
k and v, any naming the name rules map), it reports per layer (and per KV head for
``attn_head``) the observed abs max, ``amax / 448``, the checkpoint scale, their ratio
``scale / (amax / 448)`` (below 1: the scale is too small for this text) and the fraction
of elements that would saturate the FP8 cache: ``|x.float() / scale| > 448``, the values
a cache write (``kernels.reference.quantize_e4m3_reference``) clamps to +-448 (beyond one
float32 step, ``SATURATION_THRESHOLD``: the rounding of a float32 scale is not clipping).

Nothing is written. Exit status: 0 nothing saturates, 1 something saturates, 2 unusable
input (no scales to check, scales kvscale refuses, a model transformers cannot run here).
The command line (text output, exit status) is ``cli.run_check``; ``to_json`` is the
``--json`` output.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvscale_plugin.calibration.common import CalibrationError, sorted_modules
from kvscale_plugin.calibration.corpus import pick_texts
from kvscale_plugin.calibration.observer import KVRecorder, load_model, module_names, observe
from kvscale_plugin.fp8 import FP8_E4M3_MAX

#: An element saturates when ``|x.float() / scale|`` exceeds this: 448, plus one float32
#: step (``2**-15`` at 448). A stored float32 scale can only approximate ``amax / 448``;
#: rounded down by half a step, the largest element of the text it was calibrated on
#: divides to 448.00003, which the clamp moves by 7e-8 of its value (the FP8 step there
#: is 32): rounding of the scale, not a scale that is too small.
SATURATION_THRESHOLD = FP8_E4M3_MAX + 2.0**-15
#: ``schema_version`` of the ``--json`` output: keys are only ever added.
CHECK_SCHEMA_VERSION = 1
TOOL = "kvscale calibrate --check"


@dataclass
class LayerScales:
    """The scales kvscale serves for one attention layer (one value, or one per KV head)."""

    layer: str
    k: tuple[float, ...]
    v: tuple[float, ...]
    per_head: bool
    #: ``checkpoint``, ``duplicated`` (one tensor for k and v) or ``default`` (none: 1.0).
    source: str


@dataclass
class DeclaredScales:
    """A checkpoint's k/v scales as kvscale would serve them, and what inspect said."""

    scheme: str  # "tensor" or "attn_head"
    layers: dict[str, LayerScales]
    #: ``kvscale inspect`` problems (code: message), for the report's notes.
    problems: list[str] = field(default_factory=list)


def declared_scales(model_dir: str | os.PathLike[str]) -> DeclaredScales:
    """The checkpoint's k/v scales per attention layer, through ``kvscale inspect``.

    Raises ``CalibrationError`` when there is nothing to check: no readable checkpoint, no
    (supported) ``kv_cache_scheme``, no scale tensor at all, or scales kvscale refuses.
    """
    from kvscale_plugin.checkpoint import CheckpointError
    from kvscale_plugin.inspection import inspect_checkpoint

    path = Path(model_dir)
    try:
        report = inspect_checkpoint(path)
    except CheckpointError as exc:
        raise CalibrationError(str(exc)) from exc
    write = f"kvscale calibrate {path} --out OUT_DIR writes scales measured on your text"
    if not report.verdict.declared:
        raise CalibrationError(
            f"{path}: declares no kv_cache_scheme, so it has no k/v scales to check; {write}"
        )
    if not report.verdict.supported:
        raise CalibrationError(
            f"{path}: kv_cache_scheme not supported ({report.verdict.reason}): engines ignore "
            f"its scales, nothing to check; {write}"
        )
    if report.kvscale_outcome == "refuses":
        bad = sorted(t.name for t in report.tensors if t.bad_value)
        raise CalibrationError(
            f"{path}: {report.kvscale_summary} ({', '.join(bad)}); run kvscale inspect "
            f"{path} for details; {write}"
        )
    layers: dict[str, LayerScales] = {}
    for row in report.layers:
        view = row.kvscale
        if not row.known or row.mtp or view.k is None or view.v is None:
            continue  # MTP draft layers are not run by the transformers model
        per_head = view.k_heads is not None and view.v_heads is not None
        k = tuple(view.k_heads) if per_head and view.k_heads else (view.k,)
        v = tuple(view.v_heads) if per_head and view.v_heads else (view.v,)
        layers[row.layer] = LayerScales(row.layer, k, v, per_head, view.outcome)
    if not layers or all(s.source == "default" for s in layers.values()):
        raise CalibrationError(
            f"{path}: declares a kv_cache_scheme but stores no k/v scale tensors (every layer "
            f"would use 1.0); nothing to check; {write}"
        )
    return DeclaredScales(
        scheme="attn_head" if report.per_head else "tensor",
        layers={n: layers[n] for n in sorted_modules(layers)},
        problems=[f"{p.severity} {p.code}: {p.message}" for p in report.problems],
    )


class _CheckingObserver(KVRecorder):
    """The calibration recorder, counting per KV head the elements that saturate."""

    def __init__(self, model: torch.nn.Module, scales: Mapping[str, LayerScales]) -> None:
        super().__init__(model)
        self.scales = scales
        self.k_sat: dict[str, torch.Tensor] = {}
        self.v_sat: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}  # elements per KV head, per layer

    def record(
        self,
        module: torch.nn.Module,
        key: torch.Tensor,
        value: torch.Tensor,
        valid: torch.Tensor | None,
    ) -> None:
        super().record(module, key, value, valid)
        name = self.module_names[id(module)]
        s = self.scales.get(name)
        if s is None:
            return  # reported as a layer without scales
        keep = None if valid is None else valid[:, None, :, None]
        for kind, x, scale, into in (("k", key, s.k, self.k_sat), ("v", value, s.v, self.v_sat)):
            heads = x.shape[1]
            if len(scale) not in (1, heads):
                raise CalibrationError(
                    f"{name}.{kind}_scale: {len(scale)} value(s), but the model has {heads} "
                    "KV heads"
                )
            t = torch.tensor(scale, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)
            # What a cache write clamps: (x.float() / scale) outside [-448, 448].
            over = (x.detach().float() / t).abs() > SATURATION_THRESHOLD
            sat = (over if keep is None else over & keep).sum(dim=(0, 2, 3)).cpu()
            into[name] = sat if name not in into else into[name] + sat
        positions = key.shape[0] * key.shape[2] if valid is None else int(valid.sum())
        self.count[name] = self.count.get(name, 0) + positions * key.shape[3]


@dataclass
class KindResult:
    """K or V of one layer: observed maxima, scales, ratios and saturated elements."""

    amax: list[float]  # per KV head
    scale: list[float]  # per KV head (one value repeated for a per-tensor scale)
    saturated: list[int]  # per KV head
    elements: int  # per KV head
    per_head: bool

    @property
    def layer_amax(self) -> float:
        return max(self.amax)

    @property
    def layer_scale(self) -> float:
        return max(self.scale)

    def ratios(self) -> list[float]:
        """``scale / (amax / 448)`` per head (inf for a head that stays at 0)."""
        return [ratio_of(s, a) for s, a in zip(self.scale, self.amax, strict=True)]

    @property
    def ratio(self) -> float:
        """The smallest head ratio (per tensor: the layer's)."""
        return min(self.ratios())

    @property
    def fraction(self) -> float:
        total = self.elements * len(self.saturated)
        return sum(self.saturated) / total if total else 0.0


def ratio_of(scale: float, amax: float) -> float:
    need = amax / FP8_E4M3_MAX
    return math.inf if need == 0 else scale / need


@dataclass
class LayerResult:
    layer: str
    source: str
    k: KindResult
    v: KindResult

    @property
    def clips(self) -> bool:
        return bool(sum(self.k.saturated) or sum(self.v.saturated))


@dataclass
class CheckResult:
    """What ``check`` found (``to_json`` is the ``--json`` output)."""

    model_dir: Path
    scheme: str
    samples: str
    num_samples: int
    num_tokens: int
    max_len: int
    dtype: str
    seconds: float
    layers: list[LayerResult]
    #: Attention layers the model ran that the checkpoint has no scales for.
    unscaled_layers: list[str]
    inspect_problems: list[str]
    #: ``--num-samples`` as given (None: all).
    requested_samples: int | None = None
    #: The ``--samples`` files (empty: the built-in corpus, or texts given directly).
    sample_files: list[str] = field(default_factory=list)

    @property
    def clipping(self) -> list[LayerResult]:
        return [r for r in self.layers if r.clips]

    @property
    def exit_status(self) -> int:
        return 1 if self.clipping else 0

    def worst(self) -> tuple[LayerResult, str] | None:
        """The layer and kind (``k`` / ``v``) with the largest saturated fraction (ties:
        the smaller ratio); among clean layers, the smallest ratio."""
        cands = [(r, kind) for r in self.layers for kind in ("k", "v")]
        if not cands:
            return None
        return max(cands, key=lambda c: (_kind(c).fraction, -_kind(c).ratio))

    def fix_command(self) -> str:
        scheme = " --scheme attn_head" if self.scheme == "attn_head" else ""
        data = "".join(f" --samples {f}" for f in self.sample_files)
        if self.requested_samples != 32:  # calibrate's defaults: 32 samples of 512 tokens
            data += f" --num-samples {self.requested_samples or 0}"
        if self.max_len != 512:
            data += f" --max-len {self.max_len}"
        return f"kvscale calibrate {self.model_dir} --out OUT_DIR{scheme}{data}"


def _kind(c: tuple[LayerResult, str]) -> KindResult:
    return c[0].k if c[1] == "k" else c[0].v


def check(
    model_dir: str | os.PathLike[str],
    *,
    texts: Sequence[str] | None = None,
    samples_source: str = "built-in corpus (calibration split)",
    sample_files: Sequence[str] = (),
    num_samples: int | None = 32,
    max_len: int = 512,
    device: str = "cpu",
    dtype: str = "auto",
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> CheckResult:
    """Run MODEL_DIR on ``texts`` (default: the built-in corpus) against its own k/v scales."""
    src = Path(model_dir)
    if not (src / "config.json").is_file():
        raise CalibrationError(f"{src}: not a checkpoint directory (no config.json)")
    declared = declared_scales(src)  # before the (slow) model run
    texts = pick_texts(texts, num_samples, "check")
    model, tokenizer = _load(src, device, dtype)
    model_dtype = str(next(model.parameters()).dtype).replace("torch.", "")
    if log:
        log(f"loaded {src} on {device} in {model_dtype}")
        log(f"{len(texts)} samples from {samples_source}, up to {max_len} tokens each")
    observed = _match_layers(declared.layers, set(module_names(model).values()))
    observer = _CheckingObserver(model, observed)
    obs = observe(
        model,
        tokenizer,
        texts,
        max_len=max_len,
        progress=progress,
        observer=observer,
        purpose="check",
    )
    del model
    results = []
    for name in sorted_modules(observer.k):
        s = observed.get(name)
        if s is None:
            continue
        heads = observer.k[name].numel()
        results.append(
            LayerResult(
                name,
                s.source,
                _kind_result(observer.k[name], s.k, observer.k_sat[name], observer.count[name]),
                _kind_result(observer.v[name], s.v, observer.v_sat[name], observer.count[name]),
            )
        )
        if len(s.k) not in (1, heads):  # pragma: no cover - raised in record()
            raise CalibrationError(f"{name}: scales do not match the model's {heads} KV heads")
    unscaled = sorted_modules(set(observer.k) - set(observed))
    return CheckResult(
        model_dir=src,
        scheme=declared.scheme,
        samples=samples_source,
        num_samples=obs.num_samples,
        num_tokens=obs.num_tokens,
        max_len=max_len,
        dtype=model_dtype,
        seconds=obs.seconds,
        layers=results,
        unscaled_layers=unscaled,
        inspect_problems=declared.problems,
        requested_samples=num_samples,
        sample_files=list(sample_files),
    )


def _load(src: Path, device: str, dtype: str) -> tuple[Any, Any]:
    """``load_model``, with what transformers cannot load or run here said as such."""
    try:
        return load_model(src, device, dtype)
    except CalibrationError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loader failure is unusable input here
        weights = _weight_schemes(src)
        what = f" (weight schemes: {weights})" if weights else ""
        raise CalibrationError(
            f"{src}: transformers cannot load this checkpoint here{what}: "
            f"{type(exc).__name__}: {exc}. kvscale calibrate --check runs the model with "
            "transformers (and compressed-tensors for quantized weights), like kvscale "
            "calibrate: it works where they can run the checkpoint"
        ) from exc


def _weight_schemes(src: Path) -> str:
    """The checkpoint's weight / activation schemes (``config_groups``), or ""."""
    from kvscale_plugin.checkpoint import CheckpointError, read_config
    from kvscale_plugin.inspection.config import quant_config
    from kvscale_plugin.inspection.weights import describe_groups, weight_groups

    try:
        return describe_groups(weight_groups(quant_config(read_config(src))))
    except CheckpointError:
        return ""


def _match_layers(declared: Mapping[str, LayerScales], modules: set[str]) -> dict[str, LayerScales]:
    """Declared scales keyed by the transformers module that runs the layer: the same name,
    else the module with the same layer index whose name ends like it (multimodal
    checkpoints name the language model differently)."""
    from kvscale_plugin.inspection.config import LAYER_INDEX

    out: dict[str, LayerScales] = {}
    by_suffix: dict[tuple[int, str], list[str]] = {}
    for m in modules:
        found = list(LAYER_INDEX.finditer(m))
        if found:
            last = found[-1]
            by_suffix.setdefault((int(last["idx"]), m[last.end() :]), []).append(m)
    for name, s in declared.items():
        if name in modules:
            out[name] = s
            continue
        found = list(LAYER_INDEX.finditer(name))
        if found:
            last = found[-1]
            cands = by_suffix.get((int(last["idx"]), name[last.end() :]), [])
            if len(cands) == 1:
                out[cands[0]] = s
    return out


def _kind_result(
    amax: torch.Tensor, scale: tuple[float, ...], sat: torch.Tensor, elements: int
) -> KindResult:
    heads = amax.numel()
    scales = list(scale) * heads if len(scale) == 1 else list(scale)
    return KindResult(
        amax=[float(x) for x in amax.reshape(-1)],
        scale=[float(x) for x in scales],
        saturated=[int(x) for x in sat.reshape(-1)],
        elements=elements,
        per_head=len(scale) > 1,
    )


# --------------------------------------------------------------------------- output


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else ("inf" if x > 0 else "nan")


def _kind_json(r: KindResult) -> dict[str, Any]:
    out: dict[str, Any] = {
        "amax": r.layer_amax,
        "amax_over_fp8_max": r.layer_amax / FP8_E4M3_MAX,
        "scale": r.layer_scale,
        "ratio": _num(r.ratio),
        "saturated": sum(r.saturated),
        "elements": r.elements * len(r.saturated),
        "saturated_fraction": r.fraction,
        "heads": None,
    }
    if r.per_head:
        out["heads"] = [
            {
                "head": h,
                "amax": a,
                "amax_over_fp8_max": a / FP8_E4M3_MAX,
                "scale": s,
                "ratio": _num(ratio_of(s, a)),
                "saturated": n,
                "elements": r.elements,
                "saturated_fraction": n / r.elements if r.elements else 0.0,
            }
            for h, (a, s, n) in enumerate(zip(r.amax, r.scale, r.saturated, strict=True))
        ]
    return out


def summary_line(result: CheckResult) -> str:
    """One line: how many layers clip, and the worst one."""
    n, bad = len(result.layers), result.clipping
    worst = result.worst()
    if worst is None:
        return "no attention layer with scales was run"
    row, kind = worst
    w = _kind(worst)
    if not bad:
        return (
            f"no saturation: 0 of {n} layers clip; tightest: {row.layer} {kind.upper()} "
            f"(scale {_fmtratio_of(w.ratio)} amax/448)"
        )
    k_bad = sum(1 for r in bad if sum(r.k.saturated))
    v_bad = sum(1 for r in bad if sum(r.v.saturated))
    return (
        f"SATURATES: {len(bad)} of {n} layers clip (K in {k_bad}, V in {v_bad}); worst: "
        f"{row.layer} {kind.upper()}, {w.fraction:.3%} of elements, scale "
        f"{_fmtratio_of(w.ratio)} amax/448"
    )


def _fmtratio_of(x: float) -> str:
    return "inf x" if math.isinf(x) else f"{x:.3g}x"


def to_json(result: CheckResult) -> dict[str, Any]:
    """The ``--json`` output (exit status 0 or 1)."""
    from kvscale_plugin import __version__

    worst = result.worst()
    return {
        "schema_version": CHECK_SCHEMA_VERSION,
        "tool": TOOL,
        "kvscale_version": __version__,
        "model_dir": str(result.model_dir),
        "scheme": result.scheme,
        "fp8_max": FP8_E4M3_MAX,
        "samples": {
            "source": result.samples,
            "num_samples": result.num_samples,
            "num_tokens": result.num_tokens,
            "max_len": result.max_len,
            "dtype": result.dtype,
            "seconds": round(result.seconds, 3),
        },
        "layers": [
            {
                "layer": r.layer,
                "scale_source": r.source,
                "clips": r.clips,
                "k": _kind_json(r.k),
                "v": _kind_json(r.v),
            }
            for r in result.layers
        ],
        "unscaled_layers": result.unscaled_layers,
        "summary": {
            "layers": len(result.layers),
            "clipping_layers": len(result.clipping),
            "k_clipping_layers": sum(1 for r in result.layers if sum(r.k.saturated)),
            "v_clipping_layers": sum(1 for r in result.layers if sum(r.v.saturated)),
            "worst": None
            if worst is None
            else {
                "layer": worst[0].layer,
                "kind": worst[1],
                "ratio": _num(_kind(worst).ratio),
                "saturated_fraction": _kind(worst).fraction,
            },
            "text": summary_line(result),
        },
        "inspect_problems": result.inspect_problems,
        "fix": result.fix_command() if result.clipping else None,
        "exit_status": result.exit_status,
    }


def error_json(model_dir: str, exc: Exception) -> dict[str, Any]:
    """The ``--json`` output on unusable input (exit status 2)."""
    return {
        "schema_version": CHECK_SCHEMA_VERSION,
        "tool": TOOL,
        "model_dir": model_dir,
        "error": {"type": type(exc).__name__, "message": str(exc)},
        "exit_status": 2,
    }
