"""The multi-node deployment check's rule (``hosts.vllm.deployment.check_ranks``) on a real
torch.distributed store; the two-node engines are in tests/e2e/test_vllm_two_nodes.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from kvscale_plugin.hosts.vllm import deployment
from kvscale_plugin.hosts.vllm.deployment import DeploymentError, check_ranks


def _record(version: str = "0.1.0", node: int = 0) -> dict[str, object]:
    return {"version": version, "node_rank": node, "host": f"node{node}"}


def test_every_rank_reporting_the_same_version_passes() -> None:
    store = dist.HashStore()
    seen: dict[str, object] = {}
    peer = threading.Thread(
        target=lambda: seen.update(r1=check_ranks(store, 1, 2, _record(node=1), 5))
    )
    peer.start()
    records = check_ranks(store, 0, 2, _record(), 5, poll_s=0.05)
    peer.join(10)
    assert records == {0: _record(), 1: _record(node=1)} == seen["r1"]


def test_a_rank_reporting_late_within_the_timeout_passes() -> None:
    store = dist.HashStore()
    late = threading.Timer(0.5, lambda: check_ranks(store, 1, 2, _record(node=1), 0.01))
    late.start()
    try:
        assert set(check_ranks(store, 0, 2, _record(), 10, poll_s=0.05)) == {0, 1}
    finally:
        late.cancel()


def test_a_rank_that_never_reports_is_named_after_the_timeout() -> None:
    store = dist.HashStore()
    start = time.monotonic()
    with pytest.raises(DeploymentError) as err:
        check_ranks(store, 0, 4, _record(), 0.3, poll_s=0.05)
    assert 0.3 <= time.monotonic() - start < 5
    message = str(err.value)
    assert "rank(s) 1, 2, 3 of 4 did not report kvscale within 0.3 s" in message
    assert "--quantization kvscale" in message and deployment.ENV_TIMEOUT in message


def test_another_kvscale_version_is_named_with_its_node() -> None:
    store = dist.HashStore()
    store.set("kvscale/deployment/rank1", '{"version": "0.0.9", "node_rank": 1, "host": "b"}')
    with pytest.raises(DeploymentError, match=r"rank 1 \(node 1, b\): 0\.0\.9; this rank runs"):
        check_ranks(store, 0, 2, _record(), 1)


@pytest.mark.parametrize(
    ("raw", "expected"), [("", 60.0), ("12.5", 12.5), ("-1", 60.0), ("x", 60.0)]
)
def test_timeout_from_the_environment(monkeypatch, raw: str, expected: float) -> None:
    monkeypatch.setenv(deployment.ENV_TIMEOUT, raw)
    assert deployment.timeout_s() == expected
