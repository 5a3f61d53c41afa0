"""The event journal keeps its most common events in a compact form (fewer objects the
cyclic collector tracks) and gives back events equal to those published, every kind."""

from __future__ import annotations

import gc
import random

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.engine.events import block_removed, block_stored
from kvcoord.service.events import EventJournal, event_memory_bytes


def _hash(rng: random.Random, n: int = 32) -> bytes:
    return rng.randbytes(n)


def _every_kind(rng: random.Random) -> list[KVCacheEvent]:
    """One of each shape the journal must give back unchanged: the compact ones (a
    plain one-hash BlockRemoved, a vllm-0.16 BlockStored) and each field that keeps an
    event out of the compact form."""
    a, b, c = _hash(rng), _hash(rng), _hash(rng)
    tokens = tuple(rng.randrange(1 << 31) for _ in range(16))
    return [
        block_removed(a),  # compact
        BlockRemoved((a,)),  # compact (built the ordinary way)
        BlockRemoved((a, b)),
        BlockRemoved((a,), "CPU"),
        BlockRemoved((a,), cache_prefix=b"\x01\x02"),
        block_removed(a, b"\x03", None),
        BlockRemoved((a,), group_idx=0),
        block_removed(a, b"", 2),
        BlockRemoved([a]),  # type: ignore[arg-type]  # a list of hashes stays a list
        BlockRemoved((_hash(rng, 8),)),  # a shorter hash
        block_stored((a,), None, tokens, 16, None, None),  # compact
        block_stored((b,), a, tokens, 16, None, None),  # compact
        block_stored((a, b, c), None, tokens * 3, 16, None, None),  # compact, several hashes
        block_stored((), None, (), 16, None, None),  # compact, no hash
        BlockStored((a,), None, tokens, 16, 7, "adapter"),
        BlockStored((a,), None, tokens, 16, None, "adapter"),
        BlockStored((a,), None, tokens, 16, 7, None),
        BlockStored((a,), b, tokens, 16, None, None, "CPU"),
        BlockStored((a,), b, tokens, 16, None, None, cache_prefix=b"\x04"),
        BlockStored((a,), b, tokens, 16, None, None, group_idx=0),
        BlockStored((a,), b, tokens, 16, None, None, extra_keys=(None,)),
        BlockStored((a,), b, tokens, 16, None, None, kv_cache_spec_kind="full_attention"),
        BlockStored((a,), b, tokens, 16, None, None, kv_cache_spec_sliding_window=128),
        BlockStored((a,), b, tokens, 16, None, None, lookahead_token_ids=((1, 2),)),
        BlockStored([a], None, list(tokens), 16, None, None),  # type: ignore[arg-type]
        AllBlocksCleared(),
    ]


def _same(got: list[KVCacheEvent], want: list[KVCacheEvent]) -> None:
    assert got == want
    for g, w in zip(got, want, strict=True):  # equal field by field, and of the same types
        assert type(g) is type(w)
        if not isinstance(w, AllBlocksCleared):
            assert type(g.block_hashes) is type(w.block_hashes)  # type: ignore[union-attr]
            if isinstance(w, BlockStored):
                assert type(g.token_ids) is type(w.token_ids)  # type: ignore[union-attr]


def test_every_kind_of_event_comes_back_equal() -> None:
    """since, kept and a restore give back events equal to the published ones (their
    fields of the same types), whether the journal kept them compact or as they were;
    the byte estimate is that of the published events."""
    rng = random.Random(5)
    events = _every_kind(rng)
    j = EventJournal(capacity=1000)
    assert j.publish(events) == len(events)
    _same([e for _, e in j.since(0)], events)
    _same([e for _, e in j.kept()], events)
    assert [s for s, _ in j.kept()] == list(range(1, len(events) + 1))
    assert j.bytes == sum(map(event_memory_bytes, events))
    for after in range(len(events) + 1):
        _same([e for _, e in j.since(after, limit=3)], events[after : after + 3])
    restored = EventJournal(capacity=1000)
    restored.restore(j.kept(), j.last_sequence)
    _same([e for _, e in restored.kept()], events)
    assert restored.bytes == j.bytes


def test_random_mixes_come_back_equal_across_drops() -> None:
    """Random batches of every kind, a journal bounded by count and by bytes: what is
    kept is the newest published events, equal to them, with their sequence numbers."""
    from kvcoord.service import events as events_module

    rng = random.Random(23)
    old_compact = events_module._COMPACT_AFTER
    events_module._COMPACT_AFTER = 8  # the journal's list cut often
    try:
        for capacity, max_bytes in ((7, 0), (50, 0), (1000, 3000), (1000, 0)):
            j = EventJournal(capacity, max_bytes)
            published: list[KVCacheEvent] = []
            for _ in range(30):
                pool = _every_kind(rng)
                batch = [rng.choice(pool) for _ in range(rng.randrange(0, 15))]
                j.publish(iter(batch) if rng.random() < 0.3 else batch)
                published += batch
                kept = j.kept()
                assert j.last_sequence == len(published)
                _same([e for _, e in kept], published[len(published) - len(kept) :])
                first = len(published) - len(kept) + 1
                assert [s for s, _ in kept] == list(range(first, len(published) + 1))
                for _ in range(4):  # reads from anywhere: within, before and across the last batch
                    after = rng.randrange(first - 2, len(published) + 1)
                    limit = rng.choice([None, 1, 4])
                    got = j.since(after, limit)
                    want = published[max(after, first - 1) :][:limit]
                    _same([e for _, e in got], want)
    finally:
        events_module._COMPACT_AFTER = old_compact


def test_plain_evictions_and_decode_stores_leave_the_collector_little_to_track() -> None:
    """A served decode Step's events (one-hash BlockRemoved events of evicted blocks, a
    one-block BlockStored per block filled) kept in the journal: once the collector has
    seen them, the journal holds none of them in an object it tracks (it held three or
    four per event: the event and its tuples)."""
    rng = random.Random(9)
    j = EventJournal(capacity=1 << 20)
    n = 3000
    parent = _hash(rng)
    gc.collect()
    before = len(gc.get_objects())
    batch: list[KVCacheEvent] = []
    for k in range(n):
        h = _hash(rng)
        if k % 4:
            batch.append(block_removed(h))
        else:
            batch.append(block_stored((h,), parent, tuple(range(k, k + 16)), 16, None, None))
    j.publish(batch)
    del batch
    j.publish([AllBlocksCleared()])  # (the last batch is kept as it was until the next one)
    gc.collect()  # (a tuple of untracked items is untracked by the collector's first look)
    tracked = len(gc.get_objects()) - before
    assert tracked < n // 10, f"{tracked} more objects tracked for {n} events kept"
    assert len(j.kept()) == n + 1


def test_the_last_batch_is_read_as_published_until_the_next() -> None:
    """A reader keeping up (TakeEvents after each Step) gets the very objects the last
    publish gave; once another batch comes, equal ones rebuilt from the compact form."""
    rng = random.Random(3)
    j = EventJournal(capacity=1000)
    first, second = _every_kind(rng), _every_kind(rng)
    j.publish(first)
    assert all(g is w for (_, g), w in zip(j.since(0), first, strict=True))
    j.publish(second)
    _same([e for _, e in j.since(0)], first + second)
    assert all(g is w for (_, g), w in zip(j.since(len(first)), second, strict=True))
    assert not all(g is w for (_, g), w in zip(j.since(0), first, strict=True))


def test_events_stay_compact_across_the_lists_cuts() -> None:
    """Many batches through a journal that drops and cuts its list often: what it keeps,
    but for the last batch, stays compact (nothing the collector tracks)."""
    from kvcoord.service import events as events_module

    rng = random.Random(4)
    old_compact = events_module._COMPACT_AFTER
    events_module._COMPACT_AFTER = 64
    try:
        j = EventJournal(capacity=2000)
        gc.collect()
        before = len(gc.get_objects())
        for _ in range(60):
            j.publish([block_removed(_hash(rng)) for _ in range(100)])
        j.publish([AllBlocksCleared()])
        gc.collect()
        tracked = len(gc.get_objects()) - before
        assert tracked < 20, f"{tracked} more objects tracked for {len(j.kept())} events kept"
        assert len(j.kept()) == 2000
    finally:
        events_module._COMPACT_AFTER = old_compact
