"""A client follows a pool to its new owner as soon as the replica set says where it
is (issue 23, item 2): real etcd and replica processes, the owner SIGKILLed, and every
attempt the client makes logged with the address it went to. No duration is asserted:
the order of the attempts is (where each went, after what answer).

The client's names were resolved more than RESOLVE_EVERY before the kill, and the dead
owner is first in the configured order: a client that puts the configured order back
when it resolves again calls the dead address on its own, which these tests refuse."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import (
    NO_RETRY,
    AsyncKVCoordClient,
    FencedError,
    KVCoordClient,
    OutcomeUnknownError,
    OwnerChangingError,
    RetryPolicy,
)
from kvcoord.client.errors import NotOwnerError, error_from_rpc
from kvcoord.client.owners import RESOLVE_EVERY
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.ownership import Member, owner_of
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from test_replicas import POOL_CONFIG

LEASE = 3

#: (address called, outcome: "OK", "refused" or the typed error's class name, the
#: owner a NOT_OWNER named)
Attempt = tuple[str, str, str]


class _AddressLog(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Logs each attempt made on one address's channel."""

    def __init__(self, address: str, log: list[Attempt]) -> None:
        self.address = address
        self.log = log

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        if outcome.code() == grpc.StatusCode.OK:
            self.log.append((self.address, "OK", ""))
        else:
            err = error_from_rpc(outcome)
            refused = "connect" in err.message.lower() or "socket closed" in err.message.lower()
            what = "refused" if type(err).__name__ == "UnavailableError" and refused else type(err).__name__
            self.log.append((self.address, what, getattr(err, "owner", "")))
        return outcome


def logging_client(targets: list[str], log: list[Attempt], **kw: Any) -> KVCoordClient:
    """A KVCoordClient whose every attempt is logged with the address it went to."""

    def channel(address: str, options: Any = None) -> Any:
        return grpc.intercept_channel(
            grpc.insecure_channel(address, options=options), _AddressLog(address, log)
        )

    class Logged(KVCoordClient):
        _channel_factory = staticmethod(channel)

    return Logged(targets, **kw)


def config(etcd: Etcd, replica: str, data_dir: Path, cluster: str, journal: str) -> str:
    return (
        f'[server]\ndata_dir = "{data_dir}"\nsynchronous = "NORMAL"\nlog_level = "INFO"\ngrace_seconds = 5.0\n'
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{cluster}"\nreplica_id = "{replica}"\n'
        f'lease_seconds = {LEASE}\nstore_timeout_seconds = 1.0\njournal = "{journal}"\n'
    )


def placed_on(replica: str, ids: list[str]) -> str:
    members = [Member(i, "") for i in ids]
    return next(f"m{n}" for n in range(1000) if owner_of(f"m{n}", members).replica_id == replica)  # type: ignore[union-attr]


@pytest.fixture
def replicas(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[Callable[[list[str], str], list[ServerProcess]]]:
    procs: list[ServerProcess] = []

    def start(ids: list[str], journal: str) -> list[ServerProcess]:
        cluster = request.node.name[:40]
        for r in ids:
            procs.append(start_server(config(etcd, r, tmp_path / r, cluster, journal), env=env()))
        return procs

    try:
        yield start
    finally:
        for p in procs:
            p.stop()


class TakeoverWatch(threading.Thread):
    """Polls the survivors' ListPools (one attempt each) until one lists ``pool``;
    ``seen_at`` is then how many attempts the client had logged by that moment."""

    def __init__(self, survivors: list[str], pool: str, log: list[Attempt]) -> None:
        super().__init__(daemon=True)
        self.survivors = survivors
        self.pool = pool
        self.log = log
        self.seen_at: int | None = None
        self.owner = ""

    def run(self) -> None:
        clients = [KVCoordClient(a, timeout=1.0, retry=NO_RETRY) for a in self.survivors]
        try:
            deadline = time.monotonic() + 60
            while self.seen_at is None and time.monotonic() < deadline:
                for address, c in zip(self.survivors, clients, strict=True):
                    try:
                        names = [p.name for p in c.list_pools().pools]
                    except Exception:  # noqa: BLE001 - a survivor busy rebuilding: next round
                        continue
                    if self.pool in names:
                        self.seen_at, self.owner = len(self.log), address
                        return
                time.sleep(0.02)
        finally:
            for c in clients:
                c.close()


def test_after_its_owner_is_killed_a_keyed_call_goes_to_the_dead_address_only_when_named_and_follows_the_takeover(
    replicas: Callable[[list[str], str], list[ServerProcess]],
) -> None:
    """3 replicas, journal in the store; the pool's owner is SIGKILLed and an Allocate
    sent. Until the dead owner's claim lapses the survivors still name it: the client
    calls the dead address only right after a survivor named it (never on its own:
    it stays behind the live ones), and after the takeover never again; once the pool
    is listed on its new owner, the call is answered without another refusal. The
    acknowledged allocation is on the new owner."""
    ids = ["r0", "r1", "r2"]
    procs = replicas(ids, "store")
    pool = placed_on("r0", ids)
    dead, survivors = procs[0].address, [p.address for p in procs[1:]]
    log: list[Attempt] = []
    with logging_client([p.address for p in procs], log, timeout=5.0) as c:
        c.create_pool(pool, POOL_CONFIG)
        s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
        first = c.allocate(pool, allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
        assert log[-1] == (dead, "OK", "")  # the owner learned: r0
        time.sleep(RESOLVE_EVERY + 0.2)  # the names are due to be resolved again
        procs[0].proc.kill()
        procs[0].proc.wait(10)
        before = len(log)
        watch = TakeoverWatch(survivors, pool, log)
        watch.start()
        got = c.allocate(pool, allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
        watch.join(60)
        attempts = log[before:]
        assert attempts[-1][1] == "OK" and attempts[-1][0] in survivors
        assert any(a[1] == "refused" for a in attempts), "the first attempt went to the dead owner"
        # the dead address is called only right after a live replica named it
        for i, (address, _, _) in enumerate(attempts):
            if address == dead and i > 0:
                previous = attempts[i - 1]
                assert previous[1] == "NotOwnerError" and previous[2] == dead, (
                    f"attempt {i} went to the dead address on its own: {attempts[: i + 1]}"
                )
        # after the takeover: no attempt at the dead address, and none refused
        assert watch.seen_at is not None, "no survivor listed the pool"
        after = log[watch.seen_at :]
        assert all(a[0] != dead for a in after), f"the dead address called after the takeover: {after}"
        print(f"{len(attempts)} attempts: {attempts}")
        view = c.inspect_pool(pool, all_requests=True)
    held = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
    assert held == {
        "a": list(first.result.new_block_ids[0].block_ids),
        "b": list(got.result.new_block_ids[0].block_ids),
    }


def test_a_replica_taking_a_pool_over_stays_its_owner_for_the_client(
    replicas: Callable[[list[str], str], list[ServerProcess]],
) -> None:
    """2 replicas, local journals: the pool's owner r0 is SIGKILLed, and once its claim
    lapses r1 (where placement now puts the pool) answers OWNER_CHANGING, typed: it
    holds no state of the pool and waits for its owner (with the journal in the store
    it would rebuild it). A client with a deadline keeps asking r1, the replica taking
    the pool over, after that answer: never the dead address again."""
    ids = ["r0", "r1"]
    procs = replicas(ids, "local")
    pool = placed_on("r0", ids)
    dead, alive = procs[0].address, procs[1].address
    with KVCoordClient([dead, alive], timeout=5.0) as c:
        c.create_pool(pool, POOL_CONFIG)
    procs[0].proc.kill()
    procs[0].proc.wait(10)
    with KVCoordClient(alive, timeout=2.0, retry=NO_RETRY) as probe:
        deadline = time.monotonic() + 30
        err: Exception | None = None
        while time.monotonic() < deadline:
            try:
                probe.get_pool(pool)
            except NotOwnerError as exc:  # the dead owner's claim has not lapsed yet
                err = exc
                time.sleep(0.1)
                continue
            except OwnerChangingError as exc:
                err = exc
            break
        assert isinstance(err, OwnerChangingError), f"r1 answered {err!r}"
    log: list[Attempt] = []
    policy = RetryPolicy(deadline=1.5, keyed_deadline=None)
    with logging_client([dead, alive], log, timeout=2.0, retry=policy) as c:
        time.sleep(RESOLVE_EVERY + 0.2)
        with pytest.raises(OwnerChangingError):
            c.get_pool(pool)  # the owner never comes back: the deadline ends the wait, typed
    changing = [i for i, a in enumerate(log) if a[1] == "OwnerChangingError"]
    assert len(changing) >= 2, f"r1 was asked once only: {log}"
    for i in changing[:-1]:
        assert log[i + 1][0] == alive, f"after OWNER_CHANGING the client went elsewhere: {log}"
    assert all(a[0] == alive for a in log[changing[0] :]), log


class _Changing(pb_grpc.AllocatorServicer):
    """A replica that answers OWNER_CHANGING for its first ``changing`` calls, then serves."""

    def __init__(self, changing: int, calls: list[str], me: str) -> None:
        self.changing = changing
        self.calls = calls
        self.me = me

    def GetPool(self, request: pb.GetPoolRequest, context: grpc.ServicerContext) -> pb.GetPoolResponse:
        self.calls.append(self.me)
        if self.calls.count(self.me) <= self.changing:
            context.set_trailing_metadata((("kvcoord-reason", "OWNER_CHANGING"),))
            context.abort(grpc.StatusCode.UNAVAILABLE, "taking the pool over: retry here")
        return pb.GetPoolResponse(pool=pb.PoolInfo(name=request.name))


@contextlib.contextmanager
def _changing_pair(calls: list[str], times: int = 3) -> Iterator[list[str]]:
    """Two fake replicas: "first" serves at once, "owner" answers OWNER_CHANGING ``times`` times."""
    servers, addresses = [], []
    for name, changing in (("first", 0), ("owner", times)):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_AllocatorServicer_to_server(_Changing(changing, calls, name), server)
        addresses.append(f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}")
        server.start()
        servers.append(server)
    try:
        yield addresses
    finally:
        for server in servers:
            server.stop(None)


def test_owner_changing_keeps_the_replica_as_the_owner_over_real_grpc() -> None:
    """Two replicas; the second, the owner learned, answers OWNER_CHANGING three
    times: every later attempt goes to it again (the first address is never asked)."""
    calls: list[str] = []
    with _changing_pair(calls) as addresses:
        with KVCoordClient(addresses, timeout=5.0, retry=RetryPolicy(initial_backoff=0.01)) as c:
            c.routes.redirected("p", addresses[1])
            assert c.get_pool("p").pool.name == "p"
    assert calls == ["owner"] * 4


def test_a_read_waiting_on_owner_changing_ends_typed_within_its_policys_backoffs() -> None:
    """A read (a session renewal is one) pauses briefly while a replica answers
    OWNER_CHANGING, but no longer than its policy's backoffs could have lasted (here
    0.1 + 0.2 s: pauses of at least 0.05, 0.1, 0.125 s fit at most 3 times), then
    raises the typed error: it must fail in time for a lease to be counted."""
    calls: list[str] = []
    policy = RetryPolicy(max_attempts=3, initial_backoff=0.1, multiplier=2.0)
    assert policy.longest_wait() == pytest.approx(0.3)
    with _changing_pair(calls, times=10**6) as addresses:
        with KVCoordClient(addresses, timeout=5.0, retry=policy) as c:
            c.routes.redirected("p", addresses[1])
            with pytest.raises(OwnerChangingError):
                c.get_pool("p")
    assert 1 <= len(calls) <= 4 and set(calls) == {"owner"}


def test_the_asyncio_client_keeps_a_replica_answering_owner_changing_too() -> None:
    calls: list[str] = []

    async def run(addresses: list[str]) -> str:
        async with AsyncKVCoordClient(addresses, timeout=5.0, retry=RetryPolicy(initial_backoff=0.01)) as c:
            c.routes.redirected("p", addresses[1])
            return (await c.get_pool("p")).pool.name

    with _changing_pair(calls) as addresses:
        assert asyncio.run(run(addresses)) == "p"
    assert calls == ["owner"] * 4


class _Refusing(pb_grpc.AllocatorServicer):
    """A replica that answers every Allocate FAILED_PRECONDITION with ``reason`` (a
    NOT_OWNER names no owner)."""

    def __init__(self, calls: list[str], reason: str) -> None:
        self.calls = calls
        self.reason = reason

    def Allocate(self, request: pb.AllocateRequest, context: grpc.ServicerContext) -> pb.AllocateResponse:
        self.calls.append(request.idempotency_key)
        context.set_trailing_metadata((("kvcoord-reason", self.reason),))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"refused: {self.reason}")


@pytest.mark.parametrize(
    ("reason", "raised"), [("NOT_OWNER", OutcomeUnknownError), ("INSTANCE_CHANGED", FencedError)]
)
def test_a_keyed_call_whose_first_attempt_is_unknown_ends_unknown_after_later_redirects(
    reason: str, raised: type[Exception]
) -> None:
    """The first attempt of an Allocate goes to an address that takes the connection
    and never answers (its outcome unknown: a pool owner dying under the call; a
    refused connection would be a call never sent, whose outcome is known), the next
    ones to a replica
    that answers NOT_OWNER until the attempts run out: the call ends in
    OutcomeUnknownError (possibly applied), not in the last NotOwnerError (which
    would say nothing changed). An answer that settles it (the server's instance
    changed: every block id is void) is raised as it is. Every retry carried the same
    idempotency key."""
    calls: list[str] = []
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_AllocatorServicer_to_server(_Refusing(calls, reason), server)
    live = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    hole = socket.socket()  # the kernel completes connections; nobody ever answers on them
    hole.bind(("127.0.0.1", 0))
    hole.listen(1)
    dead = f"127.0.0.1:{hole.getsockname()[1]}"
    try:
        policy = RetryPolicy(max_attempts=3, initial_backoff=0.01, keyed_deadline=None)
        with KVCoordClient([dead, live], timeout=2.0, retry=policy) as c:
            with pytest.raises(raised) as err:
                c.allocate("p", allocate("a", [1, 2, 3, 4], 4).allocate, "s1")
        assert type(err.value) is raised
        assert len(calls) >= 1 and len(set(calls)) == 1
    finally:
        server.stop(None)
        hole.close()
