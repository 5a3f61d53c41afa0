"""The event journal: every reader learns of every gap, wherever its cursor is."""

from __future__ import annotations

from kvcoord.engine import AllBlocksCleared
from kvcoord.service.events import EventJournal


def test_missed_is_right_for_every_cursor() -> None:
    """A cursor behind the oldest kept event has missed some; one at or after it has not."""
    j = EventJournal(capacity=3)
    j.publish(AllBlocksCleared() for _ in range(5))  # keeps 3, 4, 5
    assert j.oldest_sequence == 3
    assert [j.missed(c) for c in range(6)] == [True, True, False, False, False, False]
    assert [seq for seq, _ in j.since(1)] == [3, 4, 5]
    j.publish([AllBlocksCleared()] * 3)  # keeps 6, 7, 8: a reader at 4 missed 5
    assert j.missed(4) and not j.missed(5) and not j.missed(8)


def test_events_filled_in_place_equal_the_built_ones() -> None:
    """add_events (the Step's in-place path) writes exactly what event_to_pb builds, for
    every kind of event and every optional field."""
    from kvcoord.engine import BlockRemoved, BlockStored
    from kvcoord.service.convert import add_events, event_to_pb
    from kvcoord.v1 import allocator_pb2 as pb

    events = [
        BlockStored((b"a" * 32, b"b" * 32), None, tuple(range(32)), 16, None, None),
        BlockStored((b"c" * 32,), b"b" * 32, tuple(range(16)), 16, 7, "adapter", "CPU"),
        BlockRemoved((b"a" * 32,)),
        BlockRemoved((b"c" * 32, b"d" * 32), "CPU"),
        AllBlocksCleared(),
    ]
    got = pb.StepResponse()
    add_events(got.events, events)
    assert list(got.events) == [event_to_pb(e) for e in events]
    assert got.events[1].block_stored.lora_name == "adapter"
    assert got.events[1].block_stored.HasField("parent_block_hash")
    assert not got.events[0].block_stored.HasField("parent_block_hash")
