"""What ``kvscale demo`` found per variant and engine (``EngineResult``), and how it is
shown: the table (``render_table``) and the plot (``write_plot``: the logprob error beside
the per-layer scales that reached the engines)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EngineResult:
    variant: str
    engine: str
    started: bool
    error: str | None = None
    k_scales: list[float] = field(default_factory=list)
    v_scales: list[float] = field(default_factory=list)
    cache_dtype: str | None = None
    mean_err: float | None = None
    max_err: float | None = None
    seconds: float = 0.0
    # --real only: perplexity, top-1 agreement with the bf16 cache, tokens scored.
    ppl: float | None = None
    top1: float | None = None
    tokens: int | None = None


#: Up to this many layers the table lists every scale; beyond, a summary.
LIST_SCALES_UP_TO = 4


def _fmt_scales(values: list[float]) -> str:
    """Every layer's scale, or (many layers) ``min@layer / median / max@layer``."""
    if len(values) <= LIST_SCALES_UP_TO:
        return " ".join(f"{v:.3g}" for v in values)
    lo = min(range(len(values)), key=values.__getitem__)
    hi = max(range(len(values)), key=values.__getitem__)
    if values[lo] == values[hi]:
        return f"{values[lo]:.3g} (all {len(values)})"
    return f"{values[lo]:.3g}@L{lo} / {statistics.median(values):.3g} / {values[hi]:.3g}@L{hi}"


def render_table(results: list[EngineResult]) -> str:
    k_cells = [_fmt_scales(r.k_scales) for r in results]
    v_cells = [_fmt_scales(r.v_scales) for r in results]
    kw = max([20, *(len(c) + 2 for c in k_cells)])
    vw = max([20, *(len(c) + 2 for c in v_cells)])
    vaw = max([15, *(len(r.variant) + 1 for r in results)])
    quality = any(r.ppl is not None for r in results)
    head = (
        f"{'variant':<{vaw}}{'engine':<11}{'cache':<10}{'k scales':<{kw}}"
        f"{'v scales':<{vw}}{'mean|dlp|':>10}{'max|dlp|':>10}"
    )
    if quality:
        head += f"{'ppl':>10}{'top-1':>8}"
    lines = [head, "-" * len(head)]
    for r, kc, vc in zip(results, k_cells, v_cells, strict=True):
        if not r.started and r.k_scales:
            # Loaded, then refused by this CPU: the scales are real, no logprobs.
            lines.append(
                f"{r.variant:<{vaw}}{r.engine:<11}{(r.cache_dtype or '?') + '*':<10}{kc:<{kw}}"
                f"{vc:<{vw}}{'-':>10}{'-':>10}"
            )
            continue
        if not r.started:
            lines.append(f"{r.variant:<{vaw}}{r.engine:<11}refused to start: {r.error}")
            continue
        line = (
            f"{r.variant:<{vaw}}{r.engine:<11}{r.cache_dtype or '?':<10}{kc:<{kw}}"
            f"{vc:<{vw}}{r.mean_err:>10.4f}{r.max_err:>10.3f}"
        )
        if quality:
            ppl = f"{r.ppl:.2f}" if r.ppl is not None else "-"
            top1 = f"{r.top1:.1%}" if r.top1 is not None else "-"
            line += f"{ppl:>10}{top1:>8}"
        lines.append(line)
    if any(len(r.k_scales) > LIST_SCALES_UP_TO for r in results):
        lines.append(
            "(scales with many layers: min@layer / median / max@layer; every "
            "layer's value is in the plot and --json)"
        )
    return "\n".join(lines)


def scale_lines(results: list[EngineResult]) -> list[tuple[str, str, list[float]]]:
    """The right-hand plot's lines: ``(label, line style, per-layer v scales)`` for every
    engine that read scales -- also one vLLM refused after loading them (an FP8 cache on a
    CPU without AVX-512 / AMX: the layers held these scales when it refused), dotted."""
    lines = []
    for r in (r for r in results if r.v_scales):
        style = ("-" if r.engine == "kvscale" else "--") if r.started else ":"
        label = f"{r.variant} / {r.engine}" + ("" if r.started else " (loaded, refused to run)")
        lines.append((label, style, list(r.v_scales)))
    return lines


def write_plot(results: list[EngineResult], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = list(dict.fromkeys(r.variant for r in results))
    engines = list(dict.fromkeys(r.engine for r in results))
    fig, (ax_err, ax_k) = plt.subplots(1, 2, figsize=(13, 4.5))
    width = 0.8 / len(engines)
    for j, engine in enumerate(engines):
        xs, ys = [], []
        for i, variant in enumerate(variants):
            r = next((x for x in results if x.variant == variant and x.engine == engine), None)
            if r is None:  # this engine did not run on this variant
                continue
            xs.append(i + j * width)
            ys.append(r.mean_err if r.started else 0.0)
            if not r.started:
                ax_err.text(
                    i + j * width,
                    0.001,
                    "refused",
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=8,
                )
        ax_err.bar(xs, ys, width=width, label=engine)
    ax_err.set_xticks([i + width * (len(engines) - 1) / 2 for i in range(len(variants))])
    ax_err.set_xticklabels(variants, rotation=15)
    ax_err.set_ylabel("mean |Δ logprob| vs bf16 cache")
    ax_err.set_title("teacher-forced logprob error")
    ax_err.legend()
    lines = scale_lines(results)
    for n, (label, style, scales) in enumerate(lines):
        # Small x offsets keep coinciding lines visible.
        offset = (n - len(lines) / 2) * 0.03
        ax_k.plot([i + offset for i in range(len(scales))], scales, style, marker="o", label=label)
    values = [x for _, _, scales in lines for x in scales if x > 0]
    if values and max(values) / min(values) > 50:  # calibrated real scales next to 1.0
        ax_k.set_yscale("log")
    ax_k.set_xlabel("layer")
    ax_k.set_ylabel("v_scale held by the layer")
    ax_k.set_title("per-layer v scales that reached the engine (1.0 = uncalibrated)")
    ax_k.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
