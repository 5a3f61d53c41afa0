"""Sliding-window attention."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ..block_pool import BlockPool
from ..specs import AttentionSpec, SlidingWindowSpec
from .base import SingleTypeKVCacheManager, cdiv

__all__ = ["SlidingWindowManager"]


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Only the last ``sliding_window`` tokens are attended; older blocks become null.

    A hit needs ``cdiv(w - 1, bs)`` contiguous cached blocks ending at the hit (one
    more with EAGLE), searched right to left; a shorter run touching position 0 is
    also a hit.
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        assert isinstance(spec, SlidingWindowSpec)
        self.sliding_window = spec.sliding_window

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1)

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        group_ids: Sequence[int],
        block_pool: BlockPool,
        spec: AttentionSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> list[list[int]]:
        assert isinstance(spec, SlidingWindowSpec)
        bs = spec.block_size
        need = cdiv(spec.sliding_window - 1, bs) + (1 if use_eagle else 0)
        max_blocks = min(max_length // bs, len(block_hashes))
        aligned = bs == alignment_tokens
        if aligned and len(group_ids) == 1:
            get = block_pool.cached_block_hash_to_block.first[group_ids[0]].get
            # The last ``need`` blocks all cached (the usual hit): they are the rightmost
            # run, found without looking up the blocks before them.
            tail = (
                list(map(get, block_hashes[max_blocks - need : max_blocks]))
                if 0 < need <= max_blocks
                else None
            )
            if tail is not None and None not in tail:
                computed = [[0] * (max_blocks - need) + cast(list[int], tail)]
            else:
                computed = [_last_run(list(map(get, block_hashes[:max_blocks])), need)]
        else:
            computed = _search(block_hashes, max_blocks, group_ids, block_pool, bs, need, alignment_tokens)
        if use_eagle and computed[0]:
            for lst in computed:
                lst.pop()
        return computed


def _last_run(ids: list[int | None], need: int) -> list[int]:
    """The aligned search on the looked-up ids (``None`` = miss): the rightmost run of
    ``need`` hits, nulls before it; else the run of hits starting at position 0.

    Runs are found with C-level ``list.index`` on the reversed list.
    """
    need = max(need, 1)  # a single hit already ends the right-to-left scan
    n = len(ids)
    rev = ids[::-1]
    start = 0
    while start < n:
        try:
            miss = rev.index(None, start)
        except ValueError:
            miss = n
        if miss - start >= need:
            i = n - start - need
            return [0] * i + cast(list[int], ids[i : i + need])
        if miss == n:
            return cast(list[int], ids[: n - start])  # the run touching position 0
        start = miss + 1
    return []


def _search(
    block_hashes: Sequence[bytes],
    max_blocks: int,
    group_ids: Sequence[int],
    block_pool: BlockPool,
    bs: int,
    need: int,
    alignment_tokens: int,
) -> list[list[int]]:
    """The general right-to-left search (several groups, or hit ends aligned to a
    coarser LCM)."""
    computed = [[0] * max_blocks for _ in group_ids]
    run = 0
    aligned = bs == alignment_tokens
    for i in range(max_blocks - 1, -1, -1):
        cached = block_pool.get_cached_block(block_hashes[i], group_ids)
        if cached is None:
            run = 0
            continue
        if run == 0 and not aligned and ((i + 1) * bs) % alignment_tokens:
            continue
        for lst, block_id in zip(computed, cached, strict=False):
            lst[i] = block_id
        run += 1
        if run >= need:
            for lst in computed:
                del lst[i + run :]
            return computed
    for lst in computed:
        del lst[run:]
    if not aligned:
        while (len(computed[0]) * bs) % alignment_tokens:
            for lst in computed:
                lst.pop()
    return computed
