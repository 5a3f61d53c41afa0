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

import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import AsyncKVCoordClient
from kvcoord.service import journal
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from replica_here import owned_by_a_gone_replica, replica_here
from test_replicas import in_process_store_replica

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
        async with replica_here(cfg) as (running, cluster):
            try:
                async with AsyncKVCoordClient(address, timeout=20.0) as c:
                    adopt = await owned_by_a_gone_replica(c, running, cluster, "a")
                async with grpc.aio.insecure_channel(address) as channel:
                    slow.set()
                    call = asyncio.ensure_future(
                        pb_grpc.ReplicasStub(channel).AdoptPool(adopt, timeout=BOUND)
                    )
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

    asyncio.run(run())
