"""The block pool shared by every KV cache group of one pool."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .blocks import KVCacheBlock
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from .free_queue import FreeKVCacheBlockQueue
from .hash_list import hashes_at_block_size, key_with_group
from .request import Request
from .types import BlockHashWithGroupId, BlockId

__all__ = ["BlockHashToBlockMap", "BlockPool"]


class BlockHashToBlockMap:
    """Cached blocks by key. Several blocks may share a key (vLLM never de-duplicates,
    so block tables stay append-only); lookups return the earliest inserted survivor."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: BlockHashWithGroupId) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        return next(iter(blocks.values()))

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        blocks = self._cache.get(key)
        if blocks is None:
            self._cache[key] = {block.block_id: block}
        else:
            blocks[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        blocks = self._cache.get(key)
        if blocks is None:
            return None
        block = blocks.pop(block_id, None)
        if not blocks:
            del self._cache[key]
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def items(self) -> Iterable[tuple[BlockHashWithGroupId, list[int]]]:
        for key, blocks in self._cache.items():
            yield key, list(blocks)


class BlockPool:
    """Physical blocks, the free queue, the prefix-cache map and the event queue.

    Block 0 is popped at construction and becomes the null block. Usable capacity is
    ``num_blocks - 1``.

    Args:
        num_blocks: blocks including the null block.
        enable_caching: whether blocks are hashed and looked up.
        hash_block_size: granularity of request block hashes.
        enable_kv_cache_events: whether events are queued.
    """

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
    ) -> None:
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.blocks = [KVCacheBlock(BlockId(i)) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
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

    def get_cached_block(self, block_hash: bytes, group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or ``None`` if any group misses."""
        out = []
        for gid in group_ids:
            block = self.cached_block_hash_to_block.get_one_block(key_with_group(block_hash, gid))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: Request,
        blocks: list[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        group_id: int,
    ) -> None:
        """Make positions ``num_cached_blocks .. num_full_blocks-1`` of ``blocks`` hits.

        Null positions are skipped; one BlockStored event covers the whole run.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = hashes_at_block_size(request.block_hashes, self.hash_block_size, block_size)
        events = self.enable_kv_cache_events
        stored: list[bytes] = []
        cache = self.cached_block_hash_to_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            assert block.block_hash is None, f"block {block.block_id} is already cached"
            block_hash = hashes[i]
            key = key_with_group(block_hash, group_id)
            block.block_hash = key
            cache.insert(key, block)
            if events:
                stored.append(block_hash)
        if events:
            parent = hashes[num_cached_blocks - 1] if num_cached_blocks > 0 else None
            lora = request.lora
            self.kv_event_queue.append(
                BlockStored(
                    block_hashes=tuple(stored),
                    parent_block_hash=parent,
                    token_ids=tuple(
                        request.all_token_ids[num_cached_blocks * block_size : num_full_blocks * block_size]
                    ),
                    block_size=block_size,
                    lora_id=lora.adapter_id if lora else None,
                    lora_name=lora.name if lora else None,
                )
            )

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head, evicting their cached hashes.

        Raises:
            ValueError: fewer than ``num_blocks`` are free (callers check first).
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot get {num_blocks} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free)"
            )
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self.enable_caching:
            for block in ret:
                if block.block_hash is not None:
                    self._evict_cached_block(block)
                block.ref_cnt += 1
        else:
            for block in ret:
                block.ref_cnt += 1
        self.num_allocated += num_blocks
        return ret

    def _evict_cached_block(self, block: KVCacheBlock) -> bool:
        key = block.block_hash
        if key is None:
            return False
        if self.cached_block_hash_to_block.pop(key, block.block_id) is None:
            return False
        block.block_hash = None
        self.num_evictions += 1
        self.hash_epoch += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(BlockRemoved(block_hashes=(bytes(key[:-4]),)))
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on each block, pulling free ones out of the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference on each block; those reaching zero go to the tail, in order."""
        blocks = list(ordered_blocks)
        for block in blocks:
            block.ref_cnt -= 1
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.append(block)
                self.num_freed += 1

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Forget the cached hash of each listed block; ref counts and queue order stay."""
        for block_id in block_ids:
            self._evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, only if no block besides the null block is held."""
        if self.num_blocks - self.get_num_free_blocks() != 1:
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        for block in self.blocks:
            block.block_hash = None
        self.hash_epoch += 1
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """``1 - free / (num_blocks - 1)`` in exactly vLLM's floating-point order."""
        total = self.num_blocks - 1
        if not total:
            return 0.0
        return 1.0 - (self.get_num_free_blocks() / total)

    def take_events(self) -> list[KVCacheEvent]:
        """The queued events, oldest first; the queue is emptied."""
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
