"""A replica whose cluster lease ended (cut off from etcd past it) registers again
and only then reads the claims: between the two its lease is valid again while its
view still names it the holder of the claims that ended with its old lease. A pool
another replica took over from the store meanwhile must not be served there from the
old copy: an InspectPool answered then showed the state before the takeover (what
the new owner acknowledged since missing, what it freed still held), as the cluster
crash-point harness's check saw (tests/cluster/test_cluster_crash_points.py).

Real processes: r0 reaches etcd through a TCP proxy the test cuts past r0's lease;
r1 takes the pool over and allocates in it; once healed, r0's registering again is
followed by a 3 s pause (a ``sitecustomize`` hook: a slow store answer to the read of
the claims), during which r0 is asked for the pool."""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, placed, store_replica_config, wait_members

#: once FLAG exists, registering again (a lease that ended) is followed by 3 s before
#: anything else (the claims are read after it)
_SLOW_REJOIN = """
import asyncio
import os

from kvcoord.service import cluster_store

_real = cluster_store.ClusterStore.register


async def _register(self):
    await _real(self)
    if os.path.exists({flag!r}):
        os.unlink({flag!r})
        await asyncio.sleep(3.0)


cluster_store.ClusterStore.register = _register
"""


def test_a_replica_back_from_a_cut_does_not_serve_its_old_copy_of_a_pool_taken_over(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = request.node.name[:40]
    flag = tmp_path / "slow"
    proxy = Proxy(etcd.endpoint)
    r1 = start_server(
        store_replica_config(etcd.endpoint, "r1", tmp_path / "r1", cluster), env=durable_server.env()
    )
    durable_server.with_sitecustomize(tmp_path, _SLOW_REJOIN.format(flag=str(flag)), monkeypatch)
    r0 = start_server(
        store_replica_config(proxy.address, "r0", tmp_path / "r0", cluster), env=durable_server.env()
    )
    try:
        wait_members([r0, r1], ["r0", "r1"])
        pool = placed("s", "r0", ["r0", "r1"])
        with KVCoordClient([r0.address, r1.address], timeout=10.0) as c:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
            a = c.allocate(pool, allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
            assert not a.result.refused
        proxy.cut()  # r0 keeps its copy (nothing to write); its lease ends, r1 takes the pool over
        try:
            with KVCoordClient(r1.address, timeout=10.0) as c1:
                deadline = time.monotonic() + 60
                while pool not in {p.name for p in c1.list_pools().pools}:
                    assert time.monotonic() < deadline, r1.log()
                    time.sleep(0.2)
                b = c1.allocate(pool, allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
                assert not b.result.refused
            flag.touch()
        finally:
            proxy.heal()
        with grpc.insecure_channel(r0.address) as channel:
            stub = pb_grpc.AllocatorStub(channel)
            deadline = time.monotonic() + 60
            while flag.exists():  # r0 registered again: its view of the claims not read yet
                assert time.monotonic() < deadline, r0.log()
                time.sleep(0.02)
            try:
                view = stub.InspectPool(pb.InspectPoolRequest(pool=pool, all_requests=True), timeout=10)
            except grpc.RpcError as exc:  # redirected, or told to retry: never the old copy
                assert exc.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE), exc
            else:
                held = sorted(r.request_id for r in view.requests)
                assert held == ["a", "b"], (
                    f"r0 answered from its copy of before the takeover: {held}\n{r0.log()}"
                )
    finally:
        r0.stop()
        r1.stop()
        proxy.close()
