"""A handler's store call made after the replica's cluster stopped under it
(Cluster.stop: the lease revoked, the store client closed; a replica's stop, or a
start whose join failed while the listener already took calls). The call must be
answered UNAVAILABLE naming the stop (the client retries another replica, and takes a
mutation's outcome for unknown), never INTERNAL, which a client cannot tell from a bug.

It was INTERNAL: the stopped cluster's client was None, and the handler's next store
call failed with AttributeError. The case: AdoptPool (a handover's new owner) loads and
journals the state, and waits for its local commit (a slow disk: the journal's writes
held in the test's process) while the cluster stops; then it swaps the claim.

A real replica (journal = "store", real gRPC) and a real etcd."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import cbor2
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import AsyncKVCoordClient
from kvcoord.service import journal
from kvcoord.service.ownership import encode_claim
from kvcoord.service.registry_state import dump_pool
from kvcoord.service.server import start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from test_replicas import POOL_CONFIG, in_process_store_replica

#: a bound on every wait here, not a measurement
BOUND = 30.0
#: no lease ends while the test holds the disk
LEASE = 30


def test_an_adopt_whose_claim_swap_comes_after_the_cluster_stopped_is_unavailable(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    address, cfg = in_process_store_replica(etcd.endpoint, request.node.name[:40], tmp_path, LEASE)
    slow = threading.Event()  # set: the journal's next write waits for ``go``
    held = threading.Event()
    go = threading.Event()
    real = journal.JournalStore.write

    def write(self: Any, records: Any, chunk: Any = None) -> None:
        if slow.is_set():
            slow.clear()
            held.set()
            go.wait(BOUND)
        real(self, records, chunk)

    monkeypatch.setattr(journal.JournalStore, "write", write)

    async def run() -> None:
        running = await start_server(cfg)
        cluster = running.cluster
        assert cluster is not None
        registry = running.servicer.registry
        owners = cluster.key("owners", "a")
        try:
            async with AsyncKVCoordClient(address, timeout=20.0) as c:
                await c.create_pool("a", POOL_CONFIG)
                state = cbor2.dumps(dump_pool(registry, "a", leases=True))  # what a sender sends
                await c.delete_pool("a")
            # the pool is another replica's (a member gone from the view: placement then names this one)
            await cluster.client.put(owners, encode_claim("gone", "127.0.0.1:9"))
            await cluster.client.put(cluster.key("pools", "a"), b"")
            await cluster.refresh()
            revision = cluster.view.term("a")
            adopt = pb.AdoptPoolRequest(pool="a", state=state, from_replica="gone", claim_revision=revision)
            async with grpc.aio.insecure_channel(address) as channel:
                slow.set()
                call = asyncio.ensure_future(pb_grpc.ReplicasStub(channel).AdoptPool(adopt, timeout=BOUND))
                for _ in range(int(BOUND / 0.05)):  # bounded: the adopt record's write is held
                    if held.is_set() or call.done():
                        break
                    await asyncio.sleep(0.05)
                assert held.is_set(), call
                await cluster.stop()  # the cluster stops while the handler waits for its disk
                go.set()
                with pytest.raises(grpc.aio.AioRpcError) as failed:
                    await call
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value  # (was: INTERNAL)
            assert "stopping" in (failed.value.details() or ""), failed.value.details()
        finally:
            go.set()
            await running.stop(grace=0)

    asyncio.run(run())
