"""An owner's address taken by another server (real replica processes, real etcd, real
gRPC): a replica holding a pool is SIGKILLed and a server of no cluster, with a pool of
the same name, starts at its address (a recycled pod IP, a port given out again) while
the dead owner's claim still names that address. The client that worked with the owner
never attaches to, allocates from or reads that other pool: every call reaching it is
refused WRONG_REPLICA before it is read, and once the owner is back (at a new address)
the client finds its pool there, with its allocation."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError, RetryPolicy, WrongReplicaError
from kvcoord.client.testing import ServerProcess, start_server
from service.helpers import allocate
from test_replicas import POOL_CONFIG, placed, replica_config, wait_members

#: the dead owner's claim outlives it this long: the other replicas name its address meanwhile
LEASE = 10


def test_a_server_at_a_dead_owners_address_is_never_taken_for_it(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name
    pool = placed("taken", "r1", ["r0", "r1"])
    configs = {r: replica_config(etcd, r, tmp_path / r, cluster, lease=LEASE) for r in ("r0", "r1")}
    procs: dict[str, ServerProcess] = {r: start_server(configs[r], env=env()) for r in ("r0", "r1")}
    other: ServerProcess | None = None
    try:
        wait_members(list(procs.values()), ["r0", "r1"])
        dead = procs["r1"].address
        with KVCoordClient(procs["r0"].address, timeout=5.0) as c:  # r1 only through r0's redirects
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0")
            got = c.allocate(pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
            blocks = list(got.result.new_block_ids[0].block_ids)
            assert c.routes.route(pool) == dead and c.routes.named[dead] == f"{cluster}/r1"
            direct = KVCoordClient(  # the owner first: no redirect (keyed calls given up after 5 s)
                [dead, procs["r0"].address], timeout=5.0, retry=RetryPolicy(keyed_deadline=5.0)
            )
            d = direct.attach(pool, "sha256_cbor", 4, "0")  # (its answer names the replica that gave it)
            assert direct.routes.named == {dead: f"{cluster}/r1"}
            with KVCoordClient(procs["r0"].address, cluster=cluster) as seeded:  # cluster/* accepted
                assert seeded.get_stats(pool).num_requests == 1

            procs["r1"].proc.kill()  # SIGKILL: its claim (lease 10 s) still names its address
            procs["r1"].proc.wait(10)
            procs["r1"].stop()
            other = start_server(None, env=env(), extra_args=["--listen", dead])  # (and a port of its own)
            with KVCoordClient(dead) as o:
                o.create_pool(pool, POOL_CONFIG)  # the same name, another server's pool

            # the owner's address (refused there), then r0, whose view still names it (a
            # redirect there, refused again), until the call gives up: never served there
            with pytest.raises(KVCoordError):
                c.get_stats(pool)
            with pytest.raises(KVCoordError):
                c.attach(pool, "sha256_cbor", 4, "0")
            with pytest.raises(KVCoordError):  # a client that never followed a redirect there
                direct.get_stats(pool)
            with pytest.raises(KVCoordError):
                direct.allocate(pool, allocate("d", list(range(5)), 5).allocate, d.session_id, d.fence)
            direct.close()
            with KVCoordClient([dead, procs["r0"].address], cluster=cluster, retry=NO_RETRY) as fresh:
                with pytest.raises(KVCoordError):  # its first call: to an address never answered from
                    fresh.get_stats(pool)
                assert fresh.routes.route(pool) != dead  # (refused there: asked elsewhere)
            with KVCoordClient(dead, retry=NO_RETRY) as named:
                named.routes.named[dead] = f"{cluster}/r1"  # as a redirect named it
                with pytest.raises(WrongReplicaError):
                    named.get_stats(pool)
            with KVCoordClient(dead) as o:  # nothing reached the other pool
                stats = o.get_stats(pool)
                assert (stats.num_sessions, stats.num_requests) == (0, 0)

            # the owner back, at another address (its journal has the pool)
            procs["r1"] = start_server(configs["r1"], env=env(), startup_timeout=60.0)
            assert procs["r1"].address != dead
            deadline = time.monotonic() + 60
            while True:
                try:
                    view = c.inspect_pool(pool, request_ids=["a"])
                    break
                except KVCoordError:
                    assert time.monotonic() < deadline, "the pool was not served again within 60 s"
                    time.sleep(0.2)
            assert [list(g.block_ids) for g in view.requests[0].groups] == [blocks]
            assert c.routes.route(pool) == procs["r1"].address
    finally:
        for p in [*procs.values(), *([other] if other is not None else [])]:
            p.stop()


def test_a_patient_call_waits_through_the_other_server_for_its_owner(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A keyed call whose retries outlast the outage (a worker's Step) is refused by the
    other server, asked again elsewhere, and applied once at the owner when it is back."""
    cluster = request.node.name
    pool = placed("kept", "r1", ["r0", "r1"])
    configs = {r: replica_config(etcd, r, tmp_path / r, cluster, lease=LEASE) for r in ("r0", "r1")}
    procs: dict[str, ServerProcess] = {r: start_server(configs[r], env=env()) for r in ("r0", "r1")}
    other: ServerProcess | None = None
    patient = RetryPolicy(max_attempts=400, max_backoff=0.5, deadline=120.0)
    try:
        wait_members(list(procs.values()), ["r0", "r1"])
        dead = procs["r1"].address
        with KVCoordClient(procs["r0"].address, timeout=5.0, retry=patient) as c:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0")
            procs["r1"].proc.kill()
            procs["r1"].proc.wait(10)
            procs["r1"].stop()
            other = start_server(None, env=env(), extra_args=["--listen", dead])
            with KVCoordClient(dead) as o:
                o.create_pool(pool, POOL_CONFIG)

            def back() -> None:
                time.sleep(3)  # the call meets the other server meanwhile
                procs["r1"] = start_server(configs["r1"], env=env(), startup_timeout=60.0)

            starter = threading.Thread(target=back)
            starter.start()
            try:
                got = c.allocate(pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
            finally:
                starter.join(90)
            assert len(got.result.new_block_ids[0].block_ids) == 3
            assert c.get_stats(pool).num_requests == 1
            with KVCoordClient(dead) as o:
                stats = o.get_stats(pool)
                assert (stats.num_sessions, stats.num_requests) == (0, 0)
    finally:
        for p in [*procs.values(), *([other] if other is not None else [])]:
            p.stop()


def test_calls_between_replicas_name_the_replica_they_are_meant_for() -> None:
    """A handover or a score fan-out goes to a member's address (a dead member's too,
    until its lease ends): it names the member (Cluster.metadata_for), and a server that
    is not that replica refuses it before adopting or scoring anything."""
    from types import SimpleNamespace

    from kvcoord.service.access import AccessControl
    from kvcoord.service.cluster import Cluster
    from kvcoord.service.cluster_placement import ReplicasServicer
    from kvcoord.service.errors import ErrorReason, ServiceError
    from kvcoord.service.ownership import Member
    from kvcoord.service.sessions import SessionTable

    cluster = Cluster(["127.0.0.1:1"], "k", Member("r0", "127.0.0.1:2"), 10, 1.0)
    cluster.peer_metadata = (("authorization", "Bearer root"),)
    sent = cluster.metadata_for("r1")
    assert sent == (("authorization", "Bearer root"), ("kvcoord-replica", "k/r1"))

    class Context:
        def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
            self.metadata = metadata

        def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
            return self.metadata

        def auth_context(self) -> dict[str, object]:
            return {}

    access = AccessControl((), ("root",), SessionTable(time.monotonic, 30.0, 300.0))
    for me, refused in (("k/r1", False), ("k/r2", True), ("other/r1", True)):
        peers = ReplicasServicer(SimpleNamespace(name=me), access, lambda pool: None)  # type: ignore[arg-type]
        if refused:
            with pytest.raises(ServiceError) as told:
                peers.between_replicas(Context(sent), "AdoptPoolParts")
            assert told.value.reason is ErrorReason.WRONG_REPLICA
        else:
            peers.between_replicas(Context(sent), "AdoptPoolParts")
    with pytest.raises(ServiceError, match="bearer token"):  # named right, without the token
        ReplicasServicer(SimpleNamespace(name="k/r1"), access, lambda pool: None).between_replicas(  # type: ignore[arg-type]
            Context((("kvcoord-replica", "k/r1"),)), "ScoreForTenant"
        )
