"""Replicas sharing pools through a real etcd: membership, claims, NOT_OWNER redirects,
the catalog, and a restart that claims its journal's pools again (real processes,
real gRPC)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from durable_server import env, free_port
from etcd_process import Etcd
from kvcoord.client import (
    NO_RETRY,
    KVCoordClient,
    NotFoundError,
    NotOwnerError,
    OwnerGoneError,
    UnavailableError,
)
from kvcoord.client.errors import error_from_rpc
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.config import ServerConfig, parse_config
from kvcoord.service.ownership import Member, decode_claim, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate

POOL_CONFIG = pb.PoolConfig(
    num_blocks=64, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
)  # fmt: skip


def replica_config(
    etcd: Etcd | str,
    replica: str,
    data_dir: Path,
    cluster: str,
    server_lines: str = "",
    cluster_lines: str = "",
    *,
    lease: int = 2,
    store_timeout: float = 2.0,
    grace: float = 5.0,
) -> str:
    """A replica's config; ``etcd``: the module's etcd or the address it is reached at (a
    proxy's); ``server_lines`` / ``cluster_lines``: more settings of either table."""
    endpoint = etcd if isinstance(etcd, str) else etcd.endpoint
    return (
        f'[server]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\nlog_level = "INFO"\n'
        f"grace_seconds = {grace}\n{server_lines}"
        f'[cluster]\nendpoints = ["{endpoint}"]\nname = "{cluster}"\nreplica_id = "{replica}"\n'
        f"lease_seconds = {lease}\nstore_timeout_seconds = {store_timeout}\n{cluster_lines}"
    )


def store_replica_config(endpoint: str, replica: str, data_dir: Path, cluster: str, lease: int = 2) -> str:
    """A replica of ``journal = "store"`` reaching etcd at ``endpoint`` (a proxy's, to cut),
    giving a store write up after 1 s, with the server's default grace."""
    return replica_config(
        endpoint, replica, data_dir, cluster, cluster_lines='journal = "store"\n',
        lease=lease, store_timeout=1.0, grace=10.0,
    )  # fmt: skip


def in_process_store_replica(
    endpoint: str, name: str, data_dir: Path, lease: int, grace: float = 10.0
) -> tuple[str, ServerConfig]:
    """The address and config of a replica r0 started in the test's process (service
    start_server), journal = "store", on a free port."""
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(
        f'[server]\nlisten = ["{address}"]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\n'
        f"grace_seconds = {grace}\n"
        f'[cluster]\nendpoints = ["{endpoint}"]\nname = "{name}"\nreplica_id = "r0"\n'
        f'lease_seconds = {lease}\nstore_timeout_seconds = 2.0\njournal = "store"\n'
    )
    return address, cfg


def placed(pool_prefix: str, replica: str, ids: list[str]) -> str:
    """A pool name rendezvous hashing places on ``replica`` among ``ids``."""
    members = [Member(i, "") for i in ids]
    return next(
        f"{pool_prefix}{n}"
        for n in range(1000)
        if owner_of(f"{pool_prefix}{n}", members).replica_id == replica  # type: ignore[union-attr]
    )


def placed_many(pool_prefix: str, replica: str, ids: list[str], count: int) -> list[str]:
    """``count`` pool names rendezvous hashing places on ``replica`` among ``ids``."""
    members = [Member(i, "") for i in ids]
    names = (f"{pool_prefix}{n}" for n in range(1000))
    out = [n for n in names if owner_of(n, members).replica_id == replica][:count]  # type: ignore[union-attr]
    assert len(out) == count, f"fewer than {count} pool names placed on {replica}"
    return out


async def _claims(etcd: Etcd, cluster: str) -> dict[str, str]:
    import aetcd

    host, _, port = etcd.endpoint.rpartition(":")
    async with aetcd.Client(host=host, port=int(port), timeout=5) as c:
        prefix = f"/kvcoord/{cluster}/owners/".encode()
        rows = await c.get_prefix(prefix)
        return {
            kv.key[len(prefix) :].decode(): decode_claim("", kv.value, kv.create_revision).replica_id
            for kv in rows
        }


def claims(etcd: Etcd, cluster: str) -> dict[str, str]:
    return asyncio.run(_claims(etcd, cluster))


def owned_gauge(server: ServerProcess) -> dict[tuple[str, str], float]:
    """kvcoord_pool_owned from the replica's /metrics: (pool, replica) -> value."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as r:
        body = r.read().decode()
    return {
        (s.labels["pool"], s.labels["replica"]): s.value
        for f in text_string_to_metric_families(body)
        if f.name == "kvcoord_pool_owned"
        for s in f.samples
    }


def wait_members(
    procs: list[ServerProcess],
    ids: list[str],
    timeout: float = 30.0,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Until every replica's view has every member: each redirects a (nonexistent)
    pool placed on another replica instead of calling it unknown (``credentials``:
    the channel's, for replicas serving TLS)."""
    deadline = time.monotonic() + timeout
    for i, proc in enumerate(procs):
        probe = placed("probe-", ids[(i + 1) % len(ids)], ids)
        channel = (
            grpc.insecure_channel(proc.address)
            if credentials is None
            else grpc.secure_channel(proc.address, credentials)
        )
        with channel as ch:
            stub = pb_grpc.AllocatorStub(ch)
            while True:
                try:
                    stub.GetPool(pb.GetPoolRequest(name=probe), timeout=5)
                except grpc.RpcError as exc:
                    if isinstance(error_from_rpc(exc), NotOwnerError):
                        break
                assert time.monotonic() < deadline, f"replica {ids[i]} does not see every member"
                time.sleep(0.05)


@pytest.fixture
def two(etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    cluster = request.node.name.replace("[", "-").replace("]", "")
    procs: list[ServerProcess] = []
    try:
        for r in ("r0", "r1"):
            procs.append(
                start_server(replica_config(etcd, r, tmp_path / r, cluster), env=env(), metrics=True)
            )
        wait_members(procs, ["r0", "r1"])
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_a_replica_redirects_to_the_owner_and_serves_only_what_it_claims(
    etcd: Etcd, two: list[ServerProcess], request: pytest.FixtureRequest
) -> None:
    r0, r1 = two
    cluster = request.node.name
    pool = placed("p", "r1", ["r0", "r1"])
    with grpc.insecure_channel(r0.address) as ch0, KVCoordClient(r1.address) as c1:
        s0 = pb_grpc.AllocatorStub(ch0)  # the bare wire: a KVCoordClient follows redirects
        calls = (
            lambda: s0.CreatePool(pb.CreatePoolRequest(name=pool, config=POOL_CONFIG), timeout=5),
            lambda: s0.GetPool(pb.GetPoolRequest(name=pool), timeout=5),
            lambda: s0.Attach(pb.AttachRequest(pool=pool, hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"), timeout=5),
        )  # fmt: skip
        for i, call in enumerate(calls):
            with pytest.raises(grpc.RpcError) as raw:
                call()
            err = error_from_rpc(raw.value)
            assert isinstance(err, NotOwnerError) and err.code == grpc.StatusCode.FAILED_PRECONDITION
            assert err.owner == r1.address and "r1" in err.message
            if i == 0:
                created = c1.create_pool(pool, POOL_CONFIG)
                assert created.created and created.pool.replica == "r1"
                assert claims(etcd, cluster) == {pool: "r1"}
        assert [p.name for p in c1.list_pools().pools] == [pool]
        assert list(s0.ListPools(pb.ListPoolsRequest(), timeout=5).pools) == []
    # r1 dies (SIGKILL: no handover): its claim goes with its lease; the pool still
    # exists in the cluster, so the replica placement now names answers UNAVAILABLE,
    # never NOT_FOUND, and never creates it again empty
    r1.proc.kill()
    r1.proc.wait(10)
    deadline = time.monotonic() + 20
    while claims(etcd, cluster) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert claims(etcd, cluster) == {}
    with KVCoordClient(r0.address, timeout=2.0) as c0:
        c0.retry = c0.retry.__class__(max_attempts=1)
        with pytest.raises(UnavailableError, match="no live replica holds it"):
            c0.get_pool(pool)
        with pytest.raises(UnavailableError, match="no live replica holds it"):
            c0.create_pool(pool, POOL_CONFIG)


def test_deleting_a_pool_whose_owner_is_gone_is_refused_for_sure_until_it_is_back(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """Local journals: a pool whose owner died holds its state on that replica's disk
    only. DeletePool through the replica set is refused with a definite OWNER_GONE
    (never an unknown outcome), nothing deleted: once the owner is back the pool is
    there with its allocation, and deleting it then works."""
    cluster = request.node.name
    pool = placed("g", "r1", ["r0", "r1"])
    texts = {r: replica_config(etcd, r, tmp_path / r, cluster) for r in ("r0", "r1")}
    procs = {r: start_server(texts[r], env=env()) for r in ("r0", "r1")}
    try:
        wait_members(list(procs.values()), ["r0", "r1"])
        targets = [procs["r0"].address, procs["r1"].address]
        with KVCoordClient(targets) as c:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0")
            got = c.allocate(pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
            blocks = list(got.result.new_block_ids[0].block_ids)
        procs["r1"].proc.kill()  # SIGKILL: no handover
        procs["r1"].stop()
        deadline = time.monotonic() + 20
        while claims(etcd, cluster) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert claims(etcd, cluster) == {}
        with KVCoordClient(targets, timeout=2.0) as c:
            with pytest.raises(OwnerGoneError, match="was not deleted") as refused:
                c.delete_pool(pool)
            assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        procs["r1"] = start_server(texts["r1"], startup_timeout=60.0, env=env())
        targets[1] = procs["r1"].address
        assert claims(etcd, cluster) == {pool: "r1"}
        with KVCoordClient(targets) as c:
            view = c.inspect_pool(pool, request_ids=["a"])
            assert [list(g.block_ids) for g in view.requests[0].groups] == [blocks]
            c.delete_pool(pool)
            with pytest.raises(NotFoundError):
                c.get_pool(pool)
    finally:
        for p in procs.values():
            p.stop()


def test_a_replica_leaving_hands_its_pools_over(
    etcd: Etcd, two: list[ServerProcess], request: pytest.FixtureRequest
) -> None:
    r0, r1 = two
    pool = placed("q", "r1", ["r0", "r1"])
    with KVCoordClient([r0.address, r1.address]) as c:
        c.create_pool(pool, POOL_CONFIG)
        s = c.attach(pool, "sha256_cbor", 4, "0")
        got = c.allocate(pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
        blocks = list(got.result.new_block_ids[0].block_ids)
    assert owned_gauge(r1) == {(pool, "r1"): 1.0} and owned_gauge(r0) == {}
    assert r1.stop() == 0  # SIGTERM: the pool goes to r0 with its state
    assert claims(etcd, request.node.name) == {pool: "r0"}
    assert owned_gauge(r0) == {(pool, "r0"): 1.0}
    with KVCoordClient(r0.address) as c:
        assert c.get_pool(pool).pool.replica == "r0"
        view = c.inspect_pool(pool, request_ids=["a"])
        assert [list(g.block_ids) for g in view.requests[0].groups] == [blocks]
        c.heartbeat(s.session_id, s.fence)  # the session moved with the pool
        # answers name the pool's term, which grew with the new owner; a caller answered
        # under a newer term than a replica holds finds that replica deposed
        after = c.allocate(pool, allocate("b", list(range(50, 59)), 9).allocate, s.session_id, s.fence)
        assert after.fence.term > got.fence.term > 0
        newer = pb.Fence()
        newer.CopyFrom(after.fence)
        newer.term = after.fence.term + 1
        c.retry = NO_RETRY
        with pytest.raises(UnavailableError, match="newer owner"):
            c.allocate(pool, allocate("c", list(range(70, 79)), 9).allocate, s.session_id, newer)


def test_a_restarted_replica_claims_its_journals_pools_and_keeps_their_allocations(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    cluster = request.node.name
    text = replica_config(etcd, "solo", tmp_path / "solo", cluster)
    server = start_server(text, env=env())
    try:
        with KVCoordClient(server.address) as c:
            c.create_pool("kept", POOL_CONFIG)
            s = c.attach("kept", "sha256_cbor", 4, "0")
            got = c.allocate("kept", allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
            blocks = list(got.result.new_block_ids[0].block_ids)
            assert len(blocks) == 3
        server.proc.kill()  # SIGKILL: the lease (2 s) still holds the claim for a while
        server.proc.wait(10)
        server.stop()
        server = start_server(text, startup_timeout=60.0, env=env())
        assert claims(etcd, cluster) == {"kept": "solo"}
        with KVCoordClient(server.address) as c:
            view = c.inspect_pool("kept", request_ids=["a"])
            assert [list(g.block_ids) for g in view.requests[0].groups] == [blocks]
    finally:
        server.stop()


@pytest.fixture
def three(etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    cluster = request.node.name
    procs: list[ServerProcess] = []
    try:
        for r in ("r0", "r1", "r2"):
            procs.append(start_server(replica_config(etcd, r, tmp_path / r, cluster), env=env()))
        wait_members(procs, ["r0", "r1", "r2"])
        yield procs
    finally:
        for p in procs:
            p.stop()


def test_a_client_given_one_replica_reaches_every_pool_through_redirects(three: list[ServerProcess]) -> None:
    ids = ["r0", "r1", "r2"]
    address = dict(zip(ids, (p.address for p in three), strict=True))
    pools = {f"{r}-{k}": placed(f"{r}-{k}-", r, ids) for r in ids for k in range(2)}
    with KVCoordClient(three[0].address) as c:
        for label, pool in pools.items():
            replica = label.split("-")[0]
            created = c.create_pool(pool, POOL_CONFIG)
            assert created.created and created.pool.replica == replica
        for pool in pools.values():
            s = c.attach(pool, "sha256_cbor", 4, "0")
            got = c.allocate(pool, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)
            assert len(got.result.new_block_ids[0].block_ids) == 3
            c.heartbeat(s.session_id, s.fence)  # names only the session: routed by its pool
            c.free(pool, ["a"], session_id=s.session_id, fence=s.fence)
            c.detach(s.session_id, s.fence)
        assert {p: c.routes.owner[p] for p in pools.values()} == {
            pool: address[label.split("-")[0]] for label, pool in pools.items()
        }
    with KVCoordClient([p.address for p in three]) as everywhere:
        listed = {info.name: info.replica for info in everywhere.list_pools().pools}
    assert listed == {pool: label.split("-")[0] for label, pool in pools.items()}


def test_status_over_the_replica_set_names_each_pools_replica(three: list[ServerProcess]) -> None:
    """`kvcoord --target a,b,c status` asks every replica: each pool once, with the
    replica serving it (REPLICA column; "replica" in --json), and its live statistics."""
    import json
    import subprocess
    import sys

    ids = ["r0", "r1", "r2"]
    pools = {placed(f"st-{r}-", r, ids): r for r in ids}
    targets = ",".join(p.address for p in three)
    with KVCoordClient(targets) as c:
        for pool in pools:
            c.create_pool(pool, POOL_CONFIG)
        first = next(iter(pools))
        s = c.attach(first, "sha256_cbor", 4, "0")
        c.allocate(first, allocate("a", list(range(9)), 9).allocate, s.session_id, s.fence)

    def kvcoord(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kvcoord.client.cli", *args, "--target", targets],
            capture_output=True, text=True, env=env(), timeout=60,
        )  # fmt: skip

    out = kvcoord("status", "--json")
    assert out.returncode == 0, out.stderr
    rows = {r["pool"]: r for r in json.loads(out.stdout)["pools"]}
    assert {p: r["replica"] for p, r in rows.items()} == pools
    assert rows[first]["live_requests"] == 1 and rows[first]["sessions"] == 1
    text = kvcoord("status")
    assert text.returncode == 0, text.stderr
    header, *lines = text.stdout.splitlines()
    assert header.split()[-1] == "REPLICA"
    assert {line.split()[0]: line.split()[-1] for line in lines} == pools


def test_the_asyncio_client_follows_redirects_too(three: list[ServerProcess]) -> None:
    from kvcoord.client import AsyncKVCoordClient

    pool = placed("async-", "r2", ["r0", "r1", "r2"])

    async def run() -> tuple[str, str]:
        async with AsyncKVCoordClient(three[0].address) as c:
            created = await c.create_pool(pool, POOL_CONFIG)
            got = await c.get_pool(pool)
            return created.pool.replica, got.pool.replica

    assert asyncio.run(run()) == ("r2", "r2")


def test_a_replica_that_cannot_reach_the_store_does_not_start(tmp_path: Path) -> None:
    """No etcd at the endpoint: `kvcoord serve` exits 3 with one line naming it."""
    import subprocess
    import sys

    from durable_server import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    config = tmp_path / "c.toml"
    config.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\nmetrics_listen = ""\ndata_dir = "{tmp_path / "d"}"\n'
        f'[cluster]\nendpoints = ["{endpoint}"]\nreplica_id = "x"\nstore_timeout_seconds = 1.0\n'
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(config)],
        capture_output=True, text=True, env=env(), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert f"no cluster store endpoint answers ({endpoint})" in proc.stdout + proc.stderr
