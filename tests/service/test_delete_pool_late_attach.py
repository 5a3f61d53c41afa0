"""An unforced DeletePool is refused while the pool has an exclusive session (POOL_EXCLUSIVE):
that worker may be running on its own copy of the pool. The check must hold where the pool
is really removed: an exclusive Attach that lands while the delete waits for the pool (a
Step applied to it in slices) is either refused or refuses the delete, never handed a
session of a pool deleted under it (old code: the holder was checked once, before the
wait, and the pool deleted under the new exclusive session; real server, real gRPC)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvcoord.client import KVCoordClient, NotFoundError, PoolBusyError
from kvcoord.service.testing import InProcessServer
from support import calls_in_threads, pool_toml


def _wait_until(check: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _queue_behind_a_sliced_step(
    server: InProcessServer,
    first: Callable[[KVCoordClient], object],
    second: Callable[[KVCoordClient], object],
) -> tuple[object, object]:
    """Hold pool p as a Step applied in slices does, send ``first`` then ``second`` (each
    waiting for the pool, in that order), give the pool back, and return their answers."""
    assert server.running is not None
    locks = server.running.servicer.registry.locks
    server.call(lambda: locks.take("p"))
    threads: list[threading.Thread] = []
    answers: list[list[object]] = []
    for n, call in enumerate((first, second), start=1):
        started, out = calls_in_threads(server.address, call, timeout=10)
        threads += started
        answers.append(out)
        _wait_until(lambda n=n: server.call(lambda: locks.waiting("p")) == n, f"call {n} never waited for p")
    server.call(lambda: locks.give("p"))  # the Step is done
    for t in threads:
        t.join(20)
    assert all(len(out) == 1 for out in answers), answers
    return answers[0][0], answers[1][0]


def _attach(c: KVCoordClient) -> object:
    return c.attach("p", "sha256_cbor", 4, "0", client_name="late", exclusive=True)


def test_an_exclusive_attach_landing_while_a_delete_waits_is_not_deleted_under(
    make_server: Callable[..., InProcessServer],
) -> None:
    """DeletePool (unforced, no session yet) waits for the pool behind a sliced Step; an
    exclusive Attach arrives after it. Either the Attach is refused (the pool is gone) or
    the delete is refused POOL_EXCLUSIVE and the session's pool still exists (old code:
    the Attach got session S and then the pool was deleted: S's worker ran on a pool
    that no longer existed)."""
    server = make_server(pool_toml("p", 64))
    deleted, attached = _queue_behind_a_sliced_step(server, lambda c: c.delete_pool("p"), _attach)
    with KVCoordClient(server.address, timeout=10) as c:
        pools = [p.name for p in c.list_pools().pools]
        if isinstance(attached, BaseException):
            assert isinstance(attached, NotFoundError), attached
            assert not isinstance(deleted, BaseException), deleted
            assert pools == []
        else:
            assert isinstance(deleted, PoolBusyError), (
                f"the pool was deleted ({deleted!r}) under the exclusive session {attached.session_id[:12]} "
                f"(pools now: {pools})"
            )
            assert pools == ["p"]
            assert [s.session_id for s in c.list_sessions("p").sessions] == [attached.session_id]


def test_a_delete_after_the_attach_in_the_queue_is_refused(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The other order (the Attach first in the pool's queue): the session is made, the
    delete refused POOL_EXCLUSIVE, as it is at once without a Step in flight."""
    server = make_server(pool_toml("p", 64))
    attached, deleted = _queue_behind_a_sliced_step(server, _attach, lambda c: c.delete_pool("p"))
    assert not isinstance(attached, BaseException), attached
    assert isinstance(deleted, PoolBusyError), deleted
    with KVCoordClient(server.address, timeout=10) as c:
        assert [p.name for p in c.list_pools().pools] == ["p"]
