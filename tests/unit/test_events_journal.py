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
    """add_events (the Step's in-place path) and event_to_pb write every kind of event
    and every optional field as the proto spells them."""
    from kvcoord.engine import BlockRemoved, BlockStored
    from kvcoord.v1 import allocator_pb2 as pb
    from kvcoord.wire import add_events, event_to_pb

    a, b, c, d = b"a" * 32, b"b" * 32, b"c" * 32, b"d" * 32
    events = [
        BlockStored((a, b), None, tuple(range(32)), 16, None, None),
        BlockStored((c,), b, tuple(range(16)), 16, 7, "adapter", "CPU"),
        BlockRemoved((a,)),
        BlockRemoved((c, d), "CPU"),
        AllBlocksCleared(),
    ]
    want = [
        pb.KVEvent(block_stored=pb.BlockStored(block_hashes=[a, b], token_ids=range(32), block_size=16, medium="GPU")),
        pb.KVEvent(
            block_stored=pb.BlockStored(
                block_hashes=[c], parent_block_hash=b, token_ids=range(16), block_size=16, lora_id=7,
                lora_name="adapter", medium="CPU",
            )
        ),
        pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=[a], medium="GPU")),
        pb.KVEvent(block_removed=pb.BlockRemoved(block_hashes=[c, d], medium="CPU")),
        pb.KVEvent(all_blocks_cleared=pb.AllBlocksCleared()),
    ]  # fmt: skip
    got = pb.StepResponse()
    add_events(got.events, events)
    assert list(got.events) == want
    assert [event_to_pb(e) for e in events] == want
    assert [e.WhichOneof("event") for e in got.events] == [w.WhichOneof("event") for w in want]
    assert not got.events[0].block_stored.HasField("parent_block_hash")
    assert not got.events[0].block_stored.HasField("lora_id")
