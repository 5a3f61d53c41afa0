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


class _ModelJournal:
    """The journal's rules, one event at a time (what EventJournal did before it kept
    its events in bulk): the reference the bulk journal is compared with."""

    def __init__(self, capacity: int, max_bytes: int) -> None:
        from kvcoord.service.events import event_memory_bytes

        self.size = event_memory_bytes
        self.capacity, self.max_bytes = capacity, max_bytes
        self.kept: list[tuple[int, object, int]] = []
        self.last = 0

    def publish(self, events: list[object]) -> None:
        for e in events:
            self.last += 1
            self.kept.append((self.last, e, self.size(e)))  # type: ignore[arg-type]
        while len(self.kept) > self.capacity or (
            self.max_bytes and sum(k[2] for k in self.kept) > self.max_bytes and len(self.kept) > 1
        ):
            del self.kept[0]

    def since(self, after: int, limit: int | None, upto: int | None) -> list[tuple[int, object]]:
        out = [(s, e) for s, e, _ in self.kept if s > after and (upto is None or s <= upto)]
        return out if limit is None else out[:limit]


def test_bulk_journal_keeps_what_one_event_at_a_time_keeps() -> None:
    """Random publishes (event kinds and sizes mixed), bounds by count and by bytes, reads
    with limits, a restore and a resize: the kept events, their sequence numbers, the byte
    estimate and every read equal the one-at-a-time model's, across compactions."""
    import random

    from kvcoord.engine import BlockRemoved, BlockStored
    from kvcoord.service import events as events_module

    rng = random.Random(23)
    old_compact = events_module._COMPACT_AFTER
    events_module._COMPACT_AFTER = 8  # compact often
    try:
        for case in range(60):
            capacity = rng.choice([1, 3, 10, 50, 1000])
            max_bytes = rng.choice([0, 0, 400, 1500, 6000])
            j, m = EventJournal(capacity, max_bytes), _ModelJournal(capacity, max_bytes)
            for _ in range(40):
                batch: list[object] = []
                for _ in range(rng.randrange(0, 12)):
                    kind = rng.randrange(3)
                    h = tuple(bytes([rng.randrange(256)]) * 32 for _ in range(rng.randrange(1, 4)))
                    if kind == 0:
                        batch.append(BlockRemoved(h[:1]))
                    elif kind == 1:
                        batch.append(BlockStored(h, None, tuple(range(16 * len(h))), 16, None, None))
                    else:
                        batch.append(AllBlocksCleared())
                assert j.publish(iter(batch) if rng.random() < 0.3 else batch) == len(batch)
                m.publish(batch)
                assert j.kept() == [(s, e) for s, e, _ in m.kept]
                assert j.bytes == sum(k[2] for k in m.kept)
                assert j.last_sequence == m.last
                assert j.oldest_sequence == (m.kept[0][0] if m.kept else m.last + 1)
                for _ in range(3):
                    after = rng.randrange(-1, m.last + 2)
                    limit = rng.choice([None, 0, 1, 5])
                    upto = rng.choice([None, rng.randrange(0, m.last + 2)])
                    assert j.since(after, limit, upto) == m.since(after, limit, upto)
                    assert j.missed(after) == (after < m.last and after + 1 < j.oldest_sequence)
                if case % 3 == 0 and rng.random() < 0.1:
                    restored = EventJournal(capacity, max_bytes)
                    restored.restore(j.kept(), j.last_sequence)
                    assert (restored.kept(), restored.bytes) == (j.kept(), j.bytes)
                    j = restored
                if rng.random() < 0.05:
                    capacity = max(1, capacity // 2)
                    j.resize(capacity)
                    m.capacity = capacity
                    m.publish([])
                    assert j.kept() == [(s, e) for s, e, _ in m.kept]
    finally:
        events_module._COMPACT_AFTER = old_compact


def test_restore_refuses_events_not_numbered_in_a_row() -> None:
    import pytest

    j = EventJournal(10)
    with pytest.raises(ValueError):
        j.restore([(1, AllBlocksCleared()), (3, AllBlocksCleared())], 3)
    j.restore([(4, AllBlocksCleared()), (5, AllBlocksCleared())], 5)
    assert j.oldest_sequence == 4 and [s for s, _ in j.kept()] == [4, 5]


def test_a_reader_cancelled_as_an_event_comes_is_cancelled() -> None:
    """A watch stream closed (its reader task cancelled) in the same loop turn that an
    event wakes it ends cancelled. With asyncio.wait_for on Python 3.11 the wake-up
    won over the cancellation: the reader went on waiting for its whole timeout."""
    import asyncio

    async def run() -> None:
        j = EventJournal(capacity=8)
        j.durable_sequence = 0  # journal mode: published events wait for their commit
        reader = asyncio.get_running_loop().create_task(j.wait(0, 60.0))
        await asyncio.sleep(0)  # the reader waits for a deliverable event
        j.publish([AllBlocksCleared()])  # wakes it (still nothing deliverable: not durable)
        reader.cancel()  # ... in the same turn as its stream closes
        try:
            await asyncio.wait([reader], timeout=5.0)  # a bound, not a measurement
            assert reader.cancelled(), "the cancellation was lost: the reader waits on"
        finally:
            reader.cancel()

    asyncio.run(run())
