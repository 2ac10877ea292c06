"""benchmarks/lm_eval: the bootstrap maths on known data, the task YAML and its corpus,
and (when lm-eval is installed in build/lm-eval: scripts/setup_lm_eval.sh) one real
lm-eval run on a tiny checkpoint with a bf16 cache.

Cost: the maths and parsing well under a second; the real run ~60-90 s (imports of
vLLM and lm-eval, one tiny in-process engine).
"""

from __future__ import annotations

import importlib.util
import json
import math
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
HARNESS_DIR = REPO / "benchmarks" / "lm_eval"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


harness = _load("kvscale_lm_eval_run", HARNESS_DIR / "run.py")
prose = _load("kvscale_lm_eval_prose_corpus", HARNESS_DIR / "tasks" / "prose_corpus.py")
make_corpus = _load("kvscale_lm_eval_make_corpus", HARNESS_DIR / "make_corpus.py")


# The maths ---------------------------------------------------------------------------


def test_metrics_match_lm_eval_definitions():
    # word perplexity exp(-Σll/Σwords); bits per byte -Σll/(Σbytes·ln 2)
    assert harness.word_perplexity([-2.0, -4.0], [1, 2]) == pytest.approx(math.e**2)
    assert harness.bits_per_byte([-8 * math.log(2)], [8]) == pytest.approx(1.0)
    s = harness.DocScores(loglik=[-10.0, -30.0, -20.0], words=[5, 10, 5], bytes=[20, 40, 20])
    assert harness.metric(s, "word_perplexity") == pytest.approx(math.exp(60 / 20))
    assert harness.metric(s, "word_perplexity", [1, 1]) == pytest.approx(math.exp(3.0))
    assert harness.metric(s, "bits_per_byte", [0, 2]) == pytest.approx(30 / (40 * math.log(2)))


def test_percentile_interval_on_known_values():
    values = list(range(101))  # 0..100: the 2.5th and 97.5th percentiles are 2.5 and 97.5
    assert harness.percentile_interval(values) == pytest.approx((2.5, 97.5))
    assert harness.percentile_interval([3.0] * 7) == (3.0, 3.0)
    assert harness.percentile_interval(values, level=0.5) == pytest.approx((25.0, 75.0))
    with pytest.raises(ValueError):
        harness.percentile_interval([])


def test_resamples_are_reproducible_with_replacement():
    a = harness.resamples(10, 200, seed=3)
    assert a == harness.resamples(10, 200, seed=3)
    assert a != harness.resamples(10, 200, seed=4)
    assert all(len(d) == 10 and all(0 <= i < 10 for i in d) for d in a)
    assert any(len(set(d)) < 10 for d in a)  # with replacement: repeats occur


def _varied(n: int, seed: int = 1) -> harness.DocScores:
    import random

    rng = random.Random(seed)
    words = [rng.randint(50, 300) for _ in range(n)]
    # per-word log-likelihood that varies a lot between documents
    ll = [-w * rng.uniform(3.0, 6.0) for w in words]
    return harness.DocScores(ll, words, [6 * w for w in words])


def test_bootstrap_interval_contains_estimate_and_shrinks_with_more_documents():
    s = _varied(40)
    draws = harness.resamples(40, 4000, seed=0)
    value, low, high = harness.bootstrap(s, "word_perplexity", draws)
    assert value == pytest.approx(harness.metric(s, "word_perplexity"))
    assert low < value < high
    # Every document four times: the same estimate, an interval ~half as wide (1/sqrt(n)).
    big = harness.DocScores(s.loglik * 4, s.words * 4, s.bytes * 4)
    v4, low4, high4 = harness.bootstrap(big, "word_perplexity", harness.resamples(160, 4000))
    assert v4 == pytest.approx(value)
    assert (high4 - low4) / (high - low) == pytest.approx(0.5, abs=0.1)
    # Identical documents: no spread at all.
    same = harness.DocScores([-40.0] * 10, [10] * 10, [50] * 10)
    assert harness.bootstrap(same, "bits_per_byte", harness.resamples(10, 100)) == pytest.approx(
        (40 / (50 * math.log(2)),) * 3
    )


def test_paired_bootstrap_sees_a_small_shift_the_unpaired_intervals_hide():
    ref = _varied(40)
    # Every document 1% worse: invisible against the spread of the text, certain paired.
    worse = harness.DocScores([x * 1.01 for x in ref.loglik], ref.words, ref.bytes)
    draws = harness.resamples(40, 4000, seed=0)
    _, lo_ref, hi_ref = harness.bootstrap(ref, "word_perplexity", draws)
    _, lo_w, hi_w = harness.bootstrap(worse, "word_perplexity", draws)
    assert lo_w < hi_ref  # the two intervals overlap
    diff, lo, hi = harness.paired_bootstrap(worse, ref, "word_perplexity", draws)
    assert diff == pytest.approx(
        harness.metric(worse, "word_perplexity") - harness.metric(ref, "word_perplexity")
    )
    assert 0 < lo <= diff <= hi
    assert harness.paired_bootstrap(ref, ref, "bits_per_byte", draws) == (0.0, 0.0, 0.0)
    other = harness.DocScores(ref.loglik, [w + 1 for w in ref.words], ref.bytes)
    with pytest.raises(ValueError, match="different documents"):
        harness.paired_bootstrap(other, ref, "word_perplexity", draws)


def test_doc_scores_from_lm_eval_samples():
    samples = [
        {"doc_id": 1, "word_perplexity": [-5.0, 3], "bits_per_byte": [-5.0, 12]},
        {"doc_id": 0, "word_perplexity": [-7.5, 4], "bits_per_byte": [-7.5, 20]},
    ]
    s = harness.doc_scores_from_samples(samples)
    assert (s.loglik, s.words, s.bytes) == ([-7.5, -5.0], [4, 3], [20, 12])
    with pytest.raises(ValueError, match="'bits_per_byte'"):
        harness.doc_scores_from_samples([{"doc_id": 0, "word_perplexity": [-1.0, 1]}])
    bad = [{"doc_id": 0, "word_perplexity": [-1.0, 1], "bits_per_byte": [-2.0, 4]}]
    with pytest.raises(ValueError, match="sample 0"):
        harness.doc_scores_from_samples(bad)


def test_report_prints_refusals_and_pairs():
    ref = _varied(12)
    kv = harness.DocScores([x * 1.02 for x in ref.loglik], ref.words, ref.bytes)
    cfgs = {c.name: c for c in harness.configurations()}
    rows = [
        (cfgs["bf16 cache"], {"scores": ref.__dict__, "lm_eval": {}, "seconds": 1.0}),
        (cfgs["per-tensor stock FP8"], {"refused": "FP8 KV cache on CPU requires x86 ..."}),
        (cfgs["per-tensor kvscale FP8"], {"scores": kv.__dict__, "lm_eval": {}, "seconds": 2}),
    ]
    text, out = harness.report(rows, 200)
    assert "per-tensor stock FP8" in text and "refused: FP8 KV cache on CPU requires" in text
    assert "none: no stock / kvscale FP8 pair ran here" in text
    assert out[2]["vs_bf16_word_perplexity"][1] > 0  # 2% worse on every document


def test_refusal_reason_prefers_vllm_fp8_refusal():
    from kvscale_testing.probe import FP8_CPU_REFUSAL

    log = f"INFO start\nValueError: {FP8_CPU_REFUSAL} (this CPU has AVX2)\nRuntimeError: x\n"
    assert harness.refusal_reason(log).startswith(FP8_CPU_REFUSAL)
    assert harness.refusal_reason("a\nKeyError: 'x'\nb\n") == "KeyError: 'x'"


# The task and its corpus --------------------------------------------------------------


class _TaskLoader(yaml.SafeLoader):
    pass


_TaskLoader.add_constructor("!function", lambda loader, node: ("!function", node.value))


def test_task_yaml_is_a_local_rolling_perplexity_task():
    cfg = yaml.load((HARNESS_DIR / "tasks" / "kvscale_prose.yaml").read_text(), _TaskLoader)
    assert cfg["task"] == harness.TASK
    assert cfg["output_type"] == "loglikelihood_rolling"
    assert cfg["doc_to_target"] == "{{text}}"
    assert [m["metric"] for m in cfg["metric_list"]] == [
        "word_perplexity",
        "byte_perplexity",
        "bits_per_byte",
    ]
    assert "dataset_path" not in cfg  # nothing to download
    tag, target = cfg["custom_dataset"]
    module, func = target.split(".")
    assert (tag, module, func) == ("!function", "prose_corpus", "load")
    assert callable(getattr(prose, func))


def test_corpus_is_psf_prose_the_scales_were_not_fitted_on():
    from kvscale_plugin.calibration import builtin_corpus

    docs = prose.read_corpus()
    assert len(docs) == 51
    assert all("PSF License" in d["licence"] for d in docs)
    texts = [d["text"] for d in docs]
    assert len(set(texts)) == len(texts)
    assert set(builtin_corpus("heldout")) <= set(texts)
    assert not set(builtin_corpus("calibration")) & set(texts)
    assert all(re.split(r"\s+", t) == t.split() for t in texts)  # lm-eval's word count
    if platform.python_version() == "3.11.7":  # docstrings differ between releases
        assert make_corpus.documents() == docs


def test_corpus_reader_names_the_bad_line_and_field(tmp_path):
    bad = tmp_path / "c.jsonl"
    good = {"text": "x", "source": "s", "licence": "l"}
    bad.write_text(json.dumps(good) + "\n" + json.dumps({**good, "licence": ""}) + "\n")
    with pytest.raises(ValueError, match=r"c.jsonl:2: field\(s\) \['licence'\]"):
        prose.read_corpus(bad)
    bad.write_text("[1]\n")
    with pytest.raises(ValueError, match="c.jsonl:1: expected a JSON object"):
        prose.read_corpus(bad)


# One real lm-eval run ------------------------------------------------------------------

LM_EVAL_MISSING = harness.lm_eval_missing()


@pytest.mark.engine
@pytest.mark.slow
@pytest.mark.skipif(LM_EVAL_MISSING is not None, reason=str(LM_EVAL_MISSING))
def test_lm_eval_word_perplexity_equals_vllm_prompt_logprobs(tiny, tmp_path):
    """lm-eval's per-document log-likelihood and word perplexity on a real vLLM engine
    (bf16 cache, --quantization kvscale) equal what the same engine's prompt logprobs give
    for [BOS] + the document's tokens, tokenized here with the checkpoint's tokenizer."""
    import transformers

    ckpt = tiny("default", num_layers=2)
    tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(ckpt / "tokenizer.json"))
    bos = tok.convert_tokens_to_ids("<s>")
    docs = [d["text"] for d in prose.read_corpus()[:3]]
    max_len = 2048
    prompts = [[bos, *tok(t, add_special_tokens=False)["input_ids"]] for t in docs]
    # One rolling window per document (lm-eval: max_length - 2 tokens), so the two sums
    # cover exactly the same predictions.
    assert all(len(p) <= max_len - 2 for p in prompts)
    # In a fresh process: lm-eval's folder (pandas, pyarrow, ...) stays off this
    # session's sys.path.
    spec = {
        "model": str(ckpt),
        "quantization": "kvscale",
        "kv_cache_dtype": "bfloat16",
        "limit": 3,
        "lm_eval_dir": str(harness.LM_EVAL_DIR),
        "prompts": prompts,
        "engine_args": {"max_model_len": max_len, "kv_cache_memory_bytes": 64 * 2**20},
    }
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(HARNESS_DIR / "run.py"), "--worker", json.dumps(spec), str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    data = json.loads(out.read_text())
    scores, results = harness.DocScores(**data["scores"]), data["lm_eval"]
    words = [len(t.split()) for t in docs]
    assert scores.words == words
    assert scores.bytes == [len(t.encode()) for t in docs]
    for ll, lps, p in zip(scores.loglik, scores.token_logprobs, prompts, strict=True):
        assert len(lps) == len(p) - 1
        assert ll == pytest.approx(sum(lps), rel=1e-4)
    expected = math.exp(-sum(sum(lps) for lps in scores.token_logprobs) / sum(words))
    assert results["word_perplexity,none"] == pytest.approx(expected, rel=1e-4)
    assert harness.metric(scores, "word_perplexity") == pytest.approx(expected, rel=1e-4)
    # The tiny model (a 512-token vocabulary, many tokens per word) is far from fluent.
    assert 1 < expected < math.inf
