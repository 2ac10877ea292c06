"""``record_kv_scales``: scales from a trainer's own forward pass (issue #47 item 1).

Held against ``kvscale calibrate`` as if it were another program: the console script's
``main`` run on the same texts unpadded must give exactly the scales a padded, batched
trainer forward gives. The trainer's model is loaded with stock transformers, and its pad
token's embedding is made loud (``loud_pad``) so that padding counted as real tokens
would show.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvscale_testing.server import free_port
from kvscale_testing.trainer_forward import (
    load_trainer_model,
    loud_pad,
    pad_id_for,
    padded_batch,
)

from kvscale_plugin import calibration as cal
from kvscale_plugin.cli import main as cli_main

MAX_LEN = 64
#: Texts of distinct lengths (some under MAX_LEN): a batch of them is padded.
TEXTS = [
    text[:chars].strip()
    for text, chars in zip(cal.builtin_corpus("calibration"), (400, 90, 250, 30, 160), strict=False)
]
LAYERS = [f"model.layers.{i}.self_attn" for i in range(3)]


@pytest.fixture(scope="module")
def ckpt(tiny) -> Path:
    return tiny("trainer-scales", num_layers=3, write_scales=False)


@pytest.fixture(scope="module")
def cli_scales(ckpt, tmp_path_factory) -> dict[str, dict[str, torch.Tensor]]:
    """scheme -> ``<module>.k_scale`` / ``.v_scale`` written by ``kvscale calibrate``."""
    tmp = tmp_path_factory.mktemp("trainer-cli")
    samples = tmp / "texts.jsonl"
    samples.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for scheme in cal.SCHEMES:
        args = ["calibrate", str(ckpt), "--out", str(tmp / scheme), "--samples", str(samples)]
        args += ["--num-samples", "0", "--max-len", str(MAX_LEN), "--scheme", scheme]
        assert cli_main(args) == 0
        record = json.loads((tmp / scheme / cal.CALIBRATION_RECORD).read_text())
        assert record["num_samples"] == len(TEXTS)
        out[scheme] = {
            f"{m}.{kind}_scale": t
            for m, (k, v) in cal.read_scales(tmp / scheme).items()
            for kind, t in (("k", k), ("v", v))
        }
    return out


@pytest.fixture(scope="module")
def trainer(ckpt):
    """The trainer's model (with a loud pad token), tokenizer and pad id."""
    model, tok = load_trainer_model(ckpt)
    pad_id = pad_id_for(tok, TEXTS, MAX_LEN)
    loud_pad(model, pad_id)
    return model, tok, pad_id


def _names(scheme_scales: dict[str, torch.Tensor]) -> list[str]:
    return sorted(scheme_scales)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_gives_the_cli_scales(trainer, cli_scales, side):
    model, tok, pad_id = trainer
    batch = padded_batch(tok, TEXTS, side, pad_id, MAX_LEN)
    assert (batch["attention_mask"] == 0).any()  # padded
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    for scheme in cal.SCHEMES:
        got, want = rec.scales(scheme), cli_scales[scheme]
        assert _names(got) == _names(want) == sorted(f"{m}.{k}_scale" for m in LAYERS for k in "kv")
        for name, t in want.items():
            assert got[name].dtype == torch.float32 and got[name].shape == t.shape
            assert torch.equal(got[name], t), (scheme, name, got[name], t)
    assert want["model.layers.0.self_attn.k_scale"].shape == (2, 1, 1)  # attn_head
    # The same batch with the padding taken as real tokens: not the CLI's scales.
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False)
    got = rec.scales("tensor")
    assert not all(torch.equal(got[n], t) for n, t in cli_scales["tensor"].items())


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_and_backward_are_unchanged(ckpt, attn):
    model, tok = load_trainer_model(ckpt, attn)
    model.float().train()  # float32 as a trainer's master weights (and bf16 backward is slow here)
    batch = padded_batch(tok, TEXTS[:3], "left", pad_id_for(tok, TEXTS, MAX_LEN), MAX_LEN)

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        logits = model(**batch, use_cache=False).logits
        (logits.float().logsumexp(-1) * batch["attention_mask"]).sum().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    plain_logits, plain_grads = step()
    with cal.record_kv_scales(model) as rec:
        logits, grads = step()
    assert torch.equal(logits, plain_logits)
    assert grads.keys() == plain_grads.keys()
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    scales = rec.scales("attn_head")
    assert len(scales) == 2 * len(LAYERS) and all((t > 0).all() for t in scales.values())
    # The drift monitor (issue #54) changes nothing either, with elements clipping.
    with cal.record_kv_scales(model, in_force={n: t * 0.5 for n, t in scales.items()}) as mon:
        logits, grads = step()
    assert mon.drift().refresh
    assert torch.equal(logits, plain_logits)
    assert all(torch.equal(grads[n], plain_grads[n]) for n in grads)
    # Recording stopped with the context: transformers' own dispatch is back.
    from transformers.modeling_utils import AttentionInterface

    assert AttentionInterface.get_interface.__module__.startswith("transformers")


def test_nothing_recorded_is_an_error(trainer, ckpt):
    model, tok, pad_id = trainer
    with pytest.raises(cal.CalibrationError, match="not a transformers model"):
        cal.record_kv_scales(torch.nn.Linear(2, 2))
    other, _ = load_trainer_model(ckpt)
    batch = padded_batch(tok, TEXTS[:2], "right", pad_id, MAX_LEN)
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        other(**batch, use_cache=False)  # not the recorded model
    with pytest.raises(cal.CalibrationError, match="no attention layer reported"):
        rec.scales()
    with cal.record_kv_scales(model) as rec, torch.no_grad():
        model(**{**batch, "attention_mask": torch.zeros_like(batch["attention_mask"])})
    with pytest.raises(cal.CalibrationError, match="every position was padding"):
        rec.scales()
    with pytest.raises(cal.CalibrationError, match="unknown scheme"):
        rec.scales("channel")


@pytest.mark.slow  # two fresh processes (torch.distributed, FSDP2 on gloo)
def test_fsdp2_ranks_reduce_to_one_process_over_both_batches(trainer, ckpt, tmp_path):
    model, tok, pad_id = trainer
    halves = [TEXTS[:3], TEXTS[3:]]
    (tmp_path / "spec.json").write_text(
        json.dumps({"texts": halves, "pad_id": pad_id, "max_len": MAX_LEN})
    )
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests" / "support")]),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    argv = [sys.executable, "-m", "kvscale_testing.trainer_forward"]
    argv += [str(ckpt), str(tmp_path / "spec.json"), str(tmp_path)]
    procs = [
        subprocess.Popen(
            argv,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]

    # One process, no group: both ranks' batches, one forward each.
    with cal.record_kv_scales(model) as both, torch.no_grad():
        for half in halves:
            model(**padded_batch(tok, half, "left", pad_id, MAX_LEN), use_cache=False)
    with cal.record_kv_scales(model) as first, torch.no_grad():
        model(**padded_batch(tok, halves[0], "left", pad_id, MAX_LEN), use_cache=False)
    for scheme in cal.SCHEMES:
        want = both.scales(scheme)
        for got in ranks:
            assert got[scheme].keys() == want.keys()
            assert all(torch.equal(got[scheme][n], want[n]) for n in want), scheme
    # The drift monitor (issue #54): counts summed over the ranks = one process's counts
    # over both batches, against the same scales in force.
    tight = {n: t * 0.4 for n, t in both.scales("tensor").items()}
    with cal.record_kv_scales(model, in_force=tight) as single, torch.no_grad():
        for half in halves:
            model(**padded_batch(tok, half, "left", pad_id, MAX_LEN), use_cache=False)
    want = single.drift()
    assert want.refresh
    for got in ranks:
        assert got["drift"].verdict == want.verdict
        assert got["drift"].layers == want.layers
    # The reduction mattered: rank 0's batch alone gives other scales.
    alone = first.scales("attn_head")
    assert not all(torch.equal(alone[n], t) for n, t in ranks[0]["attn_head"].items())


def test_eager_attention_padded_batch_equals_its_texts_one_by_one(ckpt):
    """eager hands attention an additive float mask (sdpa a bool one): padding is left out
    there too (the pad token is loud, so counting it would show)."""
    model, tok = load_trainer_model(ckpt, "eager")
    pad_id = pad_id_for(tok, TEXTS, MAX_LEN)
    loud_pad(model, pad_id)
    with cal.record_kv_scales(model) as batched, torch.no_grad():
        out = model(**padded_batch(tok, TEXTS, "left", pad_id, MAX_LEN), use_cache=False)
    assert out.logits.isfinite().all()
    with cal.record_kv_scales(model) as single, torch.no_grad():
        for text in TEXTS:
            model(**padded_batch(tok, [text], "left", pad_id, MAX_LEN), use_cache=False)
    for scheme in cal.SCHEMES:
        got, want = batched.scales(scheme), single.scales(scheme)
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want), scheme


def test_wrapper_components_are_left_out_of_the_names():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    from kvscale_plugin.calibration.observer import module_names

    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    model.model.layers[0].self_attn = torch.nn.Linear(2, 2)
    attn = model.model.layers[0].self_attn
    model.model.layers[0] = checkpoint_wrapper(model.model.layers[0])
    wrapped = {m: n for n, m in model.named_modules()}[attn]
    assert wrapped == "model.layers.0._checkpoint_wrapped_module.self_attn"
    assert module_names(model)[id(attn)] == "model.layers.0.self_attn"
