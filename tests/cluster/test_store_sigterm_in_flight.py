"""A replica of ``journal = "store"`` stopped by SIGTERM (its real shutdown path: the
member key deleted, each pool handed over, in-flight calls given the grace, the
snapshot, the cluster's lease revoked) while a client's keyed Steps on its pool are in
flight. Every call must end typed: answered (and then durable: the pool's next owner
holds what the answer named, block for block), or refused with a status a client acts
on (UNAVAILABLE: "stopping", the owner changing, the replica gone; NOT_OWNER after the
handover), never INTERNAL / UNKNOWN / CANCELLED, and no answered call lost.

test_store_call_at_stop.py calls ``Cluster.stop()`` directly under one held handler;
here real processes and a real etcd, the client's calls on raw stubs (each call's own
status, no retry), four threads sending until each is refused. Three ways: r0 reaching
etcd freely; r0's way to etcd cut by a TCP proxy just before the signal (every call in
flight then waits for its record's store write while the stop runs), healed once the
stop began; and cut until r0 has exited (its writes given up, its handover the only
way the pool goes on). Outcomes seen (15 runs): answered, UNAVAILABLE OWNER_CHANGING,
UNAVAILABLE "could not be written to the cluster store", NOT_OWNER; no bug found."""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import error_from_rpc
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from tcp_proxy import Proxy
from test_replicas import POOL_CONFIG, placed, store_replica_config, wait_members
from test_store_kept_answer_given_up import inspected_when_served

#: a bound on every wait here (a hang fails), not a measurement
BOUND = 60.0
#: r0's lease (s)
LEASE = 6
THREADS = 4
#: Steps a thread sends at most (bounded; each is refused long before: r0 stops)
MAX_CALLS = 2000
#: answered Steps each thread has before the signal
BEFORE_SIGNAL = 3

#: a pool large enough that no call is refused for room
BIG_POOL = pb.PoolConfig()
BIG_POOL.CopyFrom(POOL_CONFIG)
BIG_POOL.num_blocks = 8192


@dataclasses.dataclass
class Told:
    """What one call was told: its request, and its blocks or its refusal."""

    request_id: str
    blocks: list[int] | None = None
    code: grpc.StatusCode | None = None
    reason: str = ""
    details: str = ""


def _sender(
    address: str, pool: str, session: pb.AttachResponse, index: int, told: list[Told],
    sent: threading.Semaphore, stop: threading.Event,
) -> None:  # fmt: skip
    """Keyed Steps of one new request each on a raw stub, until one is refused."""
    fence = session.fence
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.AllocatorStub(channel)
        for n in range(MAX_CALLS):
            rid = f"t{index}-{n}"
            base = (index * MAX_CALLS + n) * 8  # (no two requests share a block's tokens)
            request = pb.StepRequest(
                pool=pool, session_id=session.session_id, fence=fence, idempotency_key=rid,
                call_sequence=time.time_ns(), ops=[allocate(rid, list(range(base, base + 8)), 8)],
            )  # fmt: skip
            t = Told(rid)
            told.append(t)
            try:
                answer = stub.Step(request, timeout=BOUND)
            except grpc.RpcError as exc:
                t.code, t.details = exc.code(), str(exc.details())
                t.reason = error_from_rpc(exc, "Step").reason
                return
            result = answer.results[0]
            assert not result.status_code and not result.allocate.refused, result
            t.blocks = list(result.allocate.new_block_ids[0].block_ids)
            fence = answer.fence
            sent.release()
            if stop.is_set():
                return


def _acceptable(t: Told) -> bool:
    """A refusal a client acts on (the call not applied, or its outcome unknown: retried
    under its key, or its request taken for lost)."""
    if t.code == grpc.StatusCode.UNAVAILABLE:
        return True
    return t.code == grpc.StatusCode.FAILED_PRECONDITION and t.reason == "NOT_OWNER"


@pytest.mark.parametrize("cut", ["", "until-stopping", "through-the-stop"])
def test_sigterm_while_keyed_steps_are_in_flight_ends_each_typed_and_loses_none(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, cut: str
) -> None:
    cluster = f"sigterm-in-flight-{cut or 'free'}"
    proxy = Proxy(etcd.endpoint)
    r0 = start_server(store_replica_config(proxy.address, "r0", tmp_path / "r0", cluster, LEASE), env=env())
    r1 = start_server(store_replica_config(etcd.endpoint, "r1", tmp_path / "r1", cluster, 2), env=env())
    procs: list[ServerProcess] = [r0, r1]
    threads: list[threading.Thread] = []
    stop = threading.Event()
    try:
        wait_members(procs, ["r0", "r1"])
        pool = placed("s", "r0", ["r0", "r1"])
        targets = [r0.address, r1.address]
        with KVCoordClient(targets, timeout=10.0) as c:
            c.create_pool(pool, BIG_POOL)
            sessions = [c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120) for _ in range(THREADS)]
        told: list[list[Told]] = [[] for _ in range(THREADS)]
        sent = threading.Semaphore(0)
        for i in range(THREADS):
            threads.append(
                threading.Thread(
                    target=_sender, args=(r0.address, pool, sessions[i], i, told[i], sent, stop), daemon=True
                )
            )
            threads[-1].start()
        deadline = time.monotonic() + BOUND
        for _ in range(THREADS * BEFORE_SIGNAL):
            while not sent.acquire(timeout=0.5):
                early = [t for ts in told for t in ts if t.code is not None]
                assert not early and time.monotonic() < deadline, (
                    f"the Steps never flowed: {early}\n{r0.log()}"
                )
        if cut:
            proxy.cut()  # the calls now in flight wait for their records' store writes
        r0.proc.terminate()  # SIGTERM: the real stop
        if cut == "until-stopping":
            deadline = time.monotonic() + BOUND
            while "shutting down" not in r0.log():
                assert time.monotonic() < deadline and r0.proc.poll() is None, r0.log()
                time.sleep(0.05)
            proxy.heal()
        r0.proc.wait(BOUND)
        proxy.heal()
        stop.set()
        for t in threads:
            t.join(BOUND)
            assert not t.is_alive(), "a call never ended"
        calls = [t for ts in told for t in ts]
        refused = [t for t in calls if t.blocks is None]
        assert len(refused) == THREADS  # each thread ends on its first refusal
        untyped = [t for t in refused if not _acceptable(t)]
        assert not untyped, f"calls ended untyped: {untyped}\n{r0.log()}"
        held = inspected_when_served([r1.address], pool, lambda: r0.log() + r1.log())
        answered = {t.request_id: t.blocks for t in calls if t.blocks is not None}
        lost = {rid: (blocks, held.get(rid)) for rid, blocks in answered.items() if held.get(rid) != blocks}
        assert not lost, f"answered, the next owner holds otherwise (told, held): {lost}\n{r0.log()}"
        owners: dict[int, str] = {}
        for rid, blocks in held.items():
            for b in blocks:
                assert b not in owners, f"block {b} held by {owners[b]} and {rid}"
                owners[b] = rid
        assert r0.proc.returncode == 0, r0.log()
    finally:
        stop.set()
        for p in procs:
            p.stop()
        proxy.close()
