"""The block pool shared by every KV cache group of one pool."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from .block_hash_map import BlockHashToBlockMap, KeyHook
from .block_pool_partial import PartialKeys
from .blocks import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, block_removed, block_stored
from .free_queue import FreeKVCacheBlockQueue
from .hash_list import NAMESPACE_PREFIX_BYTES, hashes_at_block_size, request_keys
from .request import Request
from .types import BlockHashWithGroupId, BlockId

# The map is re-exported: ``from kvcoord.engine.block_pool import BlockHashToBlockMap`` works.
__all__ = ["BlockHashToBlockMap", "BlockPool", "KeyHook"]


class BlockPool(PartialKeys):
    """Physical blocks, the free queue, the prefix-cache map and the event queue.

    Block 0 is popped at construction and becomes the null block. Usable capacity is
    ``num_blocks - 1``. Block objects are created on first use, in id order
    (``blocks`` holds the created ones, indexed by id); a block never used is free,
    uncached and at the queue position vLLM would give it, so laziness is invisible.

    Args:
        num_blocks: blocks including the null block.
        enable_caching: whether blocks are hashed and looked up.
        hash_block_size: granularity of request block hashes.
        enable_kv_cache_events: whether events are queued.
        num_groups: KV cache groups sharing the pool.
        materialize: create every block up front (a reference for tests).
        prepend_unhashed_frees: the vllm-0.33 free order (see
            :class:`~kvcoord.engine.profiles.ProfileRules`): freed blocks without a hash
            go to the head of the free queue.
        group_event_fields: per group, the fields vLLM 0.33 adds to its events
            (``group_idx``, spec kind, sliding window); ``None`` for 0.16's events.
        num_hash_lookahead_tokens: vLLM 0.33's L: BlockStored events list the L tokens
            after each stored block (``lookahead_token_ids``).
        multi_key_blocks: vLLM 0.33's partial-tail entries (full-attention groups whose
            block is larger than the hash block): a block may hold a partial key, and
            more than one key; evicting it removes every key.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        num_groups: int = 1,
        materialize: bool = False,
        prepend_unhashed_frees: bool = False,
        group_event_fields: Sequence[tuple[str, int | None]] | None = None,
        num_hash_lookahead_tokens: int = 0,
        multi_key_blocks: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks: list[KVCacheBlock] = (
            [KVCacheBlock(BlockId(i)) for i in range(num_blocks)] if materialize else []
        )
        self.free_block_queue = FreeKVCacheBlockQueue(num_blocks, self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap(num_groups)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        # Counters the service turns into metrics; they never influence allocation.
        self.num_evictions = 0
        # Bumped whenever a cached block loses its hash: a prefix hit looked up at the
        # same epoch is still entirely cached.
        self.hash_epoch = 0
        self.num_allocated = 0
        self.num_freed = 0
        self.prepend_unhashed_frees = prepend_unhashed_frees
        self.group_event_fields = None if group_event_fields is None else tuple(group_event_fields)
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        #: vllm-0.33 partial-tail entries: keys a block holds beyond its primary one
        #: ((key, group, client hash or None) by block id), and the token count of
        #: primary keys that are partial entries (by block id)
        self.multi_key_blocks = multi_key_blocks
        self.secondary_keys: dict[int, list[tuple[bytes, int, bytes | None]]] = {}
        self.partial_tokens: dict[int, int] = {}
        if prepend_unhashed_frees:
            self.free_blocks = self._free_blocks_split  # type: ignore[method-assign]

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[int] | None:
        """One cached block id per group for ``block_hash``, or ``None`` if any group misses."""
        first = self.cached_block_hash_to_block.first
        out = []
        for gid in group_ids:
            block_id = first[gid].get(block_hash)
            if block_id is None:
                return None
            out.append(block_id)
        return out

    def get_block(self, block_id: int) -> KVCacheBlock | None:
        """The block with this id if it was ever used (only those can be cached or held)."""
        blocks = self.blocks
        return blocks[block_id] if 0 <= block_id < len(blocks) else None

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Make positions ``num_cached_blocks .. num_full_blocks-1`` of ``blocks`` hits.

        Null positions are skipped; one BlockStored event covers the whole run. A
        namespaced request's blocks are cached under its keys (prefixed hashes); its
        events carry the client's hashes. ``block_mask`` (vLLM 0.33's sparse retention,
        aligned with the run) skips the positions it marks false as well: the event
        then lists the kept blocks' hashes (possibly none) and still the whole run's
        tokens, its parent being the hash of the block before the run.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        for _ in self.caching_full_blocks(
            request, blocks, num_cached_blocks, num_full_blocks, block_size, group_id, block_mask, 0
        ):
            pass  # pragma: no cover - never yields with every=0

    def caching_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
        block_mask: Sequence[bool] | None = None,
        every: int = 0,
    ) -> Iterator[None]:
        """:meth:`cache_full_blocks` as a generator that yields after every ``every``
        positions (0: never), the block pool held by its caller meanwhile; the run's
        one BlockStored event is queued once the last position is cached, so the
        events are those of one call."""
        if num_cached_blocks >= num_full_blocks:
            return
        prefix = request.cache_prefix
        originals = hashes_at_block_size(request.block_hashes, self.hash_block_size, block_size)
        hashes = (
            hashes_at_block_size(request_keys(request.block_hashes, prefix), self.hash_block_size, block_size)
            if prefix
            else originals
        )
        events = self.enable_kv_cache_events
        stored: list[bytes] = []
        kept: list[int] = []  # positions cached, with events
        cache = self.cached_block_hash_to_block
        first = cache.first[group_id]
        hook = cache.hook
        if hook is not None and hook.gid != group_id:
            hook = None
        step = every if every > 0 else num_full_blocks - num_cached_blocks
        for start in range(num_cached_blocks, num_full_blocks, step):
            if start != num_cached_blocks:
                yield
            for i in range(start, min(start + step, num_full_blocks)):
                block = blocks[i]
                if block.is_null or (block_mask is not None and not block_mask[i - num_cached_blocks]):
                    continue
                assert block.cached_hash is None, f"block {block.block_id} is already cached"
                block_hash = hashes[i]
                block.cached_hash = block_hash
                block.cached_group = group_id
                if prefix:
                    block.event_hash = originals[i]
                block_id = block.block_id
                existing = first.setdefault(block_hash, block_id)
                if existing != block_id:
                    cache.add_duplicate(block_hash, group_id, existing, block_id)
                elif hook is not None:
                    hook.added(block_hash)
                if events:
                    stored.append(originals[i] if prefix else block_hash)
                    kept.append(i)
        if events:
            parent = originals[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            lora = request.lora
            event = block_stored(
                tuple(stored),
                parent,
                tuple(request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]),
                block_size,
                lora.adapter_id if lora else None,
                lora.name if lora else None,
                prefix,
            )
            if self.group_event_fields is not None:
                event = self._with_033_fields(event, request, kept, group_id)
            self.kv_event_queue.append(event)

    def _with_033_fields(
        self, event: BlockStored, request: Request, kept: Sequence[int], group_id: int
    ) -> BlockStored:
        """A BlockStored with the fields vLLM 0.33 adds: one untagged extra-keys entry
        per stored block (positions ``kept``), the group, and the group's spec kind
        (and window)."""
        assert self.group_event_fields is not None
        kind, window = self.group_event_fields[group_id]
        extra = request.event_extra_keys
        look = self.num_hash_lookahead_tokens
        lookahead = None
        if look:
            size, tokens = event.block_size, request.all_token_ids
            lookahead = tuple(tuple(tokens[(i + 1) * size : (i + 1) * size + look]) for i in kept)
        return dataclasses.replace(
            event,
            extra_keys=tuple(extra(i, event.block_size, look) for i in kept) or None,  # none for no block
            group_idx=group_id,
            kv_cache_spec_kind=kind,
            kv_cache_spec_sliding_window=window,
            lookahead_token_ids=lookahead,
        )

    def hit_stored_event(
        self, request: Request, num_blocks: int, block_size: int, group_id: int
    ) -> BlockStored:
        """vLLM 0.33's re-announcement of a hit (a request in the "full" report mode):
        one BlockStored for positions ``0 .. num_blocks-1`` of the group's hit, every
        position listed (a null one too, with the request's hash there), no parent, the
        hit's tokens, with 0.33's fields. Changes nothing; the caller queues it."""
        originals = hashes_at_block_size(request.block_hashes, self.hash_block_size, block_size)
        lora = request.lora
        event = BlockStored(
            block_hashes=tuple(originals[i] for i in range(num_blocks)),
            parent_block_hash=None,
            token_ids=tuple(request.all_token_ids[: num_blocks * block_size]),
            block_size=block_size,
            lora_id=lora.adapter_id if lora else None,
            lora_name=lora.name if lora else None,
            cache_prefix=request.cache_prefix,
        )
        return self._with_033_fields(event, request, range(num_blocks), group_id)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head, evicting their cached hashes.

        Raises:
            ValueError: fewer than ``num_blocks`` are free (callers check first).
        """
        queue = self.free_block_queue
        if num_blocks > queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks from the pool ({queue.num_free_blocks} free)"
            )
        ret = queue.popleft_n(num_blocks)
        if self.multi_key_blocks:
            for block in ret:
                if block.cached_hash is not None:
                    self.evict_all_keys(block)
                block.ref_cnt = 1
        elif self.enable_caching:
            cache = self.cached_block_hash_to_block
            firsts, mores = cache.first, cache.more
            hook = cache.hook
            events = self.kv_event_queue if self.enable_kv_cache_events else None
            evicted = 0
            for block in ret:
                block_hash = block.cached_hash
                if block_hash is not None:
                    # Inline eviction for the usual key held by this block alone.
                    gid = block.cached_group
                    first = firsts[gid]
                    if first.get(block_hash) == block.block_id and block_hash not in mores[gid]:
                        del first[block_hash]
                        if hook is not None and hook.gid == gid:
                            hook.removed(block_hash)
                        block.cached_hash = None
                        evicted += 1
                        if events is not None:
                            original = block.event_hash  # set for a namespaced key only
                            group_idx = gid if self.group_event_fields is not None else None
                            events.append(
                                block_removed(block_hash, b"", group_idx)
                                if original is None
                                else block_removed(original, block_hash[:NAMESPACE_PREFIX_BYTES], group_idx)
                            )
                        block.event_hash = None
                    else:
                        self.evict_cached_block(block)
                block.ref_cnt = 1
            if evicted:
                self.num_evictions += evicted
                self.hash_epoch += 1
        else:
            for block in ret:
                block.ref_cnt = 1
        self.num_allocated += num_blocks
        return ret

    def evict_cached_block(self, block: KVCacheBlock) -> bool:
        block_hash = block.cached_hash
        if block_hash is None:
            return False
        if not self.cached_block_hash_to_block.pop(block_hash, block.cached_group, block.block_id):
            return False
        block.cached_hash = None
        self.num_evictions += 1
        self.hash_epoch += 1
        if self.enable_kv_cache_events:
            group_idx = block.cached_group if self.group_event_fields is not None else None
            self.kv_event_queue.append(_removed(block, block_hash, group_idx))
        block.event_hash = None
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block, pulling free ones out of the free queue.

        The null block is skipped: its count is not meaningful (vLLM lets it drift).
        """
        self.free_block_queue.acquire(blocks, self.null_block)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching zero go to the tail, in order.

        The null block is skipped (see :meth:`touch`).
        """
        self.num_freed += self.free_block_queue.release(ordered_blocks, self.null_block)

    def _free_blocks_split(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """:meth:`free_blocks` by the vllm-0.33 rule: those reaching zero without a hash
        (or every one, caching off) go to the head, in order; hashed ones to the tail."""
        self.num_freed += self.free_block_queue.release_split(
            ordered_blocks, self.null_block, self.enable_caching
        )

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached hash of each listed block; ref counts and queue order stay."""
        blocks = self.blocks
        evict = self.evict_all_keys if self.multi_key_blocks else self.evict_cached_block
        for block_id in block_ids:
            if block_id < len(blocks):  # a never-used block holds no hash
                evict(blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only if no block besides the null block is held."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        blocks = self.blocks
        for block_id in list(self.cached_block_hash_to_block.block_ids()):
            blocks[block_id].cached_hash = None
            blocks[block_id].event_hash = None
        self.cached_block_hash_to_block = BlockHashToBlockMap(len(self.cached_block_hash_to_block.first))
        self.secondary_keys.clear()
        self.partial_tokens.clear()
        self.hash_epoch += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def teardown(self, chunk: int) -> Iterator[None]:
        """Drop every block, ``chunk`` at a time, yielding after each slice, so that
        freeing millions of objects never happens in one go. Unusable afterwards."""
        yield from self.free_block_queue.drain(chunk)
        cached = self.cached_block_hash_to_block
        self.cached_block_hash_to_block = BlockHashToBlockMap(len(cached.first))
        # the old map's keys dropped ``chunk`` at a time too (1,000,000 at once: ~30 ms)
        maps: list[dict[bytes, Any]] = [*cached.first, *cached.more]
        for keys in maps:
            while keys:
                for _ in range(min(chunk, len(keys))):
                    keys.popitem()
                yield
        blocks = self.blocks
        while blocks:
            del blocks[-chunk:]
            yield

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """``1 - free / (num_blocks - 1)`` in exactly vLLM's floating-point order."""
        return self.free_and_usage()[1]

    def free_and_usage(self) -> tuple[int, float]:
        """The free blocks and :meth:`get_usage`, from one read of the free queue."""
        free = self.free_block_queue.num_free_blocks
        total = self.num_blocks - 1
        if not total:
            return free, 0.0
        return free, 1.0 - (free / total)

    def take_events(self) -> list[KVCacheEvent]:
        """The queued events, oldest first; the queue is emptied."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    # -- whole-pool views (blocks never used are free and uncached) --------------------
    def ref_cnts(self) -> tuple[int, ...]:
        """Reference counts of blocks ``1 .. num_blocks-1``."""
        blocks = self.blocks
        return tuple([b.ref_cnt for b in blocks[1:]]) + (0,) * (self.num_blocks - max(len(blocks), 1))

    def block_hashes(self) -> tuple[BlockHashWithGroupId | None, ...]:
        """Every block's cache key (``None`` when uncached), by id."""
        blocks = self.blocks
        return tuple([b.block_hash for b in blocks]) + (None,) * (self.num_blocks - len(blocks))

    def cached_block_ids(self) -> list[int]:
        """Ids of the blocks holding a cache hash, ascending."""
        return sorted(self.cached_block_hash_to_block.block_ids())


def _removed(block: KVCacheBlock, cached_hash: bytes, group_idx: int | None) -> BlockRemoved:
    """The BlockRemoved of ``block`` losing ``cached_hash``: the client's hash, and the
    namespace prefix a namespaced key starts with (``event_hash`` is set only then)."""
    original = block.event_hash
    if original is None:
        return block_removed(cached_hash, b"", group_idx)
    return block_removed(original, cached_hash[:NAMESPACE_PREFIX_BYTES], group_idx)
