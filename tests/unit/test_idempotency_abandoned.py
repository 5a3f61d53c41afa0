"""Calls a client gave up on, named by its session's later calls (``abandoned``), in the
idempotency store (no gRPC, no engine): a key the store does not hold gets a tombstone,
so its delivery later is refused (ABORTED, ANSWER_EVICTED), never looked up as new; a
key it holds keeps its answer; the tombstone's number joins the session's floor when its
window passes; tombstones count against the budget and travel with the entries."""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.idempotency import IdempotencyStore, entry_bytes
from kvcoord.service.testing import ManualClock


def _refused(
    store: IdempotencyStore, session: str, key: str, sequence: int, rpc: str = "Allocate"
) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        store.lookup(session, rpc, key, b"body", sequence)
    return refused.value


def test_a_given_up_key_never_seen_is_refused_when_it_arrives_and_after_its_window() -> None:
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.abandon("s", "free-call", [("lost", 5)])
    for rpc in ("Allocate", "Step", "Free"):  # whatever the call was (the store never saw it)
        err = _refused(store, "s", "lost", 5, rpc)
        assert (err.status, err.reason) == (Status.ABORTED, ErrorReason.ANSWER_EVICTED)
        assert "given up on by its client" in err.message
    assert store.lookup("t", "Allocate", "lost", b"body", 5) is None  # another session's key
    assert store.lookup("s", "Step", "next", b"body", 6) is None  # newer calls are new
    clock.advance(61)  # the tombstone is forgotten: its number is the floor now
    store.expire()
    assert len(store) == 0
    assert store.export_sequences()["forgotten"] == {"s": 5}
    assert _refused(store, "s", "lost", 5).reason is ErrorReason.ANSWER_EVICTED


def test_a_given_up_key_the_store_holds_keeps_its_answer() -> None:
    """The call was applied and only its answer was lost: a retry is still answered."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s", "Step", "applied", b"body", b"answer", sequence=3)
    store.abandon("s", "later", [("applied", 3)])
    assert store.lookup("s", "Step", "applied", b"body", 3) == b"answer"


def test_abandoned_keys_are_checked() -> None:
    store = IdempotencyStore(ManualClock(), window=60, max_bytes=1 << 20)
    for bad in ("", "own"):
        with pytest.raises(ServiceError) as refused:
            store.abandon("s", "own", [("fine", 1), (bad, 2)])
        assert refused.value.status is Status.INVALID
        assert len(store) == 0  # nothing kept of a refused list
    store.abandon("s", "own", [])  # nothing named: nothing kept
    assert len(store) == 0


def test_a_given_up_key_under_the_floor_needs_no_tombstone() -> None:
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s", "Step", "k", b"body", b"a", sequence=9)
    clock.advance(61)
    store.expire()  # floor 9
    store.abandon("s", "own", [("older", 4)])
    assert len(store) == 0
    assert _refused(store, "s", "older", 4).reason is ErrorReason.ANSWER_EVICTED


def test_tombstones_count_against_the_budget() -> None:
    """Each costs an entry; when the keys of the last half window fill the budget, the
    naming call is refused before it is applied (RESOURCE_EXHAUSTED)."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=2 * entry_bytes("s", "k1"))
    store.abandon("s", "own", [("k1", 1), ("k2", 2)])
    assert store.entry_bytes == store.bytes == 2 * entry_bytes("s", "k1")
    with pytest.raises(ServiceError) as full:
        store.abandon("s", "own", [("k3", 3)])
    assert full.value.status is Status.EXHAUSTED
    clock.advance(31)  # past every client's retries: the oldest make room, their numbers the floor
    store.abandon("s", "own", [("k3", 3)])
    assert _refused(store, "s", "k1", 1).reason is ErrorReason.ANSWER_EVICTED
    assert _refused(store, "s", "k3", 3).reason is ErrorReason.ANSWER_EVICTED


def test_tombstones_travel_with_the_entries() -> None:
    """Restored from :meth:`export` and :meth:`export_sequences` (a snapshot, a
    handover), a tombstone still refuses its key, and its number still becomes the
    floor when its window passes."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.abandon("s", "own", [("lost", 7)])
    clock.advance(20)
    moved = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    moved.restore(store.export())
    moved.restore_sequences(store.export_sequences())
    assert _refused(moved, "s", "lost", 7, "Free").reason is ErrorReason.ANSWER_EVICTED
    clock.advance(41)
    moved.expire()
    assert moved.export_sequences()["forgotten"] == {"s": 7}
    assert _refused(moved, "s", "lost", 7).reason is ErrorReason.ANSWER_EVICTED


def test_as_of_makes_a_change_at_a_records_time() -> None:
    """Replay's clock: keys older than the window then are forgotten first, and a
    tombstone made then expires by that time, not by now."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    clock.advance(100)
    store.as_of(50, lambda: store.abandon("s", "own", [("lost", 2)]))
    clock.advance(11)  # 61 s after the record's time
    store.expire()
    assert store.export_sequences()["forgotten"] == {"s": 2}
