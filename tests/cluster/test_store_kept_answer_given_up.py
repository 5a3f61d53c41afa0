"""A keyed call sent again while its first attempt waits for its record to reach the
cluster store (``journal = "store"``): the owner finds its kept answer and waits for
the same write. When that write is given up (the store cannot be reached until the
owner's lease may have ended: the pool is given up here, its next owner rebuilds it
from the store without the record), the copy must be told UNAVAILABLE as the first
attempt is, never the kept answer: that answer names blocks the next owner does not
hold and will hand to another request.

Found by tests/cluster/test_cluster_crash_points.py's hunt; here with real processes:
the owner reaches etcd through a TCP proxy the test cuts, and the two attempts are the
same request bytes (one idempotency key) sent on a raw gRPC stub."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import durable_server
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, placed, store_replica_config, wait_members

#: r0's lease (s): its store write is retried this long, while its copy comes in
LEASE = 6


@dataclass
class R0BehindProxy:
    """Two replicas of ``journal = "store"`` in one cluster: r0 reaches etcd through
    ``proxy`` (the test cuts it), r1 directly; ``pool`` is placed on r0 and made."""

    proxy: Proxy
    r0: ServerProcess
    r1: ServerProcess
    pool: str

    @property
    def targets(self) -> list[str]:
        return [self.r0.address, self.r1.address]

    def logs(self) -> str:
        return self.r0.log() + self.r1.log()

    def first_allocation(self) -> tuple[Any, Any]:
        """A session attached to the pool and its first allocation (request "a", 8 tokens)
        answered: (session, allocate answer), the pool's stream written in the store."""
        with KVCoordClient(self.targets, timeout=10.0) as c:
            s = c.attach(self.pool, "sha256_cbor", 4, "0", lease_seconds=120)
            first = c.allocate(self.pool, allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
        assert not first.result.refused
        return s, first

    def held(self) -> dict[str, list[int]]:
        """request -> its blocks, as whoever serves the pool next (rebuilt from the store) holds them."""
        return inspected_when_served(self.targets, self.pool, self.logs)


@contextmanager
def two_replicas_r0_behind_proxy(
    etcd: Etcd,
    tmp_path: Path,
    cluster: str,
    pool_prefix: str,
    *,
    r0_lease: int = LEASE,
    before_r0: Callable[[], None] = lambda: None,
) -> Iterator[R0BehindProxy]:
    """r1 (lease 2 s), then r0 (``r0_lease``; ``before_r0`` runs first, e.g. to give r0
    alone a ``sitecustomize`` hook), both members; a pool named ``pool_prefix``+n placed on
    r0 and made. Everything stopped and closed on leaving."""
    proxy = Proxy(etcd.endpoint)
    started: list[ServerProcess] = []
    try:
        r1 = start_server(
            store_replica_config(etcd.endpoint, "r1", tmp_path / "r1", cluster), env=durable_server.env()
        )
        started.append(r1)
        before_r0()
        r0 = start_server(
            store_replica_config(proxy.address, "r0", tmp_path / "r0", cluster, r0_lease),
            env=durable_server.env(),
        )
        started.append(r0)
        wait_members([r0, r1], ["r0", "r1"])
        pool = placed(pool_prefix, "r0", ["r0", "r1"])
        with KVCoordClient([r0.address, r1.address], timeout=10.0) as c:
            c.create_pool(pool, POOL_CONFIG)
        yield R0BehindProxy(proxy, r0, r1, pool)
    finally:
        for proc in started:
            proc.stop()
        proxy.close()


def sent_twice_while_cut(proxy: Proxy, address: str, method: str, request: Any) -> list[Any]:
    """``request`` sent to ``address`` by a raw stub's ``method`` (no retry), then the same
    bytes again 0.5 s later (applied, its answer kept, its record waiting for the store),
    with r0's way to etcd cut (its store write retries until its lease may have ended):
    each call's answer or its ``grpc.RpcError``."""
    with grpc.insecure_channel(address) as channel:
        call = getattr(pb_grpc.AllocatorStub(channel), method)
        proxy.cut()
        try:
            attempt = call.future(request, timeout=60)
            time.sleep(0.5)
            again = call.future(request, timeout=60)
            outcomes: list[Any] = []
            for future in (attempt, again):
                try:
                    outcomes.append(future.result())
                except grpc.RpcError as exc:
                    outcomes.append(exc)
            return outcomes
        finally:
            proxy.heal()


def inspected_when_served(targets: list[str], pool: str, logs: Callable[[], str]) -> dict[str, list[int]]:
    """request -> its blocks, as whoever serves ``pool`` next (rebuilt from the store) holds them."""
    with KVCoordClient(targets, timeout=10.0) as c:
        deadline = time.monotonic() + 60
        while True:
            try:
                view = c.inspect_pool(pool, all_requests=True)
                break
            except Exception:  # noqa: BLE001 - the pool changing owner: asked again
                assert time.monotonic() < deadline, logs()
                time.sleep(0.2)
    return {r.request_id: list(r.groups[0].block_ids) for r in view.requests}


def test_a_copy_of_a_call_whose_store_write_is_given_up_is_not_told_the_kept_answer(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with two_replicas_r0_behind_proxy(etcd, tmp_path, request.node.name[:40], "k") as two:
        s, first = two.first_allocation()
        step = pb.StepRequest(
            pool=two.pool, session_id=s.session_id, fence=first.fence, idempotency_key="the-one-key",
            call_sequence=time.time_ns(), ops=[pb.Operation(allocate=allocate("b", list(range(100, 108)), 8).allocate)],
        )  # fmt: skip
        outcomes = sent_twice_while_cut(two.proxy, two.r0.address, "Step", step)
        assert isinstance(outcomes[0], grpc.RpcError), outcomes[0]
        assert outcomes[0].code() == grpc.StatusCode.UNAVAILABLE, outcomes[0]
        held = two.held()
        assert held.get("a") == list(first.result.new_block_ids[0].block_ids), held
        told = outcomes[1]
        if not isinstance(told, grpc.RpcError):
            blocks = list(told.results[0].allocate.new_block_ids[0].block_ids)
            assert held.get("b") == blocks, (
                f"the copy was told b holds {blocks}, the pool's next owner holds {held}\n{two.r0.log()}"
            )
        else:
            assert told.code() == grpc.StatusCode.UNAVAILABLE, told
