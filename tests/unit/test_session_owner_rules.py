"""Who may say a session ended (``PoolRegistry.pool_of_session``, the rule behind
Heartbeat and Detach), in plain Python: a single server judges every session; in a
cluster, a replica judges only sessions of the pools it serves. A call naming a pool
this replica does not serve is sent to its owner; a call naming none, for a session
this replica does not hold, is UNAVAILABLE (it cannot know); a call naming another
pool than its session's is INVALID_ARGUMENT. (Over real replicas:
tests/cluster/test_sessions_at_non_owners.py.)"""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.ownership import not_owner
from kvcoord.service.registry import Limits, Placement, PoolRegistry
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from support import wire_pool_config


class _Replica(Placement):
    """A cluster replica serving only the pools in ``served`` (others are r9's)."""

    replica_id = "r1"

    def __init__(self, served: set[str]) -> None:
        self.served = served

    def check(self, pool: str, local: bool) -> None:
        if pool not in self.served:
            raise not_owner(pool, "r9", "127.0.0.1:9", self.replica_id)


def _registry(placement: Placement | None = None) -> PoolRegistry:
    clock = ManualClock()
    registry = PoolRegistry(
        Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20)
    )
    if placement is not None:
        registry.placement = placement
    registry.create("p", wire_pool_config(16))
    return registry


def _refusal(registry: PoolRegistry, session_id: str, pool: str = "") -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        registry.pool_of_session(session_id, pool)
    return refused.value


def test_a_single_server_judges_every_session() -> None:
    registry = _registry()
    s = registry.sessions.open("p", "w", 30.0)
    assert registry.pool_of_session(s.session_id).name == "p"
    assert registry.pool_of_session(s.session_id, "p").name == "p"
    for named in ("", "p", "elsewhere"):
        gone = _refusal(registry, "nobody", named)
        assert (gone.status, gone.reason) == (Status.NOT_FOUND, ErrorReason.SESSION_EXPIRED)


def test_a_replica_judges_only_the_sessions_of_the_pools_it_serves() -> None:
    registry = _registry(_Replica({"p"}))
    s = registry.sessions.open("p", "w", 30.0)
    assert registry.pool_of_session(s.session_id, "p").name == "p"
    assert registry.pool_of_session(s.session_id).name == "p"  # (held here: no pool needed)
    gone = _refusal(registry, "nobody", "p")  # its pool is served here: it ended
    assert (gone.status, gone.reason) == (Status.NOT_FOUND, ErrorReason.SESSION_EXPIRED)
    elsewhere = _refusal(registry, "nobody", "q")  # another replica's pool: ask it
    assert (elsewhere.status, elsewhere.reason, elsewhere.owner) == (
        Status.PRECONDITION,
        ErrorReason.NOT_OWNER,
        "127.0.0.1:9",
    )
    unnamed = _refusal(registry, "nobody")
    assert unnamed.status == Status.UNAVAILABLE and "only the owner of its pool" in str(unnamed)
    wrong = _refusal(registry, s.session_id, "q")
    assert wrong.status == Status.INVALID and "attached to pool 'p'" in str(wrong)
