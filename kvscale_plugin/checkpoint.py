"""Lazy reading of a Hugging Face checkpoint directory (imports no host engine).

What ``kvscale inspect`` needs, and nothing more:

* ``config.json`` (parsed JSON);
* the tensor list of every ``*.safetensors`` file, from the file *headers* only
  (8-byte little-endian header length, then a JSON header; the weight bytes are
  never read);
* the bytes of a few small tensors (the KV scales), read by seeking to their
  ``data_offsets``.

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are supported. Anything that makes the directory unreadable (no
``config.json``, invalid JSON, a truncated or corrupt header, a shard listed in
the index but absent) raises ``CheckpointError`` with a message naming the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# The safetensors format caps the header at 100 MB; a larger length field means
# the file is not safetensors (or its first bytes are damaged).
MAX_HEADER_BYTES = 100_000_000

#: Bytes per element of each safetensors dtype whose size is a whole number of bytes.
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1,
}  # fmt: skip

#: Tensors larger than this are never decoded: KV scales are scalars (or a few per head).
MAX_DECODE_ELEMENTS = 4096


class CheckpointError(Exception):
    """The checkpoint directory cannot be read (the message names the file and what to do)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as described by its file's safetensors header."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]
    #: Absolute byte offsets of the tensor's data in ``file`` (header included).
    start: int
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass
class Checkpoint:
    """A checkpoint directory, described from ``config.json`` and safetensors headers."""

    model_dir: Path
    config: dict[str, Any]
    files: list[Path]
    tensors: dict[str, TensorInfo]
    sharded: bool
    #: Bytes read from safetensors files so far (headers and decoded tensors).
    bytes_read: int = 0
    #: Per file: number of tensors in its header.
    tensors_per_file: dict[Path, int] = field(default_factory=dict)

    def read_bytes(self, info: TensorInfo) -> bytes:
        """The raw bytes of one tensor (a seek and one read; nothing else is touched)."""
        try:
            with open(info.file, "rb") as f:
                f.seek(info.start)
                data = f.read(info.nbytes)
        except OSError as exc:
            raise CheckpointError(
                f"{info.file}: cannot read tensor '{info.name}': {exc}"
            ) from exc
        if len(data) != info.nbytes:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' is truncated (expected {info.nbytes} "
                f"bytes at offset {info.start}, got {len(data)}); re-download or re-export "
                "the checkpoint."
            )
        self.bytes_read += len(data)
        return data

    def read_tensor(self, info: TensorInfo) -> Any:
        """A small tensor as a CPU ``torch.Tensor`` (its bytes only).

        Raises ``CheckpointError`` for dtypes torch cannot decode or tensors larger
        than ``MAX_DECODE_ELEMENTS`` (a KV scale never is).
        """
        import torch

        dtypes = {
            "F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
            "BF16": torch.bfloat16, "F8_E4M3": torch.float8_e4m3fn,
            "F8_E5M2": torch.float8_e5m2, "I64": torch.int64, "I32": torch.int32,
            "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
        }  # fmt: skip
        if info.dtype not in dtypes:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' has dtype {info.dtype}, which cannot be "
                "decoded here."
            )
        if info.numel > MAX_DECODE_ELEMENTS:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' has {info.numel} elements; only small "
                f"tensors (<= {MAX_DECODE_ELEMENTS}) are decoded."
            )
        data = self.read_bytes(info)
        if not data:
            return torch.empty(info.shape, dtype=dtypes[info.dtype])
        # safetensors data is little-endian, like every platform torch runs on here.
        flat = torch.frombuffer(bytearray(data), dtype=dtypes[info.dtype])
        return flat.reshape(info.shape)


def read_config(model_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """``config.json`` of ``model_dir`` as a dict."""
    path = Path(model_dir) / CONFIG_NAME
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found; a Hugging Face checkpoint directory needs a config.json."
        )
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc}); fix or re-export it.") from exc
    if not isinstance(config, dict):
        raise CheckpointError(
            f"{path}: must hold a JSON object, got {type(config).__name__}."
        )
    return config


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], int]:
    """Tensors described by the header of one safetensors file, and the bytes read.

    Reads ``8 + header length`` bytes; validates that every tensor's data lies
    inside the file and matches its dtype and shape.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes; the 8-byte header "
                    "length is missing). Re-download or re-export the checkpoint."
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors header (header length field "
                    f"says {n} bytes, file has {size}). Re-download or re-export the "
                    "checkpoint."
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    if len(raw) != n:
        raise CheckpointError(f"{path}: truncated safetensors header ({len(raw)} of {n} bytes).")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: corrupt safetensors header (not valid JSON: {exc}). Re-download or "
            "re-export the checkpoint."
        ) from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object).")

    data_start = 8 + n
    data_len = size - data_start
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        tensors[name] = _tensor_info(path, name, entry, data_start, data_len)
    return tensors, 8 + n


def _tensor_info(path: Path, name: str, entry: Any, data_start: int, data_len: int) -> TensorInfo:
    def bad(why: str) -> CheckpointError:
        return CheckpointError(
            f"{path}: corrupt safetensors header entry for tensor '{name}': {why}. "
            "Re-download or re-export the checkpoint."
        )

    if not isinstance(entry, Mapping):
        raise bad("not a JSON object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str):
        raise bad(f"dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise bad(f"shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise bad(f"data_offsets {offsets!r}")
    begin, end = offsets
    if end > data_len:
        raise bad(
            f"data ends at byte {end} of the data section, which has only {data_len} bytes "
            "(file truncated)"
        )
    numel = math.prod(shape)
    itemsize = DTYPE_SIZES.get(dtype)
    # Sub-byte and newer dtypes (F4, F6_*) are listed but not size-checked.
    if itemsize is not None and end - begin != numel * itemsize:
        raise bad(
            f"{end - begin} data bytes for shape {tuple(shape)} of {dtype} "
            f"(expected {numel * itemsize})"
        )
    return TensorInfo(
        name=name,
        file=path,
        dtype=dtype,
        shape=tuple(shape),
        start=data_start + begin,
        end=data_start + end,
    )


def checkpoint_files(model_dir: str | os.PathLike[str]) -> tuple[list[Path], bool]:
    """The safetensors files of ``model_dir`` and whether the checkpoint is sharded.

    With ``model.safetensors.index.json`` the files are those its ``weight_map``
    names (each must exist); else ``model.safetensors``; else every
    ``*.safetensors`` file in the directory (what the engines load).
    """
    root = Path(model_dir)
    index = root / INDEX_NAME
    if index.is_file():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{index}: not valid JSON ({exc}); fix or re-export it.") from exc
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) for v in weight_map.values()
        ):
            raise CheckpointError(
                f"{index}: has no 'weight_map' object mapping tensor names to shard files."
            )
        files = [root / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"{index}: lists shard file(s) that are not in {root}: {', '.join(missing)}. "
                "Download the missing shards."
            )
        return files, True
    single = root / SINGLE_FILE
    if single.is_file():
        return [single], False
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files, len(files) > 1
    has_bin = any(root.glob("*.bin"))
    raise CheckpointError(
        f"{root}: no safetensors weights (no {SINGLE_FILE}, no {INDEX_NAME}, no *.safetensors)"
        + ("; only PyTorch .bin files, which inspect does not read." if has_bin else ".")
    )


def open_checkpoint(model_dir: str | os.PathLike[str]) -> Checkpoint:
    """Read ``config.json`` and every safetensors header of ``model_dir`` (no weight bytes)."""
    root = Path(model_dir)
    if not root.exists():
        raise CheckpointError(f"{root}: no such directory.")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; pass a checkpoint directory.")
    config = read_config(root)
    files, sharded = checkpoint_files(root)
    tensors: dict[str, TensorInfo] = {}
    per_file: dict[Path, int] = {}
    bytes_read = 0
    for path in files:
        found, nread = read_safetensors_header(path)
        bytes_read += nread
        per_file[path] = len(found)
        for name, info in found.items():
            if name in tensors:
                raise CheckpointError(
                    f"{path}: tensor '{name}' is also stored in {tensors[name].file.name}; "
                    "a checkpoint must store each tensor once."
                )
            tensors[name] = info
    if sharded and (root / INDEX_NAME).is_file():
        weight_map = json.loads((root / INDEX_NAME).read_text(encoding="utf-8"))["weight_map"]
        for name, fname in weight_map.items():
            info = tensors.get(name)
            if info is None or info.file.name != fname:
                raise CheckpointError(
                    f"{root / INDEX_NAME}: maps tensor '{name}' to {fname}, but that file's "
                    "header does not contain it. Re-download the checkpoint (index and "
                    "shards disagree)."
                )
    return Checkpoint(
        model_dir=root,
        config=config,
        files=files,
        tensors=tensors,
        sharded=sharded,
        bytes_read=bytes_read,
        tensors_per_file=per_file,
    )
