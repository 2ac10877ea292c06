"""Lazy reading of a Hugging Face checkpoint directory (imports no host engine).

What ``kvscale inspect`` needs, and nothing more:

* ``config.json`` (parsed JSON);
* the tensor list of every ``*.safetensors`` file, from the file *headers* only
  (8-byte little-endian header length, then a JSON header; the weight bytes are
  never read);
* the values of a few small tensors (the KV scales), each read on its own.

Every safetensors file is validated by the ``safetensors`` library
(``safe_open``), so a file is accepted exactly when the engines' loaders accept
it: besides truncation and a corrupt header, overlapping tensors, gaps in the
data section and trailing bytes are refused too. ``safe_open`` runs with
``framework="numpy"`` (no torch) and ``backend="pread"`` after the header was read here
with one plain ``read``: the library then reads only the header (already in the page
cache); with the default ``mmap`` backend the kernel's read-around would load megabytes
of weights per file. A small tensor's elements are decoded here from its own bytes
(``read_values``: every real dtype of the format, F8 included, without torch);
``read_tensor`` has the library decode it as a torch tensor (calibration).

Single-file (``model.safetensors``) and sharded (``model.safetensors.index.json``)
checkpoints are supported. Anything that makes the directory unreadable (no
``config.json``, invalid JSON, a safetensors file the library refuses, a shard
listed in the index but absent, index and shards disagreeing) raises
``CheckpointError`` with a message naming the file and what to do.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

# The safetensors format caps the header at 100 MB (as the library does); a larger
# length field means the file is not safetensors (or its first bytes are damaged).
MAX_HEADER_BYTES = 100_000_000

#: Bits per element of each safetensors dtype (used to explain a refused file).
DTYPE_BITS: dict[str, int] = {
    **dict.fromkeys(("F64", "C64", "I64", "U64"), 64),
    **dict.fromkeys(("F32", "I32", "U32"), 32),
    **dict.fromkeys(("F16", "BF16", "I16", "U16"), 16),
    **dict.fromkeys(("F8_E4M3", "F8_E5M2", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"), 8),
    **dict.fromkeys(("I8", "U8", "BOOL"), 8),
    **dict.fromkeys(("F6_E2M3", "F6_E3M2"), 6),
    "F4": 4,
}

#: Tensors larger than this are never decoded: KV scales are scalars (or a few per head).
MAX_DECODE_ELEMENTS = 4096

_REREAD = "Re-download or re-export the checkpoint."


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


def _safe_open(path: Path, framework: str = "numpy") -> Any:
    """``safe_open`` reading with ``pread`` (safetensors >= 0.8; older: its default)."""
    try:
        return safe_open(str(path), framework=framework, backend="pread")
    except TypeError:  # pragma: no cover - safetensors < 0.8 has no backend argument
        return safe_open(str(path), framework=framework)


def _f8_table(exponent_bits: int, bias: int, kind: str) -> list[float]:
    """The value of each byte of an 8-bit float: ``fn`` (e4m3fn: no inf, S.1111.111 is
    NaN), ``ieee`` (e5m2: inf and NaN), ``fnuz`` (0x80 is the only NaN, no -0), ``e8m0``
    (unsigned powers of two, 0xFF is NaN)."""
    if kind == "e8m0":
        return [math.ldexp(1.0, b - bias) for b in range(255)] + [math.nan]
    mantissa_bits, top = 7 - exponent_bits, (1 << exponent_bits) - 1
    table = []
    for b in range(256):
        e, m = (b >> mantissa_bits) & top, b & ((1 << mantissa_bits) - 1)
        value = math.ldexp(m + (e > 0 and 1 << mantissa_bits), max(e, 1) - bias - mantissa_bits)
        if kind == "ieee" and e == top:
            value = math.inf if m == 0 else math.nan
        elif (kind == "fn" and e == top and m == (1 << mantissa_bits) - 1) or (
            kind == "fnuz" and b == 0x80
        ):
            value = math.nan
        table.append(-value if b >> 7 else value)
    return table


#: ``struct`` formats of the fixed-width dtypes (BF16 and the 8-bit floats: see ``_decode``).
_STRUCT = {"F64": "d", "F32": "f", "F16": "e", "I64": "q", "I32": "i", "I16": "h", "I8": "b"}
_STRUCT.update({"U64": "Q", "U32": "I", "U16": "H", "U8": "B", "BOOL": "?"})
_F8_KINDS = {
    "F8_E4M3": (4, 7, "fn"),
    "F8_E5M2": (5, 15, "ieee"),
    "F8_E4M3FNUZ": (4, 8, "fnuz"),
    "F8_E5M2FNUZ": (5, 16, "fnuz"),
    "F8_E8M0": (8, 127, "e8m0"),
}
_F8_TABLES: dict[str, list[float]] = {}


def _decode(dtype: str, raw: bytes) -> tuple[float, ...]:
    """The elements of a little-endian safetensors tensor as Python floats (exact: what
    torch's ``.double()`` of the same tensor holds)."""
    if dtype in _F8_KINDS:
        table = _F8_TABLES.get(dtype) or _F8_TABLES.setdefault(dtype, _f8_table(*_F8_KINDS[dtype]))
        return tuple(table[b] for b in raw)
    if dtype == "BF16":  # the upper half of a float32
        raw = b"".join(b"\0\0" + raw[i : i + 2] for i in range(0, len(raw), 2))
        dtype = "F32"
    fmt = _STRUCT.get(dtype)
    if fmt is None:
        raise ValueError(f"dtype {dtype} is not decoded here")
    return tuple(float(x) for x in struct.unpack(f"<{len(raw) // struct.calcsize(fmt)}{fmt}", raw))


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
    #: Per file: the library's torch handle (``safe_open``), opened by ``read_tensor``.
    handles: dict[Path, Any] = field(default_factory=dict, repr=False)
    #: Called with each tensor before its bytes are read (a Hub mirror fetches them then).
    before_read: Callable[[TensorInfo], None] | None = field(default=None, repr=False)

    def close(self) -> None:
        """Release the files' handles (dropping the ``Checkpoint`` does it too)."""
        self.handles.clear()

    def __enter__(self) -> Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _small(self, info: TensorInfo) -> None:
        if info.numel > MAX_DECODE_ELEMENTS:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' has {info.numel} elements; only small "
                f"tensors (<= {MAX_DECODE_ELEMENTS}) are decoded."
            )
        if self.before_read is not None:
            self.before_read(info)

    def read_values(self, info: TensorInfo) -> tuple[float, ...]:
        """A small tensor's elements (row-major) as floats, decoded from its bytes only
        (no torch). Raises ``CheckpointError`` for tensors larger than
        ``MAX_DECODE_ELEMENTS``, dtypes without real elements (``F4``, ``F6_*``, ``C64``)
        and unreadable files."""
        self._small(info)
        try:
            with open(info.file, "rb") as f:
                f.seek(info.start)
                raw = f.read(info.nbytes)
            if len(raw) != info.nbytes:
                raise OSError(f"{len(raw)} of {info.nbytes} bytes")
            values = _decode(info.dtype, raw)
        except OSError as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor '{info.name}': {exc}") from exc
        except ValueError as exc:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' (dtype {info.dtype}) cannot be decoded "
                f"here: {exc}"
            ) from exc
        self.bytes_read += info.nbytes
        return values

    def read_tensor(self, info: TensorInfo) -> Any:
        """A small tensor as a CPU ``torch.Tensor``, decoded by ``safetensors`` (its bytes only).

        Raises ``CheckpointError`` for tensors larger than ``MAX_DECODE_ELEMENTS`` (a KV
        scale never is), dtypes torch cannot hold (``F6_*``) and unreadable files.
        """
        self._small(info)
        try:
            handle = self.handles.get(info.file)
            if handle is None:
                handle = self.handles[info.file] = _safe_open(info.file, "pt")
            tensor = handle.get_tensor(info.name)
        except OSError as exc:
            raise CheckpointError(f"{info.file}: cannot read tensor '{info.name}': {exc}") from exc
        except (SafetensorError, RuntimeError, TypeError) as exc:
            raise CheckpointError(
                f"{info.file}: tensor '{info.name}' (dtype {info.dtype}) cannot be decoded "
                f"here: {exc}"
            ) from exc
        self.bytes_read += info.nbytes
        return tensor


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
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(config).__name__}.")
    return config


def read_safetensors_header(path: str | os.PathLike[str]) -> tuple[dict[str, TensorInfo], int]:
    """Tensors described by the header of one safetensors file, and the bytes read.

    Reads ``8 + header length`` bytes, then has the ``safetensors`` library validate
    the file (``safe_open``: what the engines' loaders accept); weight bytes are not
    read. Raises ``CheckpointError`` naming the file for anything the library refuses.
    """
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    f"{path}: truncated safetensors file ({size} bytes; the 8-byte header "
                    f"length is missing). {_REREAD}"
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{path}: truncated or corrupt safetensors header (header length field "
                    f"says {n} bytes, file has {size}). {_REREAD}"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    if len(raw) != n:
        raise CheckpointError(
            f"{path}: truncated safetensors header ({len(raw)} of {n} bytes). {_REREAD}"
        )
    # The library decides what is valid (the header pages are in the page cache now).
    try:
        _safe_open(path)
    except SafetensorError as exc:
        raise CheckpointError(_refused(path, exc, raw, size - 8 - n)) from exc
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc}") from exc
    header = json.loads(raw.decode("utf-8"))
    data_start = 8 + n
    tensors = {
        name: TensorInfo(
            name=name,
            file=path,
            dtype=entry["dtype"],
            shape=tuple(entry["shape"]),
            start=data_start + entry["data_offsets"][0],
            end=data_start + entry["data_offsets"][1],
        )
        for name, entry in header.items()
        if name != "__metadata__"
    }
    return tensors, 8 + n


def _refused(path: Path, exc: SafetensorError, raw: bytes, data_len: int) -> str:
    """Why the library refused ``path``: its own words, made concrete from the header."""
    why = str(exc).removeprefix("Error while deserializing header: ")
    try:
        header = json.loads(raw.decode("utf-8"))
    except ValueError:
        return f"{path}: corrupt safetensors header (not valid JSON; safetensors: {why}). {_REREAD}"
    detail = "corrupt safetensors header" if "JSON" in why else "corrupt safetensors file"
    try:
        entries = [
            (name, e["dtype"], tuple(e["shape"]), *e["data_offsets"])
            for name, e in header.items()
            if name != "__metadata__"
        ]
        if "invalid shape" in why or "byte boundary" in why:
            for name, dtype, shape, begin, end in entries:
                expected = math.prod(shape) * DTYPE_BITS.get(dtype, 0) / 8
                if dtype in DTYPE_BITS and end - begin != expected:
                    detail = (
                        f"corrupt safetensors header entry for tensor '{name}': {end - begin} "
                        f"data bytes for shape {shape} of {dtype} (expected {expected:g})"
                    )
                    break
        elif "not fully covered" in why:
            last = max((end for *_, end in entries), default=0)
            detail += (
                f": the tensors end at byte {last} of the data section, which has only "
                f"{data_len} bytes (file truncated)"
                if last > data_len
                else f": {data_len - last} byte(s) after the last tensor that no tensor claims"
            )
        elif "invalid offset" in why:
            # The library names one tensor of an overlapping pair, in no fixed order: name
            # the first offending tensor in offset order instead (what the library checks).
            why = "invalid offset for tensor"
            prev = 0
            for begin, end, name in sorted((b, e, name) for name, _, _, b, e in entries):
                if begin != prev or end < begin:
                    what = (
                        "ends before it begins"
                        if end < begin
                        else "overlaps the tensor before it"
                        if begin < prev
                        else "leaves a gap after the tensor before it"
                    )
                    detail += (
                        f": tensor '{name}' {what} (its data starts at byte {begin} of the "
                        f"data section, the tensor before it ends at byte {prev})"
                    )
                    break
                prev = end
    except (TypeError, ValueError, KeyError, AttributeError):
        pass  # entries of the wrong type: the library's words say which
    return f"{path}: {detail} (safetensors: {why}). {_REREAD}"


def checkpoint_files(model_dir: str | os.PathLike[str]) -> tuple[list[Path], bool]:
    """The safetensors files of ``model_dir`` and whether the checkpoint is sharded.

    With ``model.safetensors.index.json`` the files are those its ``weight_map``
    names (each must exist); else ``model.safetensors``; else every
    ``*.safetensors`` file in the directory (what the engines load).
    """
    files, sharded, _ = _checkpoint_files(Path(model_dir))
    return files, sharded


def _checkpoint_files(root: Path) -> tuple[list[Path], bool, dict[str, str] | None]:
    """``checkpoint_files`` and the index's ``weight_map`` (None without an index)."""
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
        return files, True, weight_map
    single = root / SINGLE_FILE
    if single.is_file():
        return [single], False, None
    files = sorted(root.glob("*.safetensors"))
    if files:
        return files, len(files) > 1, None
    has_bin = any(root.glob("*.bin"))
    raise CheckpointError(
        f"{root}: no safetensors weights (no {SINGLE_FILE}, no {INDEX_NAME}, no *.safetensors)"
        + ("; only PyTorch .bin files, which inspect does not read." if has_bin else ".")
    )


def open_checkpoint(
    model_dir: str | os.PathLike[str], before_read: Callable[[TensorInfo], None] | None = None
) -> Checkpoint:
    """Read ``config.json`` and every safetensors header of ``model_dir`` (no weight bytes);
    ``before_read``: see ``Checkpoint.before_read``."""
    root = Path(model_dir)
    if not root.exists():
        raise CheckpointError(f"{root}: no such directory.")
    if not root.is_dir():
        raise CheckpointError(f"{root}: not a directory; pass a checkpoint directory.")
    config = read_config(root)
    files, sharded, weight_map = _checkpoint_files(root)
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
    for name, fname in (weight_map or {}).items():
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
        before_read=before_read,
    )
