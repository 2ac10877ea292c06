"""kvscale serves every checkpoint scale stock vLLM serves, on every family in the sweep
(run by test_vllm_families_1.py and test_vllm_families_2.py, half the families each).

For each decoder family (tests/support/kvscale_testing/families.py: dense, sliding-window,
MoE, hybrid Mamba / linear attention, fused-qkv, NoPE) a tiny checkpoint built with
transformers' own classes stores one distinct k/v scale per attention layer under the HF
attention module's path. A ``-q kvscale`` engine and a stock engine, both on an FP8 cache,
are started on it; what each attention layer serves is read back from the engine (device
tensor and float). kvscale must serve every layer's own checkpoint scale -- so a family
where stock serves 1.0 (or cannot start) and kvscale does too fails -- and never less
than stock. ``kvscale inspect`` must name, for each scale tensor, the layer the engine
serves it on.

On a CPU without AVX-512 / AMX vLLM refuses the FP8 cache only after the model and its
scales loaded (docs/running-engines-on-cpu.md): what the layers hold is read then.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvscale_testing.checkpoints import checkpoint_scale_tensors
from kvscale_testing.families import (
    Family,
    build_family_checkpoint,
    layer_number,
    layer_rows,
    stored_scales,
)
from kvscale_testing.probe import FP8_CPU_REFUSAL, LayerScales, layer_scales, vllm_engine

#: The fingerprint each kvscale engine of the sweep reported (family -> its answer), and
#: after a scales-only update of every scale through ``model.load_weights`` (an RL sync).
FINGERPRINTS: dict[str, dict] = {}
UPDATED: dict[str, dict] = {}
#: The update: every checkpoint scale tensor, under its own name, times this.
UPDATE_FACTOR = 2.0


def _sync_and_fingerprint(llm, ckpt: Path) -> dict:
    """A trainer's scales-only sync of every scale (times ``UPDATE_FACTOR``), then the
    engine's fingerprint; a failure is the answer's ``error``."""
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint

    sent = [(n, t * UPDATE_FACTOR) for n, t in checkpoint_scale_tensors(ckpt).items()]
    try:
        llm.collective_rpc(lambda worker: worker.model_runner.get_model().load_weights(sent))
        [answer] = llm.collective_rpc(worker_fingerprint)
        return answer
    except Exception as exc:  # noqa: BLE001 - reported by the check, naming the family
        return {"error": f"{type(exc).__name__}: {exc}"}


def served(ckpt: Path, quantization: str | None) -> dict[str, LayerScales] | str:
    """layer name -> what an engine on ``ckpt`` serves there; or, when the engine does not
    start for another reason than this CPU's FP8 refusal, the error. A kvscale engine that
    started also reports its fingerprint (``FINGERPRINTS``)."""
    from kvscale_plugin.hosts.vllm.live import worker_fingerprint

    try:
        with vllm_engine(ckpt, quantization=quantization, kv_cache_dtype="fp8") as llm:
            scales = layer_scales(llm)
            if quantization:
                [FINGERPRINTS[ckpt.name]] = llm.collective_rpc(worker_fingerprint)
                UPDATED[ckpt.name] = _sync_and_fingerprint(llm, ckpt)
    except Exception as exc:  # noqa: BLE001 - what stock does on the checkpoint is the datum
        scales = getattr(exc, "kvscale_loaded_scales", None)
        if scales is None or FP8_CPU_REFUSAL not in str(exc):
            return f"{type(exc).__name__}: {exc}"
    return scales


def _pairs(scales: dict[str, LayerScales]) -> dict[str, tuple[float, ...]]:
    return {name: (s.k, s.v, s.k_float, s.v_float) for name, s in scales.items()}


def check_family(family: Family, root: Path) -> None:
    ckpt = build_family_checkpoint(root / family.name, family)
    stored = stored_scales(ckpt)
    engine = served(ckpt, "kvscale")
    assert isinstance(engine, dict), f"{family.name}: the kvscale engine failed: {engine}"
    assert engine, f"{family.name}: no attention layer read back"
    ours = _pairs(engine)
    by_index = {layer_number(name): value for name, value in ours.items()}
    assert set(by_index) == set(stored), (family.name, sorted(ours), stored)
    for index, want in stored.items():
        pair = (want["k"], want["v"])
        assert by_index[index] == pytest.approx(pair * 2, rel=1e-6), (
            f"{family.name}: layer {index} ({want['module']}) serves {by_index[index]}, "
            f"the checkpoint holds {pair}"
        )
    _check_inspect(family, ckpt, stored, engine)
    _check_fingerprint(family, ckpt)
    stock = served(ckpt, None)
    if isinstance(stock, dict):
        stock = _pairs(stock)  # stock started: kvscale serves at least what it serves
        for name, value in stock.items():
            if value != (1.0,) * 4:
                assert ours.get(name) == pytest.approx(value, rel=1e-6), (family.name, name)


def _check_fingerprint(family: Family, ckpt: Path) -> None:
    """Where the engine started (an FP8 CPU): its fingerprint covers every attention layer
    the checkpoint has scales for and equals the trainer side's over the checkpoint's own
    tensors (``scale_fingerprint``), never over no layer; and so after a scales-only sync
    of every scale through ``model.load_weights``."""
    from kvscale_plugin.fingerprint import scale_fingerprint

    fp = FINGERPRINTS.pop(ckpt.name, None)
    after = UPDATED.pop(ckpt.name, None)
    if fp is None:
        return  # the FP8 cache was refused here after loading: no engine to ask
    tensors = checkpoint_scale_tensors(ckpt)
    assert fp["fingerprint"] is not None and fp["layers"], (family.name, fp)
    assert fp["consistent"], (family.name, fp)
    want = scale_fingerprint(tensors, layers=fp["layers"], applied=fp["applied"])
    assert fp["fingerprint"] == want, (family.name, fp, sorted(tensors))
    # every layer the checkpoint has scales for is covered (the engine's own numbering)
    assert set(stored_scales(ckpt)) <= set(fp["layers"]), (family.name, fp["layers"])
    # The sync: taken on every layer, and the trainer side of what was sent agrees.
    assert after is not None and "error" not in after, (family.name, after)
    sent = {n: t * UPDATE_FACTOR for n, t in tensors.items()}
    want = scale_fingerprint(sent, layers=after["layers"], applied=after["applied"])
    assert after["fingerprint"] == want and after["consistent"], (family.name, after)
    assert after["layers"] == fp["layers"], (family.name, after["layers"], fp["layers"])
    assert after["updates"] == fp["updates"] + 1, (family.name, fp, after)
    if fp["applied"]:
        assert after["fingerprint"] != fp["fingerprint"], (family.name, after)


def _check_inspect(
    family: Family, ckpt: Path, stored: dict[int, dict], engine: dict[str, LayerScales]
) -> None:
    """inspect's table holds what this engine shows, and inspect names, for every scale
    tensor, the layer the engine serves its value on."""
    import vllm

    from kvscale_plugin.inspection.report import inspect_checkpoint
    from kvscale_plugin.inspection.vllm_layers import table

    release = vllm.__version__.split("+")[0]
    arch = json.loads((ckpt / "config.json").read_text())["architectures"][0]
    assert table().get(release, {}).get(arch) == layer_rows(stored, engine), (
        f"{family.name}: kvscale_plugin/data/vllm_layers.json disagrees with the engine "
        "(regenerate it: scripts/gen_vllm_layer_table.py)"
    )
    serving = {}
    for name, layer in engine.items():
        serving[layer.k] = serving[layer.v] = name
    report = inspect_checkpoint(ckpt, host="vllm")
    seen = 0
    for tensor in report.tensors:
        if tensor.kind in ("k", "v"):
            assert tensor.engine_layer == serving[tensor.value], (family.name, tensor)
            assert not tensor.problems, (family.name, tensor)
            seen += 1
    assert seen == 2 * len(stored), family.name
