"""The single-type manager: one per KV cache group."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..request import Request
from ..specs import AttentionSpec

__all__ = ["SingleTypeKVCacheManager", "cdiv"]


def cdiv(a: int, b: int) -> int:
    """Ceiling division."""
    return -(-a // b)


class SingleTypeKVCacheManager:
    """Block lists of every request in one KV cache group.

    ``req_to_blocks[r]`` is request r's block list (position i covers tokens
    ``[i*bs, (i+1)*bs)``); ``num_cached_block[r]`` counts its leading positions that
    are already cached. Presence in ``num_cached_block`` marks an admitted request,
    which can no longer adopt prefix hits.
    """

    #: whether this type may put the null block into a request's list.
    uses_null_blocks: ClassVar[bool] = True

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.enable_caching = enable_caching
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.null_block = block_pool.null_block

    # -- skipped tokens ----------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens whose KV is no longer needed after ``num_computed_tokens``."""
        return 0

    # -- allocation ---------------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        *,
        prefill_end: int = 0,
        record: bool = True,
    ) -> int:
        """Free blocks this group would consume, evictable hit blocks included.
        ``prefill_end`` and ``record`` serve vLLM 0.33's mamba prefill checkpoints
        (:class:`~kvcoord.engine.managers.mamba033.MambaManager033`); other rules ignore them."""
        bs = self.block_size
        required = cdiv(num_tokens, bs)
        blocks = self.req_to_blocks.get(request_id)
        have = len(blocks) if blocks is not None else 0
        if request_id in self.num_cached_block:
            return max(required - have, 0)
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // bs
        new = max(required - max(skipped, len(new_computed_blocks) + have), 0)
        skip_in_hit = max(0, skipped - have)
        evictable = 0
        for block in new_computed_blocks[skip_in_hit:]:
            if block.ref_cnt == 0 and not block.is_null:
                evictable += 1
        return new + evictable

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt a prefix hit (and blocks for externally computed tokens) on first use,
        this group alone (vLLM 0.16: the coordinator calls it group by group)."""
        if request_id in self.num_cached_block:
            return
        self.add_local_computed_blocks(
            request_id, new_computed_blocks, num_local_computed_tokens, num_external_computed_tokens
        )
        self.allocate_external_computed_blocks(
            request_id, num_local_computed_tokens, num_external_computed_tokens, clamp_below_a_block=False
        )

    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Adopt a prefix hit on first use: touch the hit blocks past the window
        (null blocks stand for the skipped ones). Blocks for external tokens come
        from :meth:`allocate_external_computed_blocks`."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        assert not req_blocks, "a request adopts prefix hits only before it holds blocks"
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total) // self.block_size
        if skipped > 0:
            new_computed_blocks = new_computed_blocks[skipped:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        if skipped > 0:
            req_blocks.extend([self.null_block] * skipped)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        clamp_below_a_block: bool = True,
    ) -> None:
        """New blocks for a first-use request's external (KV connector) tokens, after
        :meth:`add_local_computed_blocks`. External tokens the window skips need none:
        vLLM 0.33 clamps them as soon as any token is skipped, vLLM 0.16 (not
        ``clamp_below_a_block``) only once a whole block is."""
        req_blocks = self.req_to_blocks[request_id]
        n = self._num_external_blocks(
            len(req_blocks), num_local_computed_tokens, num_external_computed_tokens, clamp_below_a_block
        )
        if n is not None:
            req_blocks.extend(self.block_pool.get_new_blocks(n))

    def _num_external_blocks(
        self, held: int, local: int, external: int, clamp_below_a_block: bool
    ) -> int | None:
        """The new blocks :meth:`allocate_external_computed_blocks` takes when the request
        holds ``held`` after adopting its hit; ``None`` where it takes none (no external
        token left once the window clamps them)."""
        total = local + external
        skipped_tokens = self.get_num_skipped_tokens(total)
        if skipped_tokens >= (1 if clamp_below_a_block else self.block_size):
            external = min(total - skipped_tokens, external)
        if external <= 0:
            return None
        return cdiv(total, self.block_size) - held

    def external_adoption_plan(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], local: int, external: int
    ) -> tuple[list[int], int]:
        """What vLLM 0.16's :meth:`allocate_new_computed_blocks` would do for this group,
        changing nothing: the ids of the hit blocks it takes out of the free queue
        (touched while free) and how many blocks it then takes from the queue's head for
        the external tokens."""
        if request_id in self.num_cached_block or self.req_to_blocks.get(request_id):
            return [], 0  # admitted (adopts nothing), or the adoption's own check refuses
        skipped = self.get_num_skipped_tokens(local + external) // self.block_size
        kept = new_computed_blocks[skipped:] if skipped > 0 else new_computed_blocks
        touched = (
            [int(b.block_id) for b in kept if b.ref_cnt == 0 and not b.is_null] if self.enable_caching else []
        )
        n = self._num_external_blocks(max(skipped, 0) + len(kept), local, external, False)
        return touched, n or 0

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        """Grow the request's list to cover ``num_tokens``; return the new blocks."""
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        k = cdiv(num_tokens, self.block_size) - len(req_blocks)
        if k <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(k)
        req_blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Cache the request's newly full blocks up to ``num_tokens``."""
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        num_full = num_tokens // self.block_size
        if num_cached >= num_full:
            return
        self.block_pool.cache_full_blocks(
            request,
            self.req_to_blocks.setdefault(rid, []),
            num_cached,
            num_full,
            self.block_size,
            self.group_id,
        )
        self.num_cached_block[rid] = num_full

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request (its list and cached count, and any per-request state of
        the group's rule) and return its blocks in list order, leading null blocks left
        out, without releasing them: the caller releases them, tail first (vLLM 0.33's
        deferred free takes them here and returns them a step later)."""
        blocks = self.req_to_blocks.pop(request_id, None) or []
        self.num_cached_block.pop(request_id, None)
        head = 0
        while head < len(blocks) and blocks[head] is self.null_block:
            head += 1
        return blocks[head:]

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (so its last block is evicted first)."""
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Replace blocks no longer needed by the null block and free them."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        k = min(num_skipped_tokens // self.block_size, len(blocks))
        removed = []
        null = self.null_block
        for i in range(k - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def skips_blocks(self, request_id: str, total_computed_tokens: int) -> bool:
        """Whether :meth:`remove_skipped_blocks` would change anything (no state change)."""
        num_skipped_tokens = self.get_num_skipped_tokens(total_computed_tokens)
        if num_skipped_tokens <= 0:
            return False
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return request_id not in self.req_to_blocks  # the removal would add the empty list
        k = min(num_skipped_tokens // self.block_size, len(blocks))
        return k > 0 and blocks[k - 1] is not self.null_block

    def get_num_common_prefix_blocks(self, request_id: str, others: int = 0) -> int:
        """Leading blocks shared by every request of this group and the ``others``
        holders besides them (reservations; only full attention)."""
        return 0

    # -- validation helpers for the facade (no state change) ----------------------
    def check_allocation(self, request_id: str, num_tokens_main_model: int) -> str | None:
        """A reason this allocation would break a manager rule, or ``None``."""
        return None

    # -- prefix search --------------------------------------------------------------
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
        """The longest cached prefix of at most ``max_length`` tokens: one list of block
        ids per group (0 = the null block), all of the same length."""
        raise NotImplementedError
