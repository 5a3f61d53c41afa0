"""Call sequence numbers in the idempotency store (no gRPC, no engine): a keyed call
whose key was forgotten (its window passed, or the budget dropped it) and whose number is
at or below the highest forgotten one of its session is a copy delivered late, refused
(ABORTED, ANSWER_EVICTED) before anything is applied; calls without a number are looked
up as before; the numbers travel with the entries (snapshots, handovers)."""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.idempotency import IdempotencyStore, entry_bytes
from kvcoord.service.testing import ManualClock


def _late(store: IdempotencyStore, session: str, key: str, sequence: int) -> ServiceError:
    with pytest.raises(ServiceError) as refused:
        store.lookup(session, "Step", key, b"d", sequence)
    return refused.value


def test_a_forgotten_keys_late_copy_is_refused_and_newer_calls_are_not() -> None:
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s", "Free", "k1", b"d", b"a1", sequence=10)
    clock.advance(30)
    store.remember("s", "Step", "k2", b"d", b"a2", sequence=11)
    clock.advance(31)  # k1's window passed, not k2's
    err = _late(store, "s", "k1", 10)
    assert (err.status, err.reason) == (Status.ABORTED, ErrorReason.ANSWER_EVICTED)
    assert "is not applied now" in err.message
    assert store.lookup("s", "Step", "k2", b"d", 11) == b"a2"  # a retry of a kept key
    assert store.lookup("s", "Step", "k3", b"d", 12) is None  # a new call
    assert store.lookup("s", "Step", "k0", b"d", 0) is None  # a client that sends no number
    assert store.lookup("t", "Step", "k1", b"d", 10) is None  # another session's numbers
    clock.advance(30)  # k2 forgotten too: the floor is its number now
    assert _late(store, "s", "k2", 11).reason is ErrorReason.ANSWER_EVICTED
    assert _late(store, "s", "k9", 5).reason is ErrorReason.ANSWER_EVICTED  # any older unknown call
    assert store.lookup("s", "Step", "k3", b"d", 12) is None


def test_keys_dropped_to_fit_the_budget_count_as_forgotten() -> None:
    """Keys older than half the window dropped to make room for a new key raise the
    floor as expiry does."""
    clock = ManualClock()
    per_key = entry_bytes("s", "k1")
    store = IdempotencyStore(clock, window=60, max_bytes=2 * per_key)
    store.remember("s", "Step", "k1", b"d", None, sequence=1)
    store.remember("s", "Step", "k2", b"d", None, sequence=2)
    clock.advance(31)
    assert store.lookup("s", "Step", "k3", b"d", 3) is None  # k1 made room
    store.remember("s", "Step", "k3", b"d", None, sequence=3)
    assert _late(store, "s", "k1", 1).reason is ErrorReason.ANSWER_EVICTED


def test_a_sessions_end_drops_its_numbers() -> None:
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s", "Step", "k1", b"d", b"a", sequence=7)
    clock.advance(61)
    store.expire()
    assert store.export_sequences()["forgotten"] == {"s": 7}
    store.drop_session("s")
    assert store.export_sequences() == {"forgotten": {}, "calls": []}


def test_the_numbers_travel_with_the_entries() -> None:
    """Restored from :meth:`export` and :meth:`export_sequences` (a snapshot), the
    floor is the same, and a kept key forgotten later raises it as it would have."""
    clock = ManualClock()
    store = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    store.remember("s", "Step", "old", b"d", b"a", sequence=1)
    clock.advance(40)
    store.remember("s", "Step", "kept", b"d", b"b", sequence=2)
    store.remember("t", "Step", "other", b"d", b"c", sequence=9)
    clock.advance(21)
    store.expire()
    entries, sequences = store.export(), store.export_sequences()
    assert sequences == {"forgotten": {"s": 1}, "calls": [["s", "kept", 2], ["t", "other", 9]]}
    assert store.export_sequences({"t"}) == {"forgotten": {}, "calls": [["t", "other", 9]]}

    again = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    again.restore(entries)
    again.restore_sequences(sequences)
    assert _late(again, "s", "old", 1).reason is ErrorReason.ANSWER_EVICTED
    assert again.lookup("s", "Step", "kept", b"d", 2) == b"b"
    clock.advance(40)  # "kept" forgotten after the restore
    assert _late(again, "s", "kept", 2).reason is ErrorReason.ANSWER_EVICTED
    # a snapshot written before the numbers existed has none
    older = IdempotencyStore(clock, window=60, max_bytes=1 << 20)
    older.restore_sequences(None)
    assert older.lookup("s", "Step", "old", b"d", 1) is None
