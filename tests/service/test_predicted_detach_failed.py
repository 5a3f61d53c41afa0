"""A predicted session gives up on a Step (OutcomeUnknownError), its Detach of the old
session fails, and the Step's only delivery comes later, over real gRPC.

The predicting manager ends a session whose Step it gave up on (``start_again``: Detach,
error swallowed, then an exclusive Attach that resets the prefix cache). Nothing names
the given-up Step afterwards (no keyed call of the old session follows), so a late
delivery is refused only if the old session is gone by then. It holds because:

- the new Attach is exclusive and resets the cache: the server refuses it (POOL_EXCLUSIVE)
  while the old session is live, so the recovery fails loudly and the next call tries
  again, Detach first (the keeper keeps the old session's id until an Attach succeeds);
- a late Step applied while the old session still lives is in that session only: its
  Detach frees what it took as abandoned (their cache entries dropped,
  ``free_abandoned``), and the new session's Attach resets the prefix cache (refused
  while any request is held); either alone keeps the late Step's blocks from being hit;
- once the new session exists the old one has ended (Detach answered, or its lease ran
  out and the Attach ended it, ``Registry.for_attach``): the late Step is refused
  (SESSION_EXPIRED), session ids are never reused.

Each case checks afterwards that the server's engine state equals the mirror's (free
order, reference counts, cached hashes, request records: no block held by a request the
mirror does not know), that no request of the old session is held, and that the late
Step's prompt is no hit."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, KVCoordError, PredictingKVCacheManager, RequestsLostError
from kvcoord.client.errors import LocalRpcError
from kvcoord.engine.state import export_state
from kvcoord.service.testing import InProcessServer, ManualClock
from late_copies import LEASE, SETTINGS, assert_refused
from support import admit_prompt, hashed_req, wire_pool_config
from test_late_first_delivery import POLICY, HoldBack
from test_predicted_mirror_state import comparable

OLD = list(range(100, 113))  # admitted in the given-up Step: 3 full blocks of 4
NEW = list(range(200, 209))


class FailDetach(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """While ``armed``, every Detach fails UNAVAILABLE without reaching the server."""

    def __init__(self) -> None:
        self.armed = False
        self.failed = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self.armed and details.method.endswith("/Detach"):
            self.failed += 1
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: Detach never reached the server")
        return continuation(details, request)


def _check(server: InProcessServer, c: KVCoordClient, m: PredictingKVCacheManager, live: set[str]) -> None:
    """Server == mirror; the pool holds exactly ``live`` (of the new session); OLD's
    prompt is no hit for the new session."""
    probe = hashed_req("probe", OLD + [1])
    assert m.get_computed_blocks(probe)[1] == 0, "a hit on KV nobody wrote (the late Step's blocks)"
    m.free(probe)
    m.flush()
    engine = server.running.servicer.registry.pools["p"].engine  # type: ignore[union-attr]
    assert comparable(export_state(m.mirror.engine)) == comparable(export_state(engine))
    held = {r.request_id for r in c.inspect_pool("p", all_requests=True).requests}
    assert held == live
    assert [s.session_id for s in c.list_sessions("p").sessions] == [m.keeper.session_id]


def _recover(m: PredictingKVCacheManager) -> KVCoordError:
    """One recovery attempt (the manager's next call): what it raised."""
    with pytest.raises(KVCoordError) as err:
        m.flush()
    return err.value


def _give_up_step(m: PredictingKVCacheManager, hold: HoldBack) -> None:
    """Admit OLD's request in a Step held back until the sender gives up on it."""
    hold.armed = True
    admit_prompt(m, hashed_req("late", OLD))
    m.take_events()  # sends the Step (on the sender thread) and waits for it
    m.sender.settle()
    hold.armed = False
    assert hold.held is not None and hold.attempts == POLICY.max_attempts
    assert m.sender.failure is not None


#: when the held Step is delivered, and whether the old session's lease runs out first
#: (its Detach failing throughout: the Attach ends the lapsed session)
CASES = ["live_before_reattach", "after_reattach", "lapsed_before_reattach", "lapsed_after_reattach"]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("earlier", [["a"], []], ids=["holding", "empty"])
def test_a_given_up_step_of_a_session_whose_detach_failed(
    make_server: Callable[..., InProcessServer], clock: ManualClock, case: str, earlier: list[str]
) -> None:
    """``earlier``: the requests the old session holds besides the given-up Step's (none:
    the old session holds nothing on the server, so only the session itself keeps the
    new Attach out)."""
    server = make_server("", **SETTINGS)
    hold, detach = HoldBack({"Step"}), FailDetach()
    with KVCoordClient(server.address, timeout=10, retry=POLICY, interceptors=[hold, detach],
                       step_stream=False) as c:  # fmt: skip
        c.create_pool("p", wire_pool_config(32))
        m = PredictingKVCacheManager(c, "p", hash_seed="0", renew=False, lease_seconds=LEASE)
        old = m.keeper.session_id
        for rid in earlier:
            admit_prompt(m, hashed_req(rid, list(range(1, 10))))
        m.flush()
        _give_up_step(m, hold)
        detach.armed = True
        # the recovery: Detach fails (swallowed); the exclusive Attach is refused while
        # the old session lives (checked last: the invariants first)
        first = _recover(m)
        before: grpc.RpcError | None = None
        lapsed = case.startswith("lapsed")
        if lapsed:
            clock.advance(LEASE + 1)  # nothing reaps; Detach keeps failing
        else:
            detach.armed = False  # the next recovery's Detach ends the old session
        if case.endswith("before_reattach"):
            before = hold.deliver(server.address)
        lost = first if isinstance(first, RequestsLostError) else _recover(m)
        assert isinstance(lost, RequestsLostError), lost
        assert sorted(lost.request_ids) == [*earlier, "late"]
        assert m.keeper.session_id != old
        detach.armed = False
        if case.endswith("after_reattach"):
            assert_refused(hold.deliver(server.address), grpc.StatusCode.NOT_FOUND, "SESSION_EXPIRED")
        admit_prompt(m, hashed_req("b", NEW))
        _check(server, c, m, {"b"})
        # another delivery of the held Step now: refused whatever came before
        assert_refused(hold.deliver(server.address), grpc.StatusCode.NOT_FOUND, "SESSION_EXPIRED")
        _check(server, c, m, {"b"})
        m.close()
    # how it held: the first recovery was refused the pool, loudly, the old session's
    # id kept (so the next recovery sends its Detach again)
    assert not isinstance(first, RequestsLostError), "the new session was made while the old one lived"
    assert first.reason == "POOL_EXCLUSIVE", first
    assert detach.failed >= 1
    if case == "live_before_reattach":
        assert before is None  # the old session still lived: applied there, then freed with it
    elif case == "lapsed_before_reattach":  # (the call ends the lapsed session first)
        assert_refused(before, grpc.StatusCode.NOT_FOUND, "SESSION_EXPIRED")
