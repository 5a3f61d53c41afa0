"""What a pool rebuilt from the cluster store holds of its writer's records travels
with the pool (``PoolService.held``, registry_state.py): through handovers, store bases
written by later owners, and snapshots, to the one journal that can use it.

r0's instance "r0-dead" was killed after the store committed its record 10 of pool p
and before its own journal did (that journal ends at 9). r1 rebuilds p from the store
and answers the retry from record 10 (a fence naming r0-dead's position 10), then the
pool moves on and reaches r0 again. r0 must hold position 10 of r0-dead from then on,
or the client's next call "proves" its data directory restored. Before the fix the
rebuilt state said nothing of it (only the replica rebuilding it learned it, by a value
the loader popped), so a handover back lost it (tests/cluster/test_store_ahead_handed_back.py
is the same with real replicas). No gRPC, no etcd: the rebuild, the handover's state
(CBOR), the rule (positions.py)."""

from __future__ import annotations

from typing import Any

import cbor2
import pytest
from kvcoord.service.errors import ServiceError
from kvcoord.service.fences import Fence
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.registry_state import adopt_pool, dump_pool, dump_state, journaled_limits, load_state
from kvcoord.service.sessions import SessionTable
from kvcoord.service.store_journal import encode_base
from kvcoord.service.store_rebuild import HELD_WRITERS, rebuild
from kvcoord.service.testing import ManualClock
from support import wire_pool_config

R0_KEY, R1_KEY, R2_KEY = b"0" * 32, b"1" * 32, b"2" * 32


def _registry(instance: str, key: bytes | None) -> PoolRegistry:
    clock = ManualClock()
    r = PoolRegistry(Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20),
                     instance, clock=clock)  # fmt: skip
    r.positions.key = key
    return r


def _stream(owner: PoolRegistry, tail: list[int]) -> dict[int, list[Any]]:
    """The pool's stream as ``owner`` writes it: a base of its state now, then records
    (term changes, the simplest) at the positions ``tail`` of its journal."""
    base = encode_base(dump_pool(owner, "p"), owner.instance_id, journaled_limits(owner, owner.limits), 0.0,
                       owner.positions.key)  # fmt: skip
    records = {0: cbor2.loads(base)}
    for seq, position in enumerate(tail, 1):
        records[seq] = [position, ["term", 0.0, "p", seq]]
    return records


def _rebuilt(streams: dict[int, dict[int, list[Any]]]) -> dict[str, Any]:
    got = rebuild(streams, lambda writer: _registry(writer, None), "p")
    assert got is not None
    return got[0]


def _loaded(at: PoolRegistry, value: dict[str, Any]) -> dict[str, int]:
    """``value`` loaded at ``at`` as a handover or a rebuild loads it: the ends raised."""
    service = adopt_pool(at, cbor2.loads(cbor2.dumps(value)))
    return at.positions.brought(service.held)


def _told(at: PoolRegistry, position: int) -> Fence:
    return Fence("r0-dead", 1, position=position, position_tag=at.positions.tag("r0-dead", position))


def test_a_record_the_store_held_reaches_its_journal_through_handovers_and_later_bases() -> None:
    dead = _registry("r0-dead", R0_KEY)
    dead.create("p", wire_pool_config(16))
    r0 = _registry("r0-now", R0_KEY)  # r0 restarted: its journal holds r0-dead's records 1..9
    r0.positions.started("r0-dead", 1)
    r0.positions.started("r0-now", 10)

    value = _rebuilt({1: _stream(dead, [8, 9, 10])})  # r1 takes p over from r0-dead's stream
    r1 = _registry("r1-now", R1_KEY)
    assert _loaded(r1, value) == {}  # r1's journal names none of r0's instances
    assert r1.pools["p"].held == {"r0-dead": [10, r0.positions.tag("r0-dead", 10)]}

    # r1 writes its own base and records to the store, then dies: r2 takes p over from there
    value = _rebuilt({1: _stream(dead, [8, 9, 10]), 2: _stream(r1, [4, 5])})
    r2 = _registry("r2-now", R2_KEY)
    assert _loaded(r2, value) == {}
    held = r2.pools["p"].held
    assert held["r0-dead"][0] == 10 and held["r1-now"][0] == 5

    snapshot = dump_state(r2, r2.instance_id, r2.limits)  # r2 restarts from a snapshot
    r2_again = _registry("r2-next", R2_KEY)
    load_state(r2_again, cbor2.loads(cbor2.dumps(snapshot)))
    assert r2_again.pools["p"].held == held

    with pytest.raises(ServiceError, match="restored from an older copy"):  # not handed back yet
        r0.positions.check(_told(r0, 10))
    assert _loaded(r0, dump_pool(r2_again, "p")) == {"r0-dead": 10}  # handed back to r0
    r0.positions.check(_told(r0, 10))  # no restore: r0 holds it now
    with pytest.raises(ServiceError, match="restored from an older copy"):
        r0.positions.check(_told(r0, 11))  # nothing holds 11: still proof
    assert r0.positions.ends == {"r0-dead": 10}


def test_a_later_rebuild_keeps_the_highest_position_of_a_writer() -> None:
    dead = _registry("r0-dead", R0_KEY)
    dead.create("p", wire_pool_config(16))
    dead.pools["p"].held = {"r0-dead": [12, dead.positions.tag("r0-dead", 12)]}  # (made up: a later base)
    value = _rebuilt({1: _stream(dead, [10])})
    assert value["pool"]["held"]["r0-dead"][0] == 12


@pytest.mark.parametrize("held", [{"x": [1, 5]}, {"x": ["1", b""]}, {"x": [1]}, {1: [1, b""]}])
def test_a_handed_over_state_with_held_positions_of_another_shape_is_refused(held: Any) -> None:
    owner = _registry("r1-now", R1_KEY)
    owner.create("p", wire_pool_config(16))
    value = dump_pool(owner, "p")
    value["pool"]["held"] = held
    r0 = _registry("r0-now", R0_KEY)
    with pytest.raises((TypeError, ValueError)):
        adopt_pool(r0, value)
    assert "p" not in r0.pools


def test_a_pool_keeps_the_last_records_of_its_latest_writers_only() -> None:
    """One entry per rebuild with records (a replica restarted daily adds one each
    time): the oldest go once there are HELD_WRITERS."""
    owner = _registry("w0", R1_KEY)
    owner.create("p", wire_pool_config(16))
    tag = owner.positions.tag("x", 1)
    owner.pools["p"].held = {f"w{n}": [1, tag] for n in range(HELD_WRITERS)}
    value = _rebuilt({1: _stream(owner, [7])})  # w0 wrote again: its entry is the latest
    held = value["pool"]["held"]
    assert len(held) == HELD_WRITERS and list(held)[-1] == "w0" and held["w0"][0] == 7
    other = _registry("w-new", R1_KEY)
    other.create("p", wire_pool_config(16))
    other.pools["p"].held = dict(held)
    held = _rebuilt({1: _stream(other, [3])})["pool"]["held"]
    assert len(held) == HELD_WRITERS and "w1" not in held and list(held)[-1] == "w-new"
