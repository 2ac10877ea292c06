"""Which KV connector's store kvscale's prefix-cache reset clears too (pure logic: the
scheduler here only records the call; the engine-level behaviour is tested on real
engines in tests/e2e/test_vllm_kv_connectors.py)."""

from __future__ import annotations

from kvscale_plugin.hosts.vllm import prefixcache
from kvscale_plugin.hosts.vllm.connectors import KVScaleHandshake, _ScaleStateMixin


class OffloadingConnector:  # the name vLLM's CPU-offloading connector has
    pass


class _Ours(_ScaleStateMixin):
    pass


class _Scheduler:
    def __init__(self, connector, *, takes_reset_connector=True):
        self.connector = connector
        self.calls: list[dict] = []
        if not takes_reset_connector:  # vLLM before reset_connector
            self.reset_prefix_cache = self._old_reset  # type: ignore[method-assign]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        called = {"reset_running_requests": reset_running_requests}
        if reset_connector:
            called["reset_connector"] = reset_connector
        self.calls.append(called)
        return True

    def _old_reset(self, reset_running_requests=False):
        self.calls.append({"reset_running_requests": reset_running_requests})
        return True


def test_a_store_keyed_by_block_hashes_only_is_cleared_with_the_prefix_cache() -> None:
    scheduler = _Scheduler(OffloadingConnector())
    assert prefixcache.connector_to_reset(scheduler) == "OffloadingConnector"
    prefixcache.mark_pending(scheduler, "2 layers")
    assert prefixcache._try_reset(scheduler)
    assert scheduler.calls == [{"reset_running_requests": True, "reset_connector": True}]


def test_kvscale_connectors_and_no_connector_keep_their_stores() -> None:
    for connector in (None, _Ours()):
        scheduler = _Scheduler(connector)
        assert prefixcache.connector_to_reset(scheduler) is None
        prefixcache.mark_pending(scheduler, "2 layers")
        assert prefixcache._try_reset(scheduler)
        assert scheduler.calls == [{"reset_running_requests": True}]


def test_a_vllm_without_reset_connector_is_called_as_before() -> None:
    scheduler = _Scheduler(OffloadingConnector(), takes_reset_connector=False)
    assert prefixcache.connector_to_reset(scheduler) is None
    prefixcache.mark_pending(scheduler, "2 layers")
    assert prefixcache._try_reset(scheduler)
    assert scheduler.calls == [{"reset_running_requests": True}]


def test_the_handshake_hands_the_wrapped_connector_its_own_metadata() -> None:
    got = []

    class Base:
        def set_xfer_handshake_metadata_pp_aware(self, metadata):
            got.append(metadata)

    class Connector(_ScaleStateMixin, Base):
        pass

    part = ({"model.layers.0.self_attn.attn": ((0.5,), (0.25,), None)}, True)
    connector = Connector()
    connector.set_xfer_handshake_metadata_pp_aware(
        {(0, 0): KVScaleHandshake(part, "nixl-0"), (0, 1): KVScaleHandshake(part, "nixl-1")}
    )
    assert got == [{(0, 0): "nixl-0", (0, 1): "nixl-1"}]
    assert connector.kvscale_state is not None and connector.kvscale_state.applied
    # A connector with no metadata of its own (vLLM would not call it): not called.
    Connector().set_xfer_handshake_metadata_pp_aware({(1, 0): KVScaleHandshake(part, None)})
    assert len(got) == 1
