"""A session's own calls (Heartbeat, Detach) name no pool on the wire, so they can reach
a replica that does not hold the session: the owner of its pool is dead and not yet
taken over, and the client asks the next replica. Only the pool's owner can tell
whether a session ended. Before, any replica that did not hold the session answered
NOT_FOUND SESSION_EXPIRED ("its requests were freed"), and the client believed it: an
exclusive manager reported every running request lost (the scheduler recomputes them)
and detached, though the replica taking the pool over rebuilt the session with its
requests. Now the call names its session's pool (the client fills it in): a replica
that does not serve it redirects (NOT_OWNER) or asks for patience (OWNER_CHANGING),
and one asked with no pool named says it cannot know (UNAVAILABLE). Real processes: a
real etcd and two replicas on loopback, the pool's journal in the store."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, RemoteKVCacheManager, RetryPolicy
from kvcoord.client.errors import (
    InvalidArgumentError,
    KVCoordError,
    SessionExpiredError,
    UnavailableError,
)
from kvcoord.client.testing import ServerProcess, start_server
from service.helpers import allocate
from support import Req
from test_failover import store_config, wait_served
from test_replicas import POOL_CONFIG, placed

IDS = ["r0", "r1"]
#: keyed and read calls retried through a takeover (a few seconds: r0's lease is 3 s)
PATIENT = RetryPolicy(max_attempts=60, initial_backoff=0.2, max_backoff=0.5, keyed_deadline=60.0)


@pytest.fixture
def replicas(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[dict[str, ServerProcess]]:
    cluster = request.node.name[:40]
    procs: dict[str, ServerProcess] = {}
    try:
        for r in IDS:
            procs[r] = start_server(store_config(etcd, r, tmp_path / r, cluster), env=env())
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _kill(p: ServerProcess) -> None:
    p.proc.kill()
    p.proc.wait(10)


def _error(call: Callable[[], object]) -> KVCoordError | None:
    try:
        call()
    except KVCoordError as err:
        return err
    return None


def test_a_replica_that_does_not_hold_a_session_never_says_it_ended(
    replicas: dict[str, ServerProcess],
) -> None:
    """r0 owns the pool; the session holds request "a". r0 is SIGKILLed. Asked by r1
    before the takeover: a Heartbeat naming the pool is not SESSION_EXPIRED (old code:
    it was), nor is one naming none (UNAVAILABLE). After the takeover the same
    Heartbeat succeeds through the replica set, "a" still holds its blocks, and a
    Heartbeat naming another pool is INVALID_ARGUMENT."""
    pool = placed("h", "r0", IDS)
    a0, a1 = replicas["r0"].address, replicas["r1"].address
    with KVCoordClient([a0, a1], timeout=10) as c:
        c.create_pool(pool, POOL_CONFIG)
        s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=60)
        got = c.allocate(pool, allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
        blocks = list(got.result.new_block_ids[0].block_ids)
    _kill(replicas["r0"])
    with KVCoordClient(a1, timeout=5, retry=NO_RETRY) as c1:  # (knows no session: names only what it is told)
        named = _error(lambda: c1.heartbeat(s.session_id, s.fence, pool=pool))
        unnamed = _error(lambda: c1.heartbeat(s.session_id, s.fence))
    assert named is not None and not isinstance(named, SessionExpiredError), repr(named)
    assert isinstance(unnamed, UnavailableError), repr(unnamed)
    assert "only the owner of its pool" in unnamed.message
    wait_served([a1], [pool])
    with KVCoordClient([a0, a1], timeout=10, retry=PATIENT) as c:
        assert c.heartbeat(s.session_id, s.fence, pool=pool).lease_seconds == 60
        view = c.inspect_pool(pool, all_requests=True)
        assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == {"a": blocks}
        wrong = _error(lambda: c.heartbeat(s.session_id, s.fence, pool=pool + "-other"))
    assert isinstance(wrong, InvalidArgumentError) or "NOT_OWNER" in repr(wrong), repr(wrong)


def test_an_exclusive_managers_heartbeat_during_a_takeover_loses_no_request(
    replicas: dict[str, ServerProcess],
) -> None:
    """The manager's keeper renews its session while r0 (the owner) is dead and r1 has
    not taken the pool over: the renewal is not taken for the session's end, and once
    r1 serves the pool the running request's next step is allocated as usual (old
    code: RequestsLostError for "x", and the manager detached)."""
    pool = placed("m", "r0", IDS)
    a0, a1 = replicas["r0"].address, replicas["r1"].address
    client = KVCoordClient([a0, a1], timeout=10, retry=PATIENT)
    try:
        client.create_pool(pool, POOL_CONFIG)
        m = RemoteKVCacheManager(client, pool, hash_seed="0", exclusive=True)
        r = Req("x", list(range(10)))
        assert m.allocate_slots(r, 10) is not None
        r.num_computed_tokens = 10
        m.flush()
        _kill(replicas["r0"])
        m.keeper.heartbeat()  # what the keeper's thread does every lease / 3
        assert not isinstance(m.keeper.lost, SessionExpiredError), repr(m.keeper.lost)
        wait_served([a1], [pool])
        r.all_token_ids.extend([5, 6, 7])
        assert m.allocate_slots(r, 3) is not None  # a new block: the server answers it
        with KVCoordClient(a1, timeout=10) as c1:
            assert [q.request_id for q in c1.inspect_pool(pool, all_requests=True).requests] == ["x"]
        m.free(r)
        m.close()
    finally:
        client.close()
