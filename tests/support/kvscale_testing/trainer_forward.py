"""A trainer's side of ``record_kv_scales`` for the tests: the model as a trainer loads it
(stock transformers, no kvscale loader), padded batches as a trainer builds them, and
data-parallel ranks (``python -m kvscale_testing.trainer_forward CKPT TEXTS_JSON OUT_DIR``
with torch.distributed's RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set: each rank
FSDP2-shards the model, records its own texts' padded batch max-reduced over the world
and saves ``rank<N>.pt``: scheme -> scale tensors, and ``drift``: the drift monitor's
report against scales 0.4x those, counts summed over the world).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def load_trainer_model(ckpt: str | Path, attn: str = "sdpa") -> tuple[Any, Any]:
    """(model, tokenizer) in the stored dtype (bf16) with ``attn``, as a trainer loads
    them: without the checkpoint's KV-only compressed-tensors config (which would attach
    compressed-tensors' own KV quantization)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(str(ckpt))
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_pretrained(
        str(ckpt), config=config, dtype=torch.bfloat16, attn_implementation=attn
    )
    return model, AutoTokenizer.from_pretrained(str(ckpt))


def pad_id_for(tok: Any, texts: Sequence[str], max_len: int) -> int:
    """A token id that none of ``texts`` uses."""
    used = {i for t in texts for i in tok(t, truncation=True, max_length=max_len)["input_ids"]}
    return next(i for i in range(len(tok)) if i not in used)


def loud_pad(model: Any, pad_id: int) -> None:
    """Give the pad token the embedding whose layer-0 key is largest: the signs of one
    k_proj row (times the input norm's weight), so that padding counted as real tokens
    raises layer 0's K maximum well above the real tokens'."""
    layer = model.model.layers[0]
    row = layer.self_attn.k_proj.weight[0] * layer.input_layernorm.weight
    with torch.no_grad():
        model.get_input_embeddings().weight[pad_id] = row.sign()


def padded_batch(
    tok: Any, texts: Sequence[str], side: str, pad_id: int, max_len: int
) -> dict[str, torch.Tensor]:
    """``input_ids``, ``attention_mask`` (0 at padding) and ``position_ids`` (counted over
    the real tokens, as trainers pass them), padded on ``side`` to the longest text."""
    rows = [tok(t, truncation=True, max_length=max_len)["input_ids"] for t in texts]
    width = max(len(r) for r in rows)
    ids, mask = [], []
    for r in rows:
        pad = [pad_id] * (width - len(r))
        real = [1] * len(r)
        ids.append(pad + r if side == "left" else r + pad)
        mask.append([0] * len(pad) + real if side == "left" else real + [0] * len(pad))
    attention_mask = torch.tensor(mask)
    return {
        "input_ids": torch.tensor(ids),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }


def _rank_main(ckpt: str, texts_json: str, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from kvscale_plugin.calibration import SCHEMES, record_kv_scales

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    spec = json.loads(Path(texts_json).read_text())
    model, tok = load_trainer_model(ckpt)
    loud_pad(model, spec["pad_id"])
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model.model.layers[0].self_attn.q_proj.weight).__name__ == "DTensor"
    batch = padded_batch(tok, spec["texts"][rank], "left", spec["pad_id"], spec["max_len"])
    with record_kv_scales(model, group=dist.group.WORLD) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    out: dict[str, Any] = {s: rec.scales(s) for s in SCHEMES}
    # The drift monitor against scales 0.4x the group's: clipped counts summed over ranks.
    tight = {n: t * 0.4 for n, t in out["tensor"].items()}
    with record_kv_scales(model, group=dist.group.WORLD, in_force=tight) as rec, torch.no_grad():
        model(**batch, use_cache=False)
    out["drift"] = rec.drift()
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(*sys.argv[1:4])
