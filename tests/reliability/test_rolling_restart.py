"""Upgrading a replica with sessions live (deploy/README.md, "Upgrade with sessions
live"): the replica's process is stopped with SIGTERM, as `kubectl rollout` and `docker
stop` do, and a new process starts from the same data directory while a worker's
RemoteKVCacheManager holds a session, requests and their blocks. The new process here
runs the same code: what the runbook promises depends on the data directory and the
clients, which an image of a newer version with the same journal format shares."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from durable_server import DurableServer, leased_server
from kvcoord.client import KVCoordClient, RemoteKVCacheManager, RequestsLostError

BS = 4


class Req:
    """What RemoteKVCacheManager reads of a vLLM request."""

    def __init__(self, rid: str, first: int, num_tokens: int) -> None:
        self.request_id = rid
        self.all_token_ids = list(range(first, first + num_tokens))
        self.num_computed_tokens = 0


@contextlib.contextmanager
def _worker(tmp: Path, lease: float) -> Iterator[tuple[DurableServer, RemoteKVCacheManager]]:
    """A journaled replica (sessions leased ``lease`` s) and a worker's manager on it."""
    server = leased_server(tmp, lease, num_blocks=65)
    # the default window (300 s): keyed calls are retried for 90 s, as in production
    short = f"idempotency_window_seconds = {4 * lease}\n"
    assert short in server.config.read_text()
    server.config.write_text(server.config.read_text().replace(short, "idempotency_window_seconds = 300.0\n"))
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            m = RemoteKVCacheManager(c, "p", hash_seed="0")
            yield server, m
            m.close()
    finally:
        server.stop()


def _sigterm(server: DurableServer) -> int:
    """The clean stop of a rolling restart; returns the exit status."""
    assert server.proc is not None
    server.proc.send_signal(signal.SIGTERM)
    status = int(server.proc.wait(60))
    server._log.close()
    return status


def _place(m: RemoteKVCacheManager, r: Req) -> list[int]:
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(r.all_token_ids) - n, n, hit) is not None
    return list(m.get_block_ids(r.request_id)[0])


def _held(address: str) -> dict[str, list[int]]:
    with KVCoordClient(address) as c:
        return {
            r.request_id: list(r.groups[0].block_ids) for r in c.inspect_pool("p", all_requests=True).requests
        }


def test_a_sigterm_restart_keeps_sessions_requests_and_blocks(tmp_path: Path) -> None:
    """The worker's session, its requests and their block ids outlive the restart: an
    allocation sent while the replica is down is retried (default policy) and applied
    once by the new process, the manager carries on in the same session without
    re-attaching or losing a request, its lease renewals are answered by the new
    instance, a new worker attaches at once (a recovered journal needs no grace), and
    the pool's invariants hold."""
    with _worker(tmp_path, 20.0) as (server, m):
        session = m.session_id
        before = {r.request_id: _place(m, r) for r in (Req("a", 100, 17), Req("b", 200, 9))}
        m.flush()
        instance = m.keeper.fence.instance_id
        assert _held(server.address) == before

        assert _sigterm(server) == 0, server.log()
        restarted = threading.Timer(1.5, server.start)
        restarted.start()
        try:
            during = _place(m, Req("c", 300, 12))  # sent while no process listens
        finally:
            restarted.join()
        assert m.session_id == session and m.lost_requests == 0
        assert _held(server.address) == {**before, "c": during}
        renewals = m.keeper.renewals
        m.keeper.heartbeat()
        assert m.keeper.renewals == renewals + 1 and m.keeper.lost is None
        assert m.keeper.fence.instance_id != instance  # the new instance's fence, adopted

        _place(m, Req("d", 400, 8))
        m.free(Req("a", 100, 17))
        m.flush()
        assert set(_held(server.address)) == {"b", "c", "d"}
        with KVCoordClient(server.address) as other:
            other.attach("p", "sha256_cbor", BS, "0", "new-worker")  # no GRACE_PERIOD
            assert list(other.check_pool("p").violations) == []


def test_an_idle_session_outlives_a_restart_longer_than_its_lease(tmp_path: Path) -> None:
    """The recovered process gives every recovered session a fresh lease from its own
    start: a worker that sent nothing while the replica was down (here 3 s down,
    lease 2 s) renews on its next call (its lease ran out on its own clock, so it
    first asks the server, synchronously) and keeps its session and blocks."""
    with _worker(tmp_path, 2.0) as (server, m):
        session = m.session_id
        a = _place(m, Req("a", 100, 17))
        m.flush()
        assert _sigterm(server) == 0, server.log()
        time.sleep(3.0)
        server.start()
        b = _place(m, Req("b", 200, 9))
        m.flush()
        assert m.session_id == session and m.lost_requests == 0
        assert _held(server.address) == {"a": a, "b": b}


def test_a_call_in_flight_longer_than_the_lease_loses_its_requests_loudly(tmp_path: Path) -> None:
    """The bound of the runbook's rule: a Step sent just as the replica stopped and
    answered by the new process 3 s later, longer than the worker's 2 s lease, is
    not trusted (the client cannot prove its lease covered the wait): the manager raises
    RequestsLostError naming the requests for the scheduler to recompute, ends that
    session and attaches a new one (at once, or in its next call where that attach
    failed), whose allocations work. Nothing is silently wrong."""
    with _worker(tmp_path, 2.0) as (server, m):
        session = m.session_id
        _place(m, Req("a", 100, 17))
        m.flush()
        assert _sigterm(server) == 0, server.log()
        restarted = threading.Timer(3.0, server.start)
        restarted.start()
        lost: Any = None
        try:
            _place(m, Req("b", 200, 9))  # retried until the new process answers
        except RequestsLostError as err:
            lost = err
        finally:
            restarted.join()
        assert lost is not None and {"a", "b"} <= set(lost.request_ids), lost
        # a new session by the next call: attached at once, or, where the loss was the
        # client's own verdict (its lease ran out on its clock while a loaded machine's
        # restart had not answered yet) and that attach was refused, by that call
        c = _place(m, Req("c", 300, 12))
        m.flush()
        assert m.session_id != session
        assert _held(server.address) == {"c": c}
