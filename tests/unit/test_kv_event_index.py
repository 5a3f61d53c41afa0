"""What a KV event publisher keeps of its subscribers' view (kv_event_index.py): the
snapshot a replay it cannot answer whole sends, and the removals a gap's clear rules
out."""

from __future__ import annotations

from collections import Counter

from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.service.kv_event_index import PublishedBlocks, StoredSinceGap

A, B, C, D = (bytes([i]) * 32 for i in range(1, 5))


def _index(events: list[KVCacheEvent]) -> Counter[tuple[int | None, bytes]]:
    index: Counter[tuple[int | None, bytes]] = Counter()
    for e in events:
        if isinstance(e, BlockStored):
            index.update((e.group_idx, h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.subtract((e.group_idx, h) for h in e.block_hashes)
        else:
            index.clear()
    return +index


def test_the_snapshot_holds_what_every_batch_sent_leaves_stored() -> None:
    """A run whose middle block was removed comes back as two runs, each with its own
    blocks' tokens and parent; a block stored twice and removed once stays once."""
    run = BlockStored((A, B, C), None, tuple(range(12)), 4, None, None, extra_keys=(("x",), None, ("z",)))
    sent: list[KVCacheEvent] = [
        BlockStored((D,), None, (7, 7, 7, 7), 4, None, None),
        run,
        BlockStored((D,), None, (7, 7, 7, 7), 4, None, None),
        BlockRemoved((B, D)),
    ]
    published = PublishedBlocks()
    published.apply(sent)
    snapshot = published.snapshot()
    assert isinstance(snapshot[0], AllBlocksCleared)
    assert _index(snapshot) == _index(sent) == Counter({(None, A): 1, (None, C): 1, (None, D): 1})
    parts = [e for e in snapshot if isinstance(e, BlockStored) and e.block_hashes[0] in (A, C)]
    assert [(e.block_hashes, e.parent_block_hash, e.token_ids, e.extra_keys) for e in parts] == [
        ((A,), None, (0, 1, 2, 3), (("x",),)),
        ((C,), B, (8, 9, 10, 11), (("z",),)),
    ]
    published.apply([AllBlocksCleared()])
    assert published.snapshot() == [AllBlocksCleared()]


def test_after_a_gaps_clear_only_removals_of_blocks_stored_since_are_kept() -> None:
    since = StoredSinceGap()
    assert since.keep([BlockRemoved((A,))]) == [BlockRemoved((A,))]  # (no gap: as they are)
    since.start()
    kept = since.keep(
        [BlockStored((B,), None, (1, 2, 3, 4), 4, None, None), BlockRemoved((A, B)), BlockRemoved((B,))]
    )
    assert kept[1:] == [BlockRemoved((B,))]
    assert since.keep([AllBlocksCleared(), BlockRemoved((C,))]) == [AllBlocksCleared(), BlockRemoved((C,))]
