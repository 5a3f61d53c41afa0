"""A shared session given up on (its lease unproven) is ended before a new one is made
(``SessionKeeper.start_again``: Detach, then Attach). Here the Detach is applied but
its answer is lost on the way back, over real gRPC (a channel interceptor lets the
call through and drops what it answers).

The keeper cannot tell that from a Detach that never arrived: the new Attach waits
(``reattach``), the loss is reported ("recompute them"), and the next call sends the
Detach again. The server answers it "unknown session" (the first one ended it), which
is as good as an answered Detach: the Attach follows, and the recompute under the same
request ids is allocated in the new session. Checked: exactly the recomputed request
is held, by the new session only; no block is held twice (another worker allocating
meanwhile included); the pool is sound (CheckPool)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, RemoteKVCacheManager, RequestsLostError
from kvcoord.client.errors import LeaseExpiredError, LocalRpcError
from kvcoord.service.testing import InProcessServer
from support import Req, held_blocks, pool_toml

LEASE = 1.0


class Answers(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Calls of the methods in ``cut`` fail UNAVAILABLE without reaching the server;
    calls of those in ``drop`` reach it, are applied, and their answers are lost
    (UNAVAILABLE, as a connection broken after the send)."""

    def __init__(self) -> None:
        self.cut: tuple[str, ...] = ()
        self.drop: tuple[str, ...] = ()
        self.dropped: list[str] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        method = details.method.rsplit("/", 1)[-1]
        if method in self.cut:
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: partitioned")
        answer = continuation(details, request)
        if method in self.drop:
            answer.result()  # (applied: its outcome is only hidden from the caller)
            self.dropped.append(method)
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: the answer was lost")
        return answer


def _allocate(m: RemoteKVCacheManager, r: Req) -> list[int]:
    hit, n = m.get_computed_blocks(r)
    new = m.allocate_slots(r, len(r.all_token_ids) - n, n, hit)
    assert new is not None
    return list(new.get_block_ids()[0])


@pytest.mark.parametrize("renew", [False, True])
def test_a_detach_applied_with_its_answer_lost_ends_in_a_new_session_and_a_recompute(
    make_server: Callable[..., InProcessServer], renew: bool
) -> None:
    """``renew``: the keeper's renewal thread runs too (it then renews the ended session
    meanwhile and is told it is gone)."""
    server = make_server(pool_toml("p", 64))  # (a ManualClock: no lease runs out on the server)
    net = Answers()
    with (
        KVCoordClient(server.address, timeout=20, interceptors=[net]) as c,
        KVCoordClient(server.address, timeout=20) as other,
    ):
        m = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="w", lease_seconds=LEASE, renew=renew)
        r1 = Req("r1", list(range(32)))
        _allocate(m, r1)
        old = m.keeper.session_id
        net.cut, net.drop = ("Heartbeat",), ("Detach",)
        time.sleep(LEASE)  # past 0.95 x the lease, the renewal fails: the proof broke
        with pytest.raises(RequestsLostError) as lost:
            _allocate(m, Req("r2", list(range(100, 132))))
        assert isinstance(lost.value.cause, LeaseExpiredError)
        assert sorted(lost.value.request_ids) == ["r1", "r2"]
        assert net.dropped == ["Detach"]  # applied: the old session is gone on the server ...
        assert old not in {s.session_id for s in c.list_sessions("p").sessions}
        assert held_blocks(c, "p") == {}
        assert m.keeper.session_id == old  # ... but this client could not know: no new session yet

        # another worker takes blocks meanwhile (the ones the old session held are free)
        theirs = RemoteKVCacheManager(other, "p", hash_seed="0", client_name="o", lease_seconds=600)
        taken = _allocate(theirs, Req("o1", list(range(500, 540))))

        net.cut = net.drop = ()
        if renew:
            m.keeper.heartbeat()  # (as its thread does: told the session is gone)
            assert m.keeper.lost is not None
        r1.num_computed_tokens = 0
        mine = _allocate(m, r1)  # the recompute the loss asked for
        assert m.keeper.session_id != old  # the Detach answered "unknown session": attached
        held = held_blocks(c, "p")
        assert held == {"r1": mine, "o1": taken}  # r2 not kept anywhere, r1 once
        assert not set(mine) & set(taken)
        assert not c.check_pool("p").violations
        sessions = {s.session_id: s for s in c.list_sessions("p").sessions}
        assert old not in sessions and m.keeper.session_id in sessions
        theirs.close()
        m.close()
