"""Teacher-forced quality of a KV cache against a bf16-cache reference (real vLLM engines).

Every engine scores the same token ids (``SamplingParams(max_tokens=1,
prompt_logprobs=1)``): the logprob of each actual next token given its prefix, and the
engine's own top-1 token at each position. Compared with a bf16-cache run of the same
weights:

* mean / max |Δ logprob| of the actual tokens,
* perplexity ``exp(-mean logprob)``,
* top-1 agreement: the share of positions whose most likely next token is the reference's.

What ``kvscale demo --real`` reports (``benchmarks/quality.py`` reuses it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass
class TeacherForced:
    """Per scored position (the first token of each prompt has no prediction)."""

    logprobs: list[float]
    top1: list[int]


@dataclass
class Quality:
    tokens: int
    mean_abs_dlogprob: float
    max_abs_dlogprob: float
    ppl: float
    top1_agreement: float


def heldout_token_ids(
    model_dir: str | Path, *, max_tokens: int = 3000, max_len: int = 512
) -> list[list[int]]:
    """Prompts of real English the scales were not fitted on: the built-in corpus'
    held-out split, one sample per prompt (truncated to ``max_len`` tokens), until
    ``max_tokens`` tokens."""
    from transformers import AutoTokenizer

    from kvscale_plugin.calibration import builtin_corpus

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts: list[list[int]] = []
    total = 0
    for text in builtin_corpus("heldout"):
        if total >= max_tokens:
            break
        ids = list(tok(text, truncation=True, max_length=max_len)["input_ids"])
        ids = ids[: max_tokens - total]
        if len(ids) < 2:
            continue
        prompts.append(ids)
        total += len(ids)
    return prompts


def teacher_forced(llm: Any, prompts: Sequence[Sequence[int]]) -> TeacherForced:
    """Logprob of every actual token and the engine's top-1 token, all prompts in one batch."""
    from vllm import SamplingParams

    outs = llm.generate(
        [{"prompt_token_ids": list(p)} for p in prompts],
        SamplingParams(max_tokens=1, prompt_logprobs=1, temperature=0.0),
        use_tqdm=False,
    )
    logprobs: list[float] = []
    top1: list[int] = []
    for ids, out in zip(prompts, outs, strict=True):
        for tok, entry in zip(ids[1:], out.prompt_logprobs[1:], strict=True):
            logprobs.append(float(entry[tok].logprob))
            top1.append(min(entry, key=lambda t, e=entry: (e[t].rank, t)))
    return TeacherForced(logprobs, top1)


def compare(run: TeacherForced, reference: TeacherForced) -> Quality:
    diffs = [abs(a - b) for a, b in zip(run.logprobs, reference.logprobs, strict=True)]
    agree = sum(a == b for a, b in zip(run.top1, reference.top1, strict=True))
    n = len(diffs)
    return Quality(
        tokens=n,
        mean_abs_dlogprob=sum(diffs) / n,
        max_abs_dlogprob=max(diffs),
        ppl=math.exp(-sum(run.logprobs) / n),
        top1_agreement=agree / n,
    )
