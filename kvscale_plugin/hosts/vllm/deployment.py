"""A multi-node engine whose ranks do not all serve with kvscale refuses to start (the
``deployment-check`` feature).

vLLM's multi-node launch (``--nnodes N``, one ``vllm serve`` per node) builds each node's
engine config from that node's own command line and installed plugins. A node without
kvscale-plugin (or started without ``--quantization kvscale``) still joins the engine: its
ranks then serve stock's KV method and cache write while the other nodes serve kvscale's,
and the engine answers with silently different numbers. So every kvscale rank of an engine
spanning several nodes publishes a record (kvscale version, node) in the engine's
torch.distributed store as its model is built, and waits -- bounded by
``KVSCALE_DEPLOYMENT_TIMEOUT`` seconds -- for every rank's record. A rank that never
reports, or reports another kvscale version, stops the start with an error naming it.

Single-node engines are never checked (one installation serves every rank).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, Protocol

from kvscale_plugin import __version__
from kvscale_plugin._log import logger, warn_once

ENV_TIMEOUT = "KVSCALE_DEPLOYMENT_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_KEY = "kvscale/deployment/rank{}"


class DeploymentError(RuntimeError):
    """Some ranks of a multi-node engine do not serve with this kvscale."""


class _Store(Protocol):  # torch.distributed.Store, as used here
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def check(self, keys: list[str]) -> bool: ...


def timeout_s() -> float:
    """``KVSCALE_DEPLOYMENT_TIMEOUT`` in seconds (unset or invalid: 60, one warning)."""
    raw = os.environ.get(ENV_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value > 0:
        return value
    warn_once(
        f"deployment-timeout-{raw}",
        "kvscale: %s=%r is not a positive number of seconds; using %g.",
        ENV_TIMEOUT,
        raw,
        DEFAULT_TIMEOUT_S,
    )
    return DEFAULT_TIMEOUT_S


def check_ranks(
    store: _Store,
    rank: int,
    world_size: int,
    record: Mapping[str, Any],
    timeout: float,
    *,
    poll_s: float = 0.2,
) -> dict[int, dict[str, Any]]:
    """Publish ``record`` as ``rank``'s, wait up to ``timeout`` s for every rank's; return
    them, or raise ``DeploymentError`` naming the ranks that did not report and those
    that run another kvscale version."""
    store.set(_KEY.format(rank), json.dumps(dict(record)))
    deadline = time.monotonic() + timeout
    while True:
        missing = [r for r in range(world_size) if not store.check([_KEY.format(r)])]
        if not missing or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    records = {
        r: json.loads(store.get(_KEY.format(r))) for r in range(world_size) if r not in missing
    }
    problems = []
    if missing:
        problems.append(
            f"rank(s) {', '.join(map(str, missing))} of {world_size} did not report kvscale "
            f"within {timeout:g} s: they serve without kvscale (kvscale-plugin not installed on "
            "their node, or that node was started without --quantization kvscale) and would "
            "write and read the FP8 KV cache with other scales than this node"
        )
    mine = record.get("version")
    other = {r: rec for r, rec in records.items() if rec.get("version") != mine}
    if other:
        problems.append(
            "rank(s) run another kvscale-plugin version: "
            + ", ".join(
                f"rank {r} (node {rec.get('node_rank', '?')}, {rec.get('host', '?')}): "
                f"{rec.get('version')}"
                for r, rec in sorted(other.items())
            )
            + f"; this rank runs {mine}"
        )
    if problems:
        raise DeploymentError(
            f"kvscale: this {world_size}-rank engine spans several nodes, and not every rank "
            f"serves with kvscale-plugin {mine}: "
            + "; ".join(problems)
            + ". Install the same kvscale-plugin on every node and start every node with the "
            "same --quantization kvscale (a node that lacks the plugin but is given "
            "--quantization kvscale exits at start; the others then wait until "
            f"--distributed-timeout-seconds). {ENV_TIMEOUT} sets how long this check waits."
        )
    return records


def check_deployment() -> None:
    """Run ``check_ranks`` once in this worker process, when its engine spans several
    nodes (vLLM's ``ParallelConfig.nnodes``) and the ``deployment-check`` feature is
    installed. Called as kvscale's KV method builds its first layer
    (``activation.layer_built``). A store that cannot be reached costs this check only
    (one warning)."""
    from vllm.config import get_current_vllm_config_or_none

    from kvscale_plugin.hosts.vllm.patching import ensure
    from kvscale_plugin.hosts.vllm.process import HOST

    parallel = getattr(get_current_vllm_config_or_none(), "parallel_config", None)
    nnodes = getattr(parallel, "nnodes", 1)
    if HOST.deployment_checked or not isinstance(nnodes, int) or nnodes <= 1:
        return
    HOST.deployment_checked = True  # once per process: one engine's workers per process
    import torch.distributed as dist

    found = ensure(  # the engine's store, this rank, the world size
        "deployment-check",
        lambda: (
            dist.distributed_c10d._get_default_store(),
            dist.get_rank(),
            dist.get_world_size(),
        ),
        "deployment-store",
        "kvscale: could not reach the engine's torch.distributed store (%s: %s); that "
        "every node serves with kvscale is not checked.",
    )
    if found is None:
        return
    store, rank, world_size = found
    record = {
        "version": __version__,
        "node_rank": getattr(parallel, "node_rank", None),
        "host": socket.gethostname(),
    }
    records = check_ranks(store, rank, world_size, record, timeout_s())
    logger.debug(
        "kvscale: every rank of this %d-node engine serves with kvscale: %s", nnodes, records
    )
