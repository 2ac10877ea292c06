"""KV that leaves the block pool keeps its scales (docs/deployment.md): vLLM's own KV
connectors, subclassed under their own names and loaded through vLLM's public
``kv_connector_module_path`` (it takes priority over vLLM's registry, so every check vLLM
makes by connector name still holds)::

    --kv-transfer-config '{"kv_connector": "NixlConnector",
                           "kv_connector_module_path": "kvscale_plugin.hosts.vllm.connectors",
                           "kv_role": "kv_both"}'

Each keeps the engine's scale state (``kvscale_plugin.scalestate``) on its scheduler side:
from the workers at start-up (vLLM's handshake-metadata path, worker -> scheduler), and
after every load or update (``prefixcache``: the engine core asks the workers after each
``collective_rpc``; in-process engines read their own worker).

* ``ExampleConnector`` (disk store): KV is stored and found under a folder of the scale
  state (``<shared_storage_path>/kvscale-<tag>/<prompt hash>``), so an engine never loads
  KV stored under other scales -- its own from before an update, or another engine's
  sharing the store. A cache that applies no scales (bf16) keeps vLLM's layout.
* ``NixlConnector`` (P/D over NIXL): the producer adds its state to the request's
  ``kv_transfer_params``; a consumer whose FP8 cache serves another state (or gets none)
  does not pull: it recomputes the prefill (the request still succeeds; its final
  ``kv_transfer_params`` say so under ``kvscale_recomputed``, with both states) and NIXL's
  full-local-hit path tells the producer to free the blocks.

On an engine not served by kvscale (no scale state) both behave exactly as vLLM's own.
"""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

from kvscale_plugin._log import warn_once
from kvscale_plugin.scalestate import (
    PARAMS_KEY,
    Part,
    ScaleState,
    merge,
    part,
    readable,
)

logger = logging.getLogger("kvscale_plugin")

#: In a decode request's final ``kv_transfer_params``: why its prefill was recomputed here
#: (the producer's and this engine's scale states) instead of pulled.
RECOMPUTED_KEY = "kvscale_recomputed"


def layers_part(layers: Any) -> Part | None:
    """This worker's part of the scale state: its kvscale layers with scales in force
    (a layer that reads another's cache is left out)."""
    from kvscale_plugin.hosts.vllm.layers import kvscale_config, layer_serves_checkpoint_scales
    from kvscale_plugin.loadcycle import layer_record

    entries, applied = [], False
    for layer in layers:
        cfg, record = kvscale_config(layer), layer_record(layer)
        if cfg is None or record is None or record.resolved is None or record.target:
            continue
        heads = record.heads.heads if record.heads is not None else None
        entries.append((record.name, record.resolved.k_heads, record.resolved.v_heads, heads))
        applied = applied or layer_serves_checkpoint_scales(cfg.kv_verdict, layer)
    return part(entries, applied) if entries else None


def worker_part(worker: Any) -> Part | None:
    """For the engine core (``collective_rpc``): this worker's part of the scale state."""
    from kvscale_plugin.hosts.vllm.layers import engine_layers

    return layers_part(engine_layers(worker))


def scheduler_connector(scheduler: Any) -> Any:
    """The scheduler's connector when it is one of these (else None)."""
    connector = getattr(scheduler, "connector", None)
    return connector if hasattr(connector, "kvscale_set_state") else None


@dataclass
class KVScaleHandshake:
    """Worker -> scheduler at start-up: the worker's part of the state, and the wrapped
    connector's own handshake metadata (handed on to it unchanged)."""

    part: Part | None
    inner: Any = None


class _ScaleStateMixin:
    """The scheduler side's scale state, and the worker side's part of it at start-up."""

    _kvscale_state: ScaleState | None = None

    def kvscale_set_state(self, state: ScaleState | None) -> None:
        before, self._kvscale_state = self._kvscale_state, state
        if state is not None and before != state:
            logger.debug("kvscale: the connector's scale state is %s", state.describe())

    @property
    def kvscale_state(self) -> ScaleState | None:
        return self._kvscale_state

    def get_handshake_metadata(self) -> Any:  # worker side
        inner = super().get_handshake_metadata()  # type: ignore[misc]
        from kvscale_plugin.hosts.vllm.layers import config_layers

        return KVScaleHandshake(layers_part(config_layers(self._vllm_config)), inner)  # type: ignore[attr-defined]

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[Any, Any]) -> None:
        parts = [m.part for m in metadata.values() if isinstance(m, KVScaleHandshake)]
        self.kvscale_set_state(merge(parts))
        inner = {
            key: (m.inner if isinstance(m, KVScaleHandshake) else m) for key, m in metadata.items()
        }
        inner = {key: m for key, m in inner.items() if m is not None}
        if inner:  # vLLM calls the connector only when a worker had metadata
            super().set_xfer_handshake_metadata_pp_aware(inner)  # type: ignore[misc]


def _example_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector as Stock,
    )

    class ExampleConnector(_ScaleStateMixin, Stock):  # type: ignore[misc, valid-type]
        """vLLM's ExampleConnector, storing and finding KV under the scale state."""

        def build_connector_meta(self, scheduler_output: Any) -> Any:
            meta = super().build_connector_meta(scheduler_output)
            meta.kvscale_state = self._kvscale_state
            return meta

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            super().bind_connector_metadata(connector_metadata)
            # The worker side stores and loads under the state the scheduler matched under.
            self._kvscale_state = getattr(connector_metadata, "kvscale_state", None)

        def _generate_foldername_debug(
            self, token_ids: Any, mm_hashes: list[str], create_folder: bool = False
        ) -> str:
            plain = super()._generate_foldername_debug(token_ids, mm_hashes, False)
            state = self._kvscale_state
            if state is None or not state.applied:
                folder = plain
            else:
                folder = os.path.join(
                    os.path.dirname(plain), f"kvscale-{state.tag}", os.path.basename(plain)
                )
            if create_folder:
                os.makedirs(folder, exist_ok=True)
            return folder

    return ExampleConnector


def _nixl_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
        NixlConnector as Stock,
    )

    class NixlConnector(_ScaleStateMixin, Stock):  # type: ignore[misc, valid-type]
        """vLLM's NixlConnector (pull), with the producer's scale state in
        ``kv_transfer_params`` and a consumer that never pulls KV written under others."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._kvscale_recompute: set[str] = set()
            #: request id -> why its prefill was recomputed here (told back at its end)
            self._kvscale_recomputed: dict[str, dict[str, Any]] = {}

        def _kvscale_stamp(self, request: Any, result: tuple[bool, Any]) -> tuple[bool, Any]:
            delay, params = result
            if params is not None and self._kvscale_state is not None:
                params = {**params, PARAMS_KEY: self._kvscale_state.to_params()}
            why = self._kvscale_recomputed.pop(request.request_id, None)
            if why is not None:  # the caller learns, per request, that nothing was pulled
                params = {**(params or {}), RECOMPUTED_KEY: why}
            return delay, params

        def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
            return self._kvscale_stamp(request, super().request_finished(request, block_ids))

        def request_finished_all_groups(self, request: Any, block_ids: Any) -> tuple[bool, Any]:
            found = super().request_finished_all_groups(request, block_ids)
            return self._kvscale_stamp(request, found)

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
            params = request.kv_transfer_params
            if params and params.get("do_remote_prefill") and not self._kvscale_reads(request):
                self._kvscale_recompute.add(request.request_id)
                producer = ScaleState.from_params(params)
                self._kvscale_recomputed[request.request_id] = {
                    "producer": producer.to_params() if producer else None,
                    "consumer": self._kvscale_state.to_params() if self._kvscale_state else None,
                }
                return 0, False
            return super().get_num_new_matched_tokens(request, num_computed_tokens)

        def update_state_after_alloc(
            self, request: Any, blocks: Any, num_external_tokens: int
        ) -> Any:
            if request.request_id in self._kvscale_recompute:
                self._kvscale_recompute.discard(request.request_id)
                num_external_tokens = 0  # NIXL's full-local-hit path: nothing pulled, freed
            return super().update_state_after_alloc(request, blocks, num_external_tokens)

        def _kvscale_reads(self, request: Any) -> bool:
            producer = ScaleState.from_params(request.kv_transfer_params)
            consumer = self._kvscale_state
            if readable(producer, consumer):
                if consumer is not None and producer != consumer:
                    warn_once(
                        f"pd-state-bf16-{getattr(producer, 'tag', None)}-{consumer.tag}",
                        "kvscale: a prefill engine's KV was written under scale state %s; "
                        "this engine's is %s. Its cache applies no scales, so the KV is read "
                        "as is.",
                        producer.describe() if producer else "none (no kvscale there)",
                        consumer.describe(),
                    )
                return True
            assert consumer is not None
            warn_once(
                f"pd-state-{getattr(producer, 'tag', None)}-{consumer.tag}",
                "kvscale: request %s's KV was written by the prefill engine under scale "
                "state %s; this engine's FP8 cache is written with %s. The prefill's KV is "
                "not read: the prompt is recomputed here (the request still succeeds). "
                "Move both engines to the same scales to use the transfer again.",
                request.request_id,
                producer.describe() if producer else "none (no kvscale there)",
                consumer.describe(),
            )
            return False

    return NixlConnector


_BUILDERS = {"ExampleConnector": _example_connector, "NixlConnector": _nixl_connector}


def __getattr__(name: str) -> type:
    """The connector classes, built from vLLM's at first use (vLLM imports this module by
    its ``kv_connector_module_path`` and reads the class named by ``kv_connector``)."""
    builder = _BUILDERS.get(name)
    if builder is None:
        raise AttributeError(
            f"kvscale has no connector {name!r} (kv_connector_module_path): it provides "
            f"{', '.join(sorted(_BUILDERS))}. Any other connector keeps vLLM's own, which "
            "does not know the scales its KV was written with (docs/deployment.md)."
        )
    cls = builder()
    globals()[name] = cls
    return cls


def refresh_from_workers(core: Any) -> None:
    """After a ``collective_rpc`` (engine core): the scheduler's connector learns the
    engine's state again from every worker."""
    connector = scheduler_connector(getattr(core, "scheduler", None))
    if connector is not None:
        connector.kvscale_set_state(merge(core.model_executor.collective_rpc(worker_part)))


#: In this process: the kvscale config of the engine whose worker loaded last (weakly: a
#: finished engine is not kept alive) and a count of the scale changes noted
#: (``note_local``); a scheduler here refreshes its connector's state when it differs.
_LOCAL: list[Any] = [None, 0]


def note_local(cfg: Any) -> None:
    """After a load or update in this process's worker that changed what its caches are
    written with (``prefixcache.note_scales`` decides; the first load counts)."""
    _LOCAL[0] = weakref.ref(cfg)
    _LOCAL[1] += 1


_SEEN = "_kvscale_local_state_seen"


def refresh_local(scheduler: Any) -> None:
    """Before a step: a scheduler beside its worker (in-process, SPMD) takes the worker's
    state when it changed since it last looked (computed then, not at every update)."""
    connector = scheduler_connector(scheduler)
    cfg = _LOCAL[0]() if _LOCAL[0] is not None else None
    if connector is None or cfg is None or getattr(connector, _SEEN, None) == _LOCAL[1]:
        return
    setattr(connector, _SEEN, _LOCAL[1])
    connector.kvscale_set_state(merge([layers_part(cfg.attention_layers())]))
