"""``kvscale inspect ORG/NAME[@REVISION]`` (or ``hf://ORG/NAME``): a checkpoint on the Hugging
Face Hub, inspected without downloading it.

Everything the report reads is small: ``config.json``, the safetensors index, each file's
header and the scale tensors' bytes. This module resolves the repository through
``huggingface_hub`` (``HF_ENDPOINT``, ``HF_TOKEN`` or the cached login, ``HF_HUB_OFFLINE``
and proxies as ``huggingface_hub`` reads them) and builds a *sparse mirror* in a temporary
folder: the JSON files whole, and each safetensors file at the size the server reports
with only its first 8 bytes and its header written (the rest is a hole: no disk is used
for it). The report is then the local one (``inspect_checkpoint`` on the mirror, the same
validation by the ``safetensors`` library, the same header limit), and each tensor it
decodes is fetched (one HTTP range request) just before it is read. Never the weights:
per safetensors file, at most 8 bytes + the header + the scale tensors' bytes. (The
Hub's own safetensors-metadata reader, ``get_safetensors_metadata``, asks for the first
100 KB of every file, which on small shards is weight bytes.)

An existing local path wins (as in transformers): ``ORG/NAME`` is a Hub id only when no
such directory exists. With ``HF_HUB_OFFLINE=1``, or when the Hub cannot be reached, a
snapshot in the local Hub cache is inspected instead (and the report says so).
"""

from __future__ import annotations

import json
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvscale_plugin.checkpoint import (
    CONFIG_NAME,
    INDEX_NAME,
    MAX_HEADER_BYTES,
    SINGLE_FILE,
    CheckpointError,
    TensorInfo,
)

PREFIX = "hf://"
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
#: JSON files (config, index) larger than this are refused: never unbounded reads.
MAX_JSON_BYTES = 50_000_000
_LOGIN = "run `hf auth login` (or set HF_TOKEN)"


class HubError(CheckpointError):
    """The Hub checkpoint cannot be inspected (the message says why and what to do)."""


@dataclass(frozen=True)
class HubSpec:
    """A Hub checkpoint: repository id and revision (None: the default branch)."""

    repo_id: str
    revision: str | None = None

    @property
    def label(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_spec(arg: str) -> HubSpec | None:
    """``ORG/NAME[@REV]`` or ``hf://ORG/NAME[@REV]`` -> ``HubSpec``; None for a local path
    (any path that exists, or that starts like one)."""
    explicit = arg.startswith(PREFIX)
    if not explicit and (Path(arg).exists() or arg.startswith((".", "/", "~"))):
        return None
    repo_id, _, revision = arg.removeprefix(PREFIX).rstrip("/").partition("@")
    if _REPO_ID.match(repo_id) and (revision or "@" not in arg):
        return HubSpec(repo_id, revision or None)
    if explicit:
        raise HubError(f"{arg}: not a Hub checkpoint id (expected hf://ORG/NAME[@REVISION]).")
    return None


@dataclass
class Fetched:
    """What was fetched from one file: bytes and requests."""

    file: str
    size: int | None
    bytes: int = 0
    requests: int = 0


@dataclass
class HubSource:
    """Where a Hub report's bytes came from (``--json`` key ``hub``; the human report's end)."""

    repo_id: str
    revision: str | None
    commit: str | None
    endpoint: str
    from_cache: bool = False
    files: dict[str, Fetched] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "repo_id": self.repo_id,
            "revision": self.revision,
            "commit": self.commit,
            "endpoint": self.endpoint,
            "from_cache": self.from_cache,
            "files": [
                {"file": f.file, "size": f.size, "bytes": f.bytes, "requests": f.requests}
                for f in self.files.values()
            ],
            "bytes": sum(f.bytes for f in self.files.values()),
            "requests": sum(f.requests for f in self.files.values()),
        }

    def describe(self) -> str:
        where = f"{self.repo_id} at commit {self.commit or '?'}"
        if self.from_cache:
            return (
                f"read from the local Hub cache ({where}; nothing fetched: the Hub was not "
                "asked). A local directory works too: kvscale inspect PATH\n"
            )
        lines = [
            f"fetched from {self.endpoint} ({where}): "
            f"{sum(f.bytes for f in self.files.values()):,} bytes in "
            f"{sum(f.requests for f in self.files.values())} requests"
        ]
        for f in self.files.values():
            size = f" of {f.size:,}" if f.size is not None else ""
            lines.append(f"  {f.file}: {f.bytes:,}{size} bytes, {f.requests} request(s)")
        return "\n".join(lines) + "\n"


def _hub() -> Any:
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors
        import huggingface_hub.utils  # noqa: F401 - attributes of the package below
    except ImportError as exc:  # declared as a dependency: a broken install
        raise HubError(
            f"inspecting a Hub checkpoint needs huggingface_hub ({exc}); "
            "pip install huggingface_hub, or pass a local checkpoint directory."
        ) from exc
    return huggingface_hub


def _explain(spec: HubSpec, exc: Exception) -> HubError:
    """A ``huggingface_hub`` / network failure as a user reads it."""
    from huggingface_hub import errors

    name = spec.label
    if isinstance(exc, errors.GatedRepoError):
        why = f"{name} is gated: accept its terms on the Hub, then {_LOGIN}."
    elif isinstance(exc, errors.RevisionNotFoundError):
        why = f"{spec.repo_id} has no revision '{spec.revision}' (a branch, tag or commit)."
    elif isinstance(exc, errors.RepositoryNotFoundError):
        why = (
            f"{spec.repo_id}: no such repository on the Hub, or it is private or gated and "
            f"this request was not allowed: check the id, or {_LOGIN}."
        )
    elif isinstance(exc, errors.OfflineModeIsEnabled):
        why = "HF_HUB_OFFLINE=1 and the checkpoint is not in the local Hub cache."
    elif isinstance(exc, errors.HfHubHTTPError):
        why = f"the Hub answered: {exc}."
    else:
        why = (
            f"cannot reach the Hub ({type(exc).__name__}: {exc}); check the network, "
            "HF_ENDPOINT and proxy settings."
        )
    return HubError(f"{name}: {why} A local checkpoint directory works too: kvscale inspect PATH.")


def cached_snapshot(spec: HubSpec) -> Path | None:
    """The checkpoint's snapshot folder in the local Hub cache, when its config is there."""
    hub = _hub()
    found = hub.try_to_load_from_cache(spec.repo_id, CONFIG_NAME, revision=spec.revision)
    return Path(found).parent if isinstance(found, str) else None


class HubMirror:
    """The sparse mirror of one Hub checkpoint (a context manager: the folder goes after)."""

    def __init__(self, spec: HubSpec) -> None:
        hub = _hub()
        self.spec = spec
        self._hub = hub
        self._session = hub.get_session()
        self._headers = hub.utils.build_hf_headers()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvscale-hub-")
        self.root = Path(self._tmp.name)
        self.source = HubSource(spec.repo_id, spec.revision, None, hub.constants.ENDPOINT)

    def __enter__(self) -> HubMirror:
        return self

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()

    def build(self) -> Path:
        """Resolve the revision, fetch the JSON files and every safetensors header."""
        try:
            info = self._hub.HfApi().model_info(
                self.spec.repo_id, revision=self.spec.revision or "main", files_metadata=True
            )
        except Exception as exc:  # noqa: BLE001 - every failure is the user's to read
            raise _explain(self.spec, exc) from exc
        self.source.commit = info.sha
        sizes = {s.rfilename: s.size for s in info.siblings or ()}
        if CONFIG_NAME not in sizes:
            raise HubError(f"{self.spec.label}: the repository has no {CONFIG_NAME}.")
        self._json(CONFIG_NAME, sizes)
        for name in self._weight_files(sizes):
            self._header(name, sizes.get(name))
        return self.root

    def _weight_files(self, sizes: dict[str, int | None]) -> list[str]:
        """The safetensors files the local report would read (index, single file, or all)."""
        if INDEX_NAME in sizes:
            index = json.loads(self._json(INDEX_NAME, sizes))
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if isinstance(weight_map, dict):
                return [str(n) for n in dict.fromkeys(weight_map.values()) if n in sizes]
            return []  # the local reader names the problem
        if SINGLE_FILE in sizes:
            return [SINGLE_FILE]
        files = sorted(n for n in sizes if n.endswith(".safetensors") and "/" not in n)
        if not files:
            other = sorted(n for n in sizes if n.endswith((".bin", ".gguf", ".pt", ".pth")))
            raise HubError(
                f"{self.spec.label}: the repository has no safetensors weights"
                + (f" (only {', '.join(other[:3])}: inspect reads safetensors)." if other else ".")
            )
        return files

    def _url(self, name: str) -> str:
        return self._hub.hf_hub_url(self.spec.repo_id, name, revision=self.source.commit)

    def _get(self, name: str, start: int, length: int) -> bytes:
        """Bytes ``start`` .. ``start + length - 1`` of file ``name`` (never more)."""
        record = self.source.files.setdefault(name, Fetched(name, None))
        headers = {**self._headers, "Range": f"bytes={start}-{start + length - 1}"}
        try:
            with self._session.stream(
                "GET", self._url(name), headers=headers, follow_redirects=True
            ) as response:
                if response.status_code >= 400:
                    self._refuse(response)
                if response.status_code != 206 and start > 0:
                    raise HubError(
                        f"{self.spec.label}/{name}: the server ignored a byte-range request "
                        f"(HTTP {response.status_code}); inspect never downloads whole files."
                    )
                data = bytearray()
                for chunk in response.iter_bytes():
                    data.extend(chunk[: length - len(data)])
                    if len(data) >= length:
                        break
        except HubError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _explain(self.spec, exc) from exc
        record.bytes += len(data)
        record.requests += 1
        return bytes(data)

    def _refuse(self, response: Any) -> None:
        """Raise the ``huggingface_hub`` error for a failed response (its body read up to
        64 KB: an error page is never read unbounded)."""
        body = bytearray()
        for chunk in response.iter_bytes():
            body.extend(chunk[: 65536 - len(body)])
            if len(body) >= 65536:
                break
        read = type(response)(
            response.status_code,
            headers=response.headers,
            content=bytes(body),
            request=response.request,
        )
        self._hub.utils.hf_raise_for_status(read)
        raise HubError(f"{self.spec.label}: the Hub answered HTTP {response.status_code}.")

    def _json(self, name: str, sizes: dict[str, int | None]) -> bytes:
        size = sizes.get(name)
        if size is not None and size > MAX_JSON_BYTES:
            raise HubError(
                f"{self.spec.label}/{name}: {size:,} bytes, more than a JSON file's limit."
            )
        data = self._get(name, 0, size if size else MAX_JSON_BYTES)
        self.source.files[name].size = size
        (self.root / name).write_bytes(data)
        return data

    def _header(self, name: str, size: int | None) -> None:
        """The file's first 8 bytes and header, in a sparse file of the server's size."""
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        prefix = self._get(name, 0, 8) if size is None or size > 0 else b""
        self.source.files[name].size = size
        total = size if size is not None else len(prefix)
        n = int.from_bytes(prefix, "little") if len(prefix) == 8 else 0
        header = b""
        # The local reader refuses a length past the limit or the file: then nothing more.
        if len(prefix) == 8 and n <= MAX_HEADER_BYTES and 8 + n <= total:
            header = self._get(name, 8, n)
        with open(path, "wb") as f:
            f.truncate(total)
            f.write(prefix + header)

    def fetcher(self) -> Callable[[TensorInfo], None]:
        """Called before the report decodes a tensor: its bytes into the mirror."""
        done: set[tuple[str, str]] = set()

        def fetch(info: TensorInfo) -> None:
            key = (info.file.name, info.name)
            if key in done or info.nbytes <= 0:
                return
            done.add(key)
            data = self._get(info.file.name, info.start, info.nbytes)
            with open(info.file, "r+b") as f:
                f.seek(info.start)
                f.write(data)

        return fetch

    def local_name(self, text: str) -> str:
        """``text`` with the mirror's folder named as the Hub checkpoint."""
        return text.replace(str(self.root), f"{PREFIX}{self.spec.label}")


def inspect_hub(spec: HubSpec, host: str = "vllm") -> tuple[Any, HubSource]:
    """``inspect_checkpoint`` of a Hub checkpoint: the report (its ``model_dir`` the Hub id)
    and where its bytes came from. Raises ``HubError`` / ``CheckpointError``."""
    from kvscale_plugin.inspection.report import inspect_checkpoint

    hub = _hub()
    if hub.constants.HF_HUB_OFFLINE:
        return _from_cache(spec, host, "HF_HUB_OFFLINE=1")
    with HubMirror(spec) as mirror:
        try:
            root = mirror.build()
        except HubError as exc:
            cause = exc.__cause__
            if cause is None or isinstance(cause, hub.errors.HfHubHTTPError):
                raise
            # The Hub cannot be reached: a snapshot in the local cache, if there is one.
            return _from_cache(
                spec, host, f"cannot reach the Hub ({type(cause).__name__}: {cause})"
            )
        try:
            report = inspect_checkpoint(root, host=host, before_read=mirror.fetcher())
        except CheckpointError as exc:
            raise type(exc)(mirror.local_name(str(exc))) from exc
    report.model_dir = f"{PREFIX}{spec.label}"
    return report, mirror.source


def _from_cache(spec: HubSpec, host: str, why: str) -> tuple[Any, HubSource]:
    from kvscale_plugin.inspection.report import inspect_checkpoint

    hub = _hub()
    snapshot = cached_snapshot(spec)
    if snapshot is None:
        raise HubError(
            f"{spec.label}: {why}, and the checkpoint is not in the local Hub cache "
            f"({hub.constants.HF_HUB_CACHE}). Unset HF_HUB_OFFLINE / restore the network, "
            "or pass a local checkpoint directory: kvscale inspect PATH."
        )
    report = inspect_checkpoint(snapshot, host=host)
    report.model_dir = f"{PREFIX}{spec.label}"
    source = HubSource(spec.repo_id, spec.revision, snapshot.name, str(snapshot), from_cache=True)
    return report, source
