"""Pools move with their state when membership changes (real replica processes, real
etcd, real gRPC): a client allocates through the replica set while a replica joins and
another leaves (SIGTERM); after each move every live request holds exactly the blocks
it was acknowledged, and no block is held by two requests. Once with plaintext
replicas, once with replicas serving mutual TLS to tenants (the replicas dial each
other with TLS, a client certificate and the full-access token)."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.ownership import Member, owner_of
from service.helpers import allocate
from test_replicas import POOL_CONFIG, replica_config, wait_members


class Allocator(threading.Thread):
    """Allocates 2-block requests in every pool, round robin, freeing the oldest when a
    pool holds 12; remembers what each live request was acknowledged."""

    def __init__(
        self,
        targets: list[str],
        sessions: dict[str, tuple[str, object]],
        serial: list[int],
        **client: Any,
    ) -> None:
        super().__init__(daemon=True)
        self.client = KVCoordClient(targets, timeout=5.0, **client)
        self.sessions = sessions
        self.serial = serial
        self.acked: dict[str, dict[str, list[int]]] = {pool: {} for pool in sessions}
        self.stop_now = threading.Event()
        self.calls = 0
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stop_now.is_set():
                for pool, (sid, fence) in self.sessions.items():
                    held = self.acked[pool]
                    if len(held) >= 12:
                        oldest = next(iter(held))
                        self.client.free(pool, [oldest], session_id=sid, fence=fence)  # type: ignore[arg-type]
                        del held[oldest]
                    self.serial[0] += 1
                    rid = f"r{self.serial[0]}"
                    op = allocate(rid, list(range(self.serial[0], self.serial[0] + 8)), 8).allocate
                    got = self.client.allocate(pool, op, sid, fence)  # type: ignore[arg-type]
                    assert not got.result.refused
                    held[rid] = list(got.result.new_block_ids[0].block_ids)
                    self.calls += 1
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc

    def finish(self) -> None:
        self.stop_now.set()
        self.join(60)
        assert not self.is_alive()
        self.client.close()
        if self.error is not None:
            raise self.error


def check(
    targets: list[str], acked: dict[str, dict[str, list[int]]], placed: dict[str, str], **client: Any
) -> None:
    """Each pool is on its placed replica and holds exactly what was acknowledged."""
    with KVCoordClient(targets, **client) as c:
        listed = {p.name: p.replica for p in c.list_pools().pools}
        assert listed == placed
        for pool, held in acked.items():
            view = c.inspect_pool(pool, all_requests=True)
            got = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            assert got == held, pool
            blocks = [b for ids in got.values() for b in ids]
            assert len(blocks) == len(set(blocks)), f"{pool}: a block held by two requests"


def wait_placed(targets: list[str], placed: dict[str, str], timeout: float = 60.0, **client: Any) -> None:
    deadline = time.monotonic() + timeout
    listed: dict[str, str] = {}
    while time.monotonic() < deadline:
        try:
            with KVCoordClient(targets, timeout=2.0, **client) as c:
                listed = {p.name: p.replica for p in c.list_pools().pools}
        except Exception:  # noqa: BLE001 - a replica starting or stopping: ask again
            listed = {}
        if listed == placed:
            return
        time.sleep(0.2)
    raise AssertionError(f"pools not where placement puts them after {timeout} s: {listed} != {placed}")


def secured(config: str, certs: Any) -> str:
    """``config`` (test_replicas.replica_config's) with mutual TLS, a tenant known by its
    client certificate, and a full-access token only the replicas use (handovers)."""
    return (
        config.replace("[server]\n", '[server]\nauth_tokens = ["replicas-only"]\n', 1)
        + f'[server.tls]\ncert_file = "{certs.server_cert}"\nkey_file = "{certs.server_key}"\n'
        f'client_ca_file = "{certs.ca}"\n'
        # the server certificate allows server authentication only: a client one to show peers
        f'[cluster.peer_tls]\ncert_file = "{certs.client_cert}"\nkey_file = "{certs.client_key}"\n'
        '[tenants.team]\nidentities = ["cn:worker-1"]\n'
        'grants = [{ pools = ["*"], roles = ["administer", "use", "observe"] }]\n'
    )


@pytest.mark.parametrize("security", ["plaintext", "mutual_tls"])
def test_pools_move_with_their_state_when_a_replica_joins_and_another_leaves(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, security: str
) -> None:
    cluster = request.node.name.replace("[", "-").rstrip("]")
    procs: dict[str, ServerProcess] = {}
    client: dict[str, Any] = {}
    if security == "mutual_tls":
        from kvcoord.client import TLSOptions

        certs = request.getfixturevalue("certs")
        client["tls"] = TLSOptions(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)

    def start(replica: str) -> ServerProcess:
        config = replica_config(etcd, replica, tmp_path / replica, cluster)
        if security == "mutual_tls":
            config = secured(config, request.getfixturevalue("certs"))
        procs[replica] = start_server(config, env=env())
        return procs[replica]

    try:
        start("r0"), start("r1")
        # both see both before a pool is placed (a loaded machine: r0's view without r1
        # yet placed m-pools on r0; CI 10:37, load 17-22)
        credentials = None
        if security == "mutual_tls":
            credentials = grpc.ssl_channel_credentials(
                certs.ca.read_bytes(), certs.client_key.read_bytes(), certs.client_cert.read_bytes()
            )
        wait_members([procs["r0"], procs["r1"]], ["r0", "r1"], credentials=credentials)
        # pools that move when r2 joins, and pools that move when r0 then leaves
        pools = [f"m{i}" for i in range(8)]
        before = {p: owner_of(p, [Member("r0", ""), Member("r1", "")]).replica_id for p in pools}  # type: ignore[union-attr]
        joined = {p: owner_of(p, [Member(r, "") for r in ("r0", "r1", "r2")]).replica_id for p in pools}  # type: ignore[union-attr]
        left = {p: owner_of(p, [Member(r, "") for r in ("r1", "r2")]).replica_id for p in pools}  # type: ignore[union-attr]
        assert any(before[p] != joined[p] for p in pools) and any(joined[p] != left[p] for p in pools)
        targets = [procs["r0"].address, procs["r1"].address]
        sessions: dict[str, tuple[str, object]] = {}
        with KVCoordClient(targets, **client) as c:
            for pool in pools:
                assert c.create_pool(pool, POOL_CONFIG).pool.replica == before[pool]
                s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=60)
                sessions[pool] = (s.session_id, s.fence)
        serial = [0]

        # a replica joins while the client allocates: the pools it wins move to it
        worker = Allocator(targets, sessions, serial, **client)
        worker.start()
        time.sleep(1.0)
        start("r2")
        targets.append(procs["r2"].address)
        wait_placed(targets, joined, **client)
        time.sleep(1.0)
        calls = worker.calls
        worker.finish()
        assert calls > 0
        check(targets, worker.acked, joined, **client)

        # the replica that adopted pools dies (SIGKILL) and restarts from its own journal
        # (the adopt records): its pools come back with everything acknowledged
        procs["r2"].proc.kill()
        procs["r2"].stop()
        start("r2")
        targets[2] = procs["r2"].address
        wait_placed(targets, joined, **client)
        check(targets, worker.acked, joined, **client)

        # a replica leaves (SIGTERM) while the client allocates: its pools go to the others
        worker2 = Allocator(targets, sessions, serial, **client)
        worker2.acked = worker.acked
        worker2.start()
        time.sleep(1.0)
        assert procs["r0"].stop() == 0
        rest = [procs["r1"].address, procs["r2"].address]
        wait_placed(rest, left, **client)
        time.sleep(1.0)
        worker2.finish()
        assert worker2.calls > 0
        check(rest, worker2.acked, left, **client)
    finally:
        for p in procs.values():
            p.stop()


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (
            '[tenants.team]\ntokens = ["team-token"]\ngrants = [{ pools = ["*"], roles = ["use"] }]\n',
            "needs a full-access token in server.auth_tokens",
        ),
        ('[cluster.peer_tls]\nserver_name = "localhost"\n', "[server.tls] is off"),
    ],
    ids=["tenants_without_a_full_access_token", "peer_tls_without_server_tls"],
)
def test_a_replica_that_could_not_hand_pools_over_refuses_to_start(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, extra: str, said: str
) -> None:
    """Handovers need a full-access token (AdoptPool) and peers dialled as they serve:
    a replica configured so that no handover could succeed says so at start."""
    config = replica_config(etcd, "r0", tmp_path / "r0", "refused") + extra
    with pytest.raises(RuntimeError, match="exited") as raised:
        start_server(config, env=env()).stop()  # stopped when it does start (the old behaviour)
    assert said in str(raised.value)
