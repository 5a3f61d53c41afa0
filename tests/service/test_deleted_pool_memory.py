"""A deleted pool's memory is given back even when the server froze it out of the
cyclic garbage collector (``gc.freeze``: gc_freezer.GcFreezer, and a Step applied in
slices), over real gRPC."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer
from workload import pool_config


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """What the test freezes is unfrozen again for the tests after it."""
    try:
        yield
    finally:
        gc.unfreeze()


def test_a_deleted_pool_frozen_by_the_server_is_freed(unfrozen: None) -> None:
    server = InProcessServer().start()
    try:
        with KVCoordClient(server.address, timeout=10) as client:
            client.create_pool("q", pool_config(256, block_size=4, window=8))
            sid, fence = attach(client, "q")
            ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 30)), 30) for i in range(8)]
            assert [r.status_code for r in client.step("q", ops, sid, fence).results] == [0] * 8
            assert client.get_stats("q").num_free_blocks < 256  # blocks, requests, events exist

            def refs() -> tuple[weakref.ref[object], weakref.ref[object]]:
                service = server.running.servicer.registry.pools["q"]  # type: ignore[union-attr]
                return weakref.ref(service), weakref.ref(service.engine)

            service_ref, engine_ref = server.call(refs)
            # what the server's freezes do: everything alive now leaves the collector's view
            server.call(lambda: (gc.collect(1), gc.freeze()))
            client.delete_pool("q")
            server.settle()  # the sliced teardown has ended
            gc.collect()
            assert engine_ref() is None, "the deleted pool's engine is still alive"
            assert service_ref() is None, "the deleted pool's service is still alive"
            # the server goes on: another pool under the same name works
            client.create_pool("q", pool_config(256, block_size=4, window=8))
            sid, fence = attach(client, "q")
            r = client.step("q", [allocate("a", list(range(20)), 20)], sid, fence)
            assert r.results[0].status_code == 0
    finally:
        server.stop()
