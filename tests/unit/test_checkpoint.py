"""Lazy checkpoint reading: headers only, scale bytes by seek, clear errors naming the file."""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path

import pytest
import torch
from kvscale_testing.checkpoints import read_stored_scales
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from kvscale_plugin.checkpoint import (
    DTYPE_BITS,
    CheckpointError,
    open_checkpoint,
    read_safetensors_header,
)

SCALES = {0: (0.125, 0.25), 1: (0.5, 0.75)}


def _write_raw(path: Path, header: dict, data: bytes = b"") -> Path:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_header_lists_every_tensor_like_safetensors(tiny):
    ckpt_dir = tiny("ckpt_single", scales=SCALES)
    ckpt = open_checkpoint(ckpt_dir)
    with safe_open(str(ckpt_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in names:
            info = ckpt.tensors[name]
            sl = f.get_slice(name)
            assert list(info.shape) == sl.get_shape()
            assert info.dtype == sl.get_dtype()
    assert set(ckpt.tensors) == names
    assert not ckpt.sharded and ckpt.files == [ckpt_dir / "model.safetensors"]
    assert ckpt.config["num_hidden_layers"] == 2


def test_scale_bytes_are_read_by_seek_only(tiny):
    ckpt_dir = tiny("ckpt_single", scales=SCALES)
    ckpt = open_checkpoint(ckpt_dir)
    header_bytes = ckpt.bytes_read
    info = ckpt.tensors["model.layers.1.self_attn.v_scale"]
    value = ckpt.read_tensor(info)
    assert value.dtype == torch.float32 and value.shape == (1,)
    assert float(value) == read_stored_scales(ckpt_dir)[1]["v"] == 0.75
    assert ckpt.bytes_read == header_bytes + 4
    # Headers are a tiny fraction of the file: the weights were never touched.
    assert ckpt.bytes_read < (ckpt_dir / "model.safetensors").stat().st_size / 100


def test_sharded_checkpoint_reads_every_shard_header(tiny):
    ckpt_dir = tiny("ckpt_sharded", scales=SCALES, num_shards=3)
    ckpt = open_checkpoint(ckpt_dir)
    index = json.loads((ckpt_dir / "model.safetensors.index.json").read_text())
    assert ckpt.sharded and len(ckpt.files) == 3
    assert set(ckpt.tensors) == set(index["weight_map"])
    for name, fname in index["weight_map"].items():
        assert ckpt.tensors[name].file.name == fname
    assert float(ckpt.read_tensor(ckpt.tensors["model.layers.0.self_attn.k_scale"])) == 0.125


def test_huge_sparse_weight_is_never_read(tmp_path):
    # An 8 GiB weight in a sparse file: reading it would take seconds and 8 GiB of I/O.
    big = 8 << 30
    scale = struct.pack("<f", 0.5)
    header = {
        "model.layers.0.self_attn.k_scale": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "model.layers.0.mlp.weight": {
            "dtype": "BF16",
            "shape": [big // 2],
            "data_offsets": [4, 4 + big],
        },
    }
    path = _write_raw(tmp_path / "model.safetensors", header, scale)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size + big)
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    info = ckpt.tensors["model.layers.0.self_attn.k_scale"]
    assert float(ckpt.read_tensor(info)) == 0.5
    assert ckpt.bytes_read < 1024


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int32, torch.float64])
def test_small_tensors_decode_in_their_dtype(tmp_path, dtype):
    t = torch.tensor([3.0]).to(dtype)
    save_file({"x.k_scale": t}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    got = ckpt.read_tensor(ckpt.tensors["x.k_scale"])
    assert got.dtype == dtype and float(got) == 3.0


@pytest.mark.parametrize(
    "dtype", [torch.uint16, torch.uint32, torch.uint64, torch.float8_e8m0fnu, torch.bool]
)
def test_every_torch_dtype_decodes_through_safetensors(tmp_path, dtype):
    # The hand-written decoder this replaced could not read U16 / U32 / U64 / F8_E8M0.
    t = torch.tensor([4.0, 2.0]).to(dtype)
    save_file({"x.k_scale": t}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    got = ckpt.read_tensor(ckpt.tensors["x.k_scale"])
    assert got.dtype == dtype and torch.equal(got.double(), t.double())


#: Every whole-byte safetensors dtype torch holds (complex aside): the checkpoint's own table.
DTYPES = [d for d, bits in DTYPE_BITS.items() if bits % 8 == 0 and d != "C64"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_read_values_decodes_like_torch(tmp_path, dtype):
    """``read_values`` (no torch) holds what the library's torch tensor holds, as doubles:
    every byte value of the 8-bit types, 4096 random elements of the wider ones."""
    size = DTYPE_BITS[dtype] // 8
    raw = bytes(range(256)) if size == 1 else torch.randint(0, 256, (4096 * size,)).byte()
    raw = bytes(raw) if dtype != "BOOL" else bytes([0, 1] * 128)
    header = {
        "x.k_scale": {"dtype": dtype, "shape": [len(raw) // size], "data_offsets": [0, len(raw)]}
    }
    _write_raw(tmp_path / "model.safetensors", header, raw)
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)
    info = ckpt.tensors["x.k_scale"]
    expected = ckpt.read_tensor(info).double()
    got = torch.tensor(ckpt.read_values(info), dtype=torch.float64)
    assert torch.equal(got.isnan(), expected.isnan())
    same = got[~got.isnan()], expected[~expected.isnan()]
    assert torch.equal(*same) and torch.equal(same[0].signbit(), same[1].signbit())


def test_a_dtype_torch_cannot_hold_is_a_checkpoint_error(tmp_path):
    header = {"x.k_scale": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]}}
    _write_raw(tmp_path / "model.safetensors", header, b"\0" * 3)
    (tmp_path / "config.json").write_text("{}")
    ckpt = open_checkpoint(tmp_path)  # a valid file: the engines accept it
    with pytest.raises(CheckpointError, match=r"tensor 'x.k_scale' \(dtype F6_E2M3\) cannot be"):
        ckpt.read_tensor(ckpt.tensors["x.k_scale"])
    with pytest.raises(CheckpointError, match=r"tensor 'x.k_scale' \(dtype F6_E2M3\) cannot be"):
        ckpt.read_values(ckpt.tensors["x.k_scale"])


# ------------------------------------------------------------------ unusable input


def _good_dir(tmp_path: Path) -> Path:
    save_file({"a.k_scale": torch.tensor([1.0])}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_not_a_directory(tmp_path):
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(f)
    with pytest.raises(CheckpointError, match="no such directory"):
        open_checkpoint(tmp_path / "absent")


def test_missing_and_invalid_config(tmp_path):
    d = _good_dir(tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json: not found"):
        open_checkpoint(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        open_checkpoint(d)
    (d / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="JSON object"):
        open_checkpoint(d)


@pytest.mark.parametrize(
    ("damage", "match"),
    [
        (lambda raw: raw[:5], "8-byte header length is missing"),
        (lambda raw: raw[:20], "truncated or corrupt safetensors header"),
        (lambda raw: struct.pack("<Q", 1 << 40) + raw[8:], "truncated or corrupt"),
        (lambda raw: raw[:8] + b"\xff" * (len(raw) - 8), "not valid JSON"),
        (lambda raw: raw[:-2], "file truncated"),
    ],
    ids=["no-length", "short-header", "huge-length", "garbage-header", "short-data"],
)
def test_truncated_or_corrupt_header_names_the_file(tmp_path, damage, match):
    d = _good_dir(tmp_path)
    path = d / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointError, match=match) as err:
        open_checkpoint(d)
    assert str(path) in str(err.value)


F32 = {"dtype": "F32", "shape": [1]}


@pytest.mark.parametrize(
    ("offsets", "data", "match"),
    [
        ([[0, 4], [0, 4]], 4, r"file: tensor 'b' overlaps the tensor before it \(its data starts"),
        ([[0, 4], [8, 12]], 12, r"tensor 'b' leaves a gap after the tensor before it \(its data"),
        ([[0, 4], [4, 8]], 12, r"4 byte\(s\) after the last tensor that no tensor claims"),
        ([[0, 4], [4, 8]], 6, r"end at byte 8 of the data section, which has only 6 bytes"),
    ],
    ids=["overlapping", "gap", "trailing-bytes", "short-data"],
)
def test_what_safetensors_refuses_is_refused_naming_the_file(tmp_path, offsets, data, match):
    header = {name: {**F32, "data_offsets": o} for name, o in zip("ab", offsets, strict=True)}
    path = _write_raw(tmp_path / "model.safetensors", header, b"\0" * data)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(SafetensorError):
        safe_open(str(path), "pt")  # what an engine's loader does with this file
    with pytest.raises(CheckpointError, match=match) as err:
        open_checkpoint(tmp_path)
    assert str(err.value).startswith(f"{path}: corrupt safetensors file")
    assert "(safetensors: " in str(err.value) and "Re-download or re-export" in str(err.value)


def test_header_entry_with_wrong_size_is_corrupt(tmp_path):
    header = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}
    path = _write_raw(tmp_path / "x.safetensors", header, b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"tensor 't'.*expected 8"):
        read_safetensors_header(path)


def test_sharded_index_problems(tiny, tmp_path):
    src = tiny("ckpt_sharded", scales=SCALES, num_shards=3)
    d = _copy(src, tmp_path / "m")
    shard = d / "model-00002-of-00003.safetensors"
    shard.rename(tmp_path / "away.safetensors")
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors") as err:
        open_checkpoint(d)
    assert "index.json" in str(err.value)
    (tmp_path / "away.safetensors").rename(shard)

    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(n for n, f in index["weight_map"].items() if f.startswith("model-00001"))
    index["weight_map"][name] = "model-00003-of-00003.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"'{name}'.*does not contain it"):
        open_checkpoint(d)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        open_checkpoint(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"only PyTorch \.bin"):
        open_checkpoint(tmp_path)
