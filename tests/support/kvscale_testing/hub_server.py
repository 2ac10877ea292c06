"""A Hugging-Face-Hub-shaped HTTP server on loopback, over checkpoint folders made in fixtures.

It answers the requests ``huggingface_hub`` and ``kvscale inspect ORG/NAME`` send, as the
Hub does:

* ``GET /api/models/ORG/NAME/revision/REV`` -- ``{"id", "sha", "siblings": [{"rfilename",
  "size"}]}``; an unknown repository, or a private one asked anonymously: 401 with
  ``X-Error-Code: RepoNotFound``; a gated one without a token: 401 ``GatedRepo``; an
  unknown revision: 404 ``RevisionNotFound``.
* ``GET /ORG/NAME/resolve/REV/FILE`` -- ``ETag`` and ``X-Repo-Commit`` headers; a
  ``*.safetensors`` file (LFS on the Hub) is a 302 to ``/cdn/...`` on a second origin (the
  Hub redirects to its CDN) with ``X-Linked-Size`` / ``X-Linked-Etag``; ``Range: bytes=A-B``
  is answered 206 with ``Content-Range``; an unknown file: 404 ``EntryNotFound``.

Every request is recorded (path, range, status, body bytes sent) for the tests to count.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class Repo:
    """One repository: its files (a folder), revisions it answers to, and who may read it."""

    folder: Path
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    revisions: tuple[str, ...] = ("main",)
    private: bool = False
    gated: bool = False
    token: str = "hf_test_token"

    def files(self) -> dict[str, Path]:
        return {
            str(p.relative_to(self.folder)): p
            for p in sorted(self.folder.rglob("*"))
            if p.is_file()
        }


@dataclass
class Request:
    path: str
    range: str | None
    status: int
    sent: int  # body bytes


@dataclass
class HubServer:
    """``with HubServer(repos) as hub: hub.endpoint``; ``hub.requests`` lists what was asked."""

    repos: dict[str, Repo]
    requests: list[Request] = field(default_factory=list)
    ignore_ranges: bool = False  # a server that answers every range with the whole file

    def __enter__(self) -> HubServer:
        handler = type("Handler", (_Handler,), {"hub": self})
        # The Hub and its CDN: two origins (clients keep the Hub's headers of a redirect to
        # another origin, and follow redirects within one).
        self._servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for _ in range(2)]
        for server in self._servers:
            threading.Thread(target=server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()

    @staticmethod
    def _origin(server: ThreadingHTTPServer) -> str:
        host, port = server.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def endpoint(self) -> str:
        return self._origin(self._servers[0])

    @property
    def cdn(self) -> str:
        return self._origin(self._servers[1])

    def sent_for(self, file: str) -> list[Request]:
        return [r for r in self.requests if r.path.endswith("/" + file)]


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer

    def log_message(self, *args: object) -> None:  # quiet
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.hub.requests.append(
            Request(urlsplit(self.path).path, self.headers.get("Range"), status, len(body))
        )

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(
            status,
            body,
            {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": message},
        )

    def _allowed(self, repo: Repo) -> str | None:
        """None when this request may read ``repo``; else the error code the Hub sends."""
        if not (repo.private or repo.gated):
            return None
        if self.headers.get("Authorization") == f"Bearer {repo.token}":
            return None
        return "GatedRepo" if repo.gated else "RepoNotFound"

    def do_HEAD(self) -> None:  # noqa: N802
        self.do_GET()

    def do_GET(self) -> None:  # noqa: N802
        path = unquote(urlsplit(self.path).path)
        api = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/(.+))?", path)
        resolve = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        cdn = re.fullmatch(r"/cdn/([^/]+/[^/]+)/([0-9a-f]+)/(.+)", path)
        if api:
            return self._model_info(api[1], api[2] or "main")
        if resolve:
            return self._resolve(resolve[1], resolve[2], resolve[3])
        if cdn:
            return self._file(cdn[1], cdn[3])
        self._send(404, b"not found")

    def _repo(self, repo_id: str, revision: str) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        code = "RepoNotFound" if repo is None else self._allowed(repo)
        if code is not None or repo is None:
            self._error(401, code or "RepoNotFound", "Repository not found")
            return None
        if revision not in (*repo.revisions, repo.commit):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + revision)
            return None
        return repo

    def _model_info(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        siblings = [{"rfilename": n, "size": p.stat().st_size} for n, p in repo.files().items()]
        body = json.dumps({"id": repo_id, "sha": repo.commit, "siblings": siblings}).encode()
        self._send(200, body, {"Content-Type": "application/json"})

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        repo = self._repo(repo_id, revision)
        if repo is None:
            return
        path = repo.files().get(name)
        if path is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        etag = hashlib.sha256(path.read_bytes()).hexdigest()
        headers = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"'}
        if name.endswith(".safetensors"):  # an LFS file: the Hub redirects to its CDN
            headers.update(
                Location=f"{self.hub.cdn}/cdn/{repo_id}/{repo.commit}/{name}",
                **{"X-Linked-Size": str(path.stat().st_size), "X-Linked-Etag": f'"{etag}"'},
            )
            return self._send(302, b"", headers)
        self._file(repo_id, name, headers)

    def _file(self, repo_id: str, name: str, headers: dict[str, str] | None = None) -> None:
        repo = self.hub.repos.get(repo_id)
        path = repo.files().get(name) if repo is not None else None
        if path is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        data = path.read_bytes()
        headers = dict(headers or {}, **{"Accept-Ranges": "bytes"})
        asked = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if asked is None or self.hub.ignore_ranges:
            return self._send(200, data, headers)
        start = int(asked[1])
        end = min(int(asked[2]) if asked[2] else len(data) - 1, len(data) - 1)
        if start >= len(data):
            return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"})
        headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
        self._send(206, data[start : end + 1], headers)
