"""A pool's reservations handed over to another replica keep the time they had left
(registry_state.dump_pool with ``leases``, :func:`adopt_leases`); a replay of the
handover's journal record (a restart) and a pool rebuilt from a base in the cluster
store release them, as a restarted server does."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
from kvcoord.service import operations as op
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.registry_state import adopt_leases, adopt_pool, dump_pool
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from service.helpers import hashes
from support import wire_pool_config

PROMPT = list(range(9))  # two full blocks of 4 cached, and one more token


def _registry(instance: str) -> tuple[PoolRegistry, ManualClock]:
    clock = ManualClock()
    r = PoolRegistry(Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20),
                     instance, clock=clock)  # fmt: skip
    return r, clock


def _reserved(seconds: float) -> tuple[PoolRegistry, ManualClock, str]:
    """A registry whose pool "p" holds one reservation of PROMPT's 8-token hit."""
    r, clock = _registry("old-owner")
    return r, clock, reserve_prompt(r, seconds)


def reserve_prompt(r: PoolRegistry, seconds: float) -> str:
    """Create pool "p" in ``r``, cache PROMPT's two full blocks (request r1) and reserve
    their 8-token hit for ``seconds``: the reservation's id."""
    r.create("p", wire_pool_config(16))
    service = r.pools["p"]
    s = service.attach("sha256_cbor", 4, "0", "w", 0)
    (o,) = service.apply(
        s, [op.Allocate(op.RequestSync("r1", PROMPT[:8], hashes(PROMPT[:8]), new_request=True), 8)]
    )
    assert o.error is None
    hit = service.reserve("rsv", hashes(PROMPT), len(PROMPT), "", seconds)
    assert hit.num_tokens == 8
    return "rsv"


def _sent(value: dict[str, Any]) -> dict[str, Any]:
    return cbor2.loads(cbor2.dumps(value))  # type: ignore[no-any-return]


def test_a_handed_over_reservation_is_held_for_the_time_it_had_left() -> None:
    old, old_clock, rid = _reserved(20.0)
    old_clock.advance(5.0)  # 15 s left
    value = _sent(dump_pool(old, "p", leases=True))
    new, clock = _registry("new-owner")
    service = adopt_pool(new, value)
    adopt_leases(service, value)
    assert service.expired_reservations() == []
    clock.advance(14.5)
    assert service.expired_reservations() == []
    clock.advance(1.0)
    assert service.expired_reservations() == [rid]


def test_a_replayed_handover_and_a_store_base_release_their_reservations() -> None:
    old, _, rid = _reserved(20.0)
    replayed, _ = _registry("restarted")  # recovery replays the adopt record: adopt_pool alone
    assert adopt_pool(replayed, _sent(dump_pool(old, "p", leases=True))).expired_reservations() == [rid]
    base = _sent(dump_pool(old, "p"))  # a base in the cluster store carries no leases
    assert "leases" not in base
    rebuilt, _ = _registry("rebuilt")
    service = adopt_pool(rebuilt, base)
    adopt_leases(service, base)
    assert service.expired_reservations() == [rid]


def test_a_lease_is_held_at_most_max_reservation_seconds_and_a_bad_one_is_refused() -> None:
    old, _, rid = _reserved(20.0)
    value = _sent(dump_pool(old, "p", leases=True))
    value["leases"] = [[rid, "", 1e9]]
    new, clock = _registry("new-owner")
    service = adopt_pool(new, value)
    adopt_leases(service, value)
    clock.advance(Limits().max_reservation_seconds + 0.5)
    assert service.expired_reservations() == [rid]
    for bad in ([[rid, "", "10"]], [[rid, 3, 10.0]], [[rid, ""]]):
        with pytest.raises((TypeError, ValueError)):
            adopt_leases(service, {"leases": bad})
