"""``kvscale inspect ORG/NAME`` against a Hub-shaped HTTP server on loopback
(kvscale_testing.hub_server) over checkpoints made here: the report equals the one for the
same checkpoint on disk, and only metadata and scale bytes are fetched (counted per
request). Nothing reaches outside the machine: ``HF_ENDPOINT`` is the loopback server,
``HF_HUB_CACHE`` a temporary folder, and no token of the user's is read."""

from __future__ import annotations

import importlib
import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvscale_testing.hub_server import HubServer, Repo

from kvscale_plugin.checkpoint import open_checkpoint
from kvscale_plugin.inspection import run_inspect
from kvscale_plugin.scheme import FP8_KV_SCHEME

SCALES = {0: (3.25, 2.5), 1: (4.75, 2.125), 2: (1.5, 0.75)}
REPO = "org/tiny"


def _reload_hub_constants() -> None:
    import huggingface_hub.constants

    importlib.reload(huggingface_hub.constants)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """``hub_env(endpoint, offline=False, token=None)``: the environment huggingface_hub
    reads, pointed at loopback and a fresh cache (its constants re-read from it)."""

    def set_env(endpoint: str, offline: bool = False, token: str | None = None) -> None:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
        monkeypatch.delenv("HUGGING_FACE_HUB_TOKEN", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)  # huggingface_hub reads it too
        if offline:
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        else:
            monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        if token:
            monkeypatch.setenv("HF_TOKEN", token)
        else:
            monkeypatch.delenv("HF_TOKEN", raising=False)
        _reload_hub_constants()

    yield set_env
    monkeypatch.undo()
    _reload_hub_constants()


@pytest.fixture
def ckpts(tiny):
    per_head = {
        f"model.layers.{i}.self_attn.{kind}_scale": torch.tensor(
            [[[k + i]], [[k + i + 0.5]]], dtype=torch.float32
        )
        for i in range(3)
        for kind, k in (("k", 2.0), ("v", 1.0))
    }
    return {
        "single": tiny("hub-single", num_layers=3, scales=SCALES),
        "sharded": tiny("hub-sharded", num_layers=3, scales=SCALES, num_shards=4),
        "per-head": tiny(
            "hub-per-head",
            num_layers=3,
            kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "attn_head"},
            write_scales=False,
            scales=SCALES,
            extra_tensors=per_head,
        ),
        "corrupt": tiny("hub-corrupt", num_layers=3, scales={**SCALES, 1: (math.nan, 2.0)}),
    }


def _run(capsys, target: str, as_json: bool = True) -> tuple[int, dict | str, str]:
    status = run_inspect(target, as_json=as_json)
    captured = capsys.readouterr()
    return status, json.loads(captured.out) if as_json else captured.out, captured.err


def _comparable(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in ("model_dir", "hub")}


@pytest.mark.parametrize("kind", ["single", "sharded", "per-head", "corrupt"])
def test_the_hub_report_is_the_local_one_from_metadata_and_scale_bytes(
    kind, ckpts, hub_env, capsys
):
    folder = ckpts[kind]
    local_status, local, _ = _run(capsys, str(folder))
    with HubServer({REPO: Repo(folder)}) as server:
        hub_env(server.endpoint)
        status, data, err = _run(capsys, REPO)
    assert status == local_status, err
    assert status == local_status and _comparable(data) == _comparable(local)
    assert data["model_dir"] == f"hf://{REPO}"
    assert data["hub"]["commit"] == Repo(folder).commit
    # Per safetensors file: 8 bytes + its header + the bytes of the tensors decoded. Never
    # a weight: every range asked is the header's, or a small tensor's.
    with open_checkpoint(folder) as ckpt:
        tensors = ckpt.tensors
    fetched = {f["file"]: f for f in data["hub"]["files"]}
    for path in sorted(folder.glob("*.safetensors")):
        n = struct.unpack("<Q", path.read_bytes()[:8])[0]
        decoded = [t for t in tensors.values() if t.file.name == path.name and t.numel <= 4096]
        ranges = {(0, 7), (8, 8 + n - 1)} | {(t.start, t.end - 1) for t in decoded}
        sent = server.sent_for(path.name)
        asked = {
            tuple(map(int, r.range.removeprefix("bytes=").split("-"))) for r in sent if r.range
        }
        assert asked <= ranges, (path.name, asked - ranges)
        served = sum(r.sent for r in sent)
        assert served == fetched[path.name]["bytes"] <= 8 + n + sum(t.nbytes for t in decoded)
        assert served < path.stat().st_size  # the weights stayed on the server
    # The files' bytes are every byte served but the repository's API answer.
    files = [r for r in server.requests if r.status in (200, 206) and "/api/" not in r.path]
    assert data["hub"]["bytes"] == sum(r.sent for r in files)


def test_the_text_report_ends_with_what_was_fetched(ckpts, hub_env, capsys):
    with HubServer({REPO: Repo(ckpts["single"])}) as server:
        hub_env(server.endpoint)
        status, text, _ = _run(capsys, f"hf://{REPO}@main", as_json=False)
    assert status == 0
    tail = text[text.index("fetched from") :]
    assert server.endpoint in tail and Repo(ckpts["single"]).commit in tail
    assert "config.json:" in tail and "model.safetensors:" in tail


def test_huggingface_hubs_own_metadata_reader_fetches_weights_on_small_shards(ckpts, hub_env):
    """Why inspect reads headers itself: get_safetensors_metadata asks for the first 100 KB
    of every file, on a small shard well past its header, into the weights."""
    folder = ckpts["single"]
    file = folder / "model.safetensors"
    n = struct.unpack("<Q", file.read_bytes()[:8])[0]
    with HubServer({REPO: Repo(folder)}) as server:
        hub_env(server.endpoint)
        from huggingface_hub import HfApi

        HfApi().get_safetensors_metadata(REPO)
    sent = sum(r.sent for r in server.sent_for("model.safetensors"))
    assert sent > 8 + n, (sent, n)


def test_an_existing_local_folder_of_that_name_wins(ckpts, hub_env, capsys, monkeypatch, tmp_path):
    import shutil

    monkeypatch.chdir(tmp_path)
    shutil.copytree(ckpts["single"], tmp_path / REPO)
    with HubServer({}) as server:
        hub_env(server.endpoint)
        status, data, _ = _run(capsys, REPO)
    assert status == 0 and "hub" not in data and server.requests == []


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("unknown", "no such repository on the Hub, or it is private or gated"),
        ("private", "hf auth login"),
        ("gated", "is gated: accept its terms on the Hub"),
        ("revision", "has no revision 'v9'"),
        ("bin-only", "no safetensors weights (only pytorch_model.bin"),
        ("no-network", "cannot reach the Hub"),
        ("offline", "HF_HUB_OFFLINE=1, and the checkpoint is not in the local Hub cache"),
        ("ignores-ranges", "the server ignored a byte-range request"),
    ],
)
def test_bad_input_exits_2_saying_what_to_do(case, expected, ckpts, hub_env, capsys, tmp_path):
    folder = ckpts["single"]
    repos = {REPO: Repo(folder)}
    target = REPO
    if case == "unknown":
        target = "org/missing"
    elif case in ("private", "gated"):
        repos = {REPO: Repo(folder, private=case == "private", gated=case == "gated")}
    elif case == "revision":
        target = f"{REPO}@v9"
    elif case == "bin-only":
        only_bin = tmp_path / "bin-only"
        only_bin.mkdir()
        (only_bin / "config.json").write_text((folder / "config.json").read_text())
        (only_bin / "pytorch_model.bin").write_bytes(b"\0" * 64)
        repos = {REPO: Repo(only_bin)}
    with HubServer(repos, ignore_ranges=case == "ignores-ranges") as server:
        endpoint = server.endpoint
        if case == "no-network":
            endpoint = "http://127.0.0.1:9"  # the discard port: nothing listens
        hub_env(endpoint, offline=case == "offline")
        status, data, err = _run(capsys, target)
    assert status == 2, data
    assert expected in data["error"]["message"] and expected in err, data
    assert data["error"]["type"] == "HubError"
    if case not in ("bin-only", "ignores-ranges"):  # where a download would not help
        assert "kvscale inspect PATH" in data["error"]["message"]
    if case == "ignores-ranges":  # what it read of the whole file it was sent: bounded
        assert all(r.sent <= (folder / "model.safetensors").stat().st_size for r in server.requests)


def test_a_token_opens_a_private_repository(ckpts, hub_env, capsys):
    repo = Repo(ckpts["single"], private=True)
    with HubServer({REPO: repo}) as server:
        hub_env(server.endpoint, token=repo.token)
        status, data, _ = _run(capsys, REPO)
    assert status == 0 and data["hub"]["commit"] == repo.commit


def test_a_header_past_the_limit_is_refused_after_8_bytes(hub_env, capsys, tmp_path, ckpts):
    folder = tmp_path / "huge-header"
    folder.mkdir()
    (folder / "config.json").write_text((ckpts["single"] / "config.json").read_text())
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}" + b"\0" * 1000)
    with HubServer({REPO: Repo(folder)}) as server:
        hub_env(server.endpoint)
        status, data, _ = _run(capsys, REPO)
    assert status == 2 and "corrupt safetensors header" in data["error"]["message"]
    assert f"hf://{REPO}/model.safetensors" in data["error"]["message"]
    assert sum(r.sent for r in server.sent_for("model.safetensors")) == 8


def test_offline_with_the_checkpoint_in_the_hub_cache_reads_the_cache(ckpts, hub_env, capsys):
    folder = ckpts["single"]
    with HubServer({REPO: Repo(folder)}) as server:
        hub_env(server.endpoint)
        from huggingface_hub import hf_hub_download

        for name in ("config.json", "model.safetensors"):
            hf_hub_download(REPO, name, revision="main")
        _, local, _ = _run(capsys, str(folder))
        hub_env(server.endpoint, offline=True)
        asked = len(server.requests)
        status, data, _ = _run(capsys, REPO)
        assert len(server.requests) == asked  # offline: the server is not asked
    assert status == 0 and _comparable(data) == _comparable(local)
    assert data["hub"]["from_cache"] is True and data["hub"]["commit"] == Repo(folder).commit


def test_the_console_script_reads_hf_endpoint(ckpts, tmp_path):
    """The user's path: ``kvscale inspect ORG/NAME`` in a fresh process, HF_ENDPOINT set."""
    folder = ckpts["sharded"]
    with HubServer({REPO: Repo(folder)}) as server:
        env = dict(os.environ, HF_ENDPOINT=server.endpoint, HF_HOME=str(tmp_path / "home"))
        for name in ("HF_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.pop(name, None)
        out = subprocess.run(
            [sys.executable, "-m", "kvscale_plugin.cli", "inspect", REPO, "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["hub"]["endpoint"] == server.endpoint
    assert len([f for f in data["hub"]["files"] if f["file"].endswith(".safetensors")]) == 4
    assert Path(data["model_dir"]).name == "tiny" and data["model_dir"].startswith("hf://")
