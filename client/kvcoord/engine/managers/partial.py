"""vLLM 0.33's fine-grained (partial) prefix hits with copy-on-write (profile vllm-0.33).

vLLM 0.33 enables them (``enable_partial_hash_hits``) when a mamba group in "align"
mode has a block larger than the hash block: a hit may then end on any hash-block
boundary, inside a block. kvcoord takes them for pools whose groups are full attention
and mamba "align" of one block size (:attr:`KVCacheConfig.partial_hash_hits`),
speculative mamba blocks, look-ahead hashes and prefill checkpoint blocks included;
the managers here replace
:class:`FullAttentionManager` and :class:`MambaManager033` in those pools.

- *Lookup*: full attention matches whole blocks from the start, then probes the next
  block's interior hash boundaries from the highest down; mamba probes every hash
  boundary from the longest down. A hit's length is counted in tokens (its last block
  may be partly covered). Keys: a whole block is cached under its block key (the
  concatenated hashes, as everywhere in kvcoord), an interior boundary under the hash
  ending there; a mamba probe at a block end reads the block key.
- *Copy-on-write*: a request adopting a hit that ends inside a block takes one block
  more (drawn before its other new blocks) and copies the shared tail into it: the copy
  ``(source, target)`` is queued for the worker, the target takes the tail's place in
  the request's list, and both stay referenced (*retained*) until the caller releases
  them after the copy ran: the source keeps the reference the adoption took, the target
  one beyond the request's own. The request's cached-block count stops before the
  copied block, which is cached again once full.
- *Producer tail* (mamba): a prompt's last hash boundary below its end, when a step
  stops exactly there, makes the state block reachable under a partial key. At the
  request's next allocation that key moves to a new block (the copy's target; no
  event) while the request keeps writing its own block, and the pair is retained the
  same way; the target is also offered as a boundary-state hand-off. With
  ``KVCacheConfig.mamba_shared_prefix_checkpoint`` (vLLM 0.33's shared-prefix
  checkpoints) the request's shared-prefix junction is keyed the same way.
- *Speculative blocks* (mamba, one per draft token): as without partial
  hits (``num_speculative_blocks`` more columns, 1 + them new at a request's first
  allocation, those a running request leaves behind moved to the end of its list),
  the copy's target drawn first as always.
- *Prefill checkpoint blocks* (mamba, vLLM 0.33's Mamba2 and GDN layouts): planned as
  without partial hits (:meth:`MambaManager033.plan_checkpoint`, at the hash block): the
  chunk reaching the prefill's end may start at a copied tail and run past block
  boundaries; it then takes the copy's target, the checkpoint block (its column not
  nulled) and the last state block in one step.

Retention is the pool's: see :meth:`KVCachePool.take_kv_cache_block_copies` and
:meth:`KVCachePool.release_retained_blocks`.
"""

from __future__ import annotations

from collections.abc import Sequence

from .._mypyc import trait
from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..request import Request
from ..specs import AttentionSpec
from .base import SingleTypeKVCacheManager, cdiv
from .full_attention import FullAttentionManager
from .mamba033 import MambaManager033

__all__ = [
    "CopyOnWrite",
    "PartialFullAttentionManager",
    "PartialMambaManager",
    "find_partial_full_hit",
    "find_partial_mamba_hit",
]


@trait
class CopyOnWrite:
    """The copy-on-write bookkeeping both partial-hit managers share: a mypyc trait,
    listed after the manager class (a compiled class has one non-trait base), so each
    manager calls :meth:`_no_copies_yet` in its ``__init__`` and :meth:`_mark_partial_hit`
    after its adoption itself."""

    #: request -> (position, source block) of a tail to copy at its next allocation
    partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]]
    #: copies not yet taken, in the order they were made: (source, target)
    pending_cow: list[tuple[KVCacheBlock, KVCacheBlock]]

    def _no_copies_yet(self) -> None:
        """The two records, empty (the manager's ``__init__`` calls this)."""
        self.partial_hit_reqs = {}
        self.pending_cow = []

    def _mark_partial_hit(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
    ) -> None:
        """After the manager's adoption: a hit ending inside a block marks its tail for
        the copy and caps the request's cached-block count before it."""
        m: SingleTypeKVCacheManager = self  # type: ignore[assignment]
        if not new_computed_blocks or num_local_computed_tokens % m.block_size == 0:
            return
        index = num_local_computed_tokens // m.block_size
        blocks = m.req_to_blocks[request_id]
        assert index == len(blocks) - 1, "a partial hit ends in the request's last block"
        self.partial_hit_reqs[request_id] = (index, blocks[index])
        m.num_cached_block[request_id] = index

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        """Drain the copies made since the last call, oldest first."""
        out, self.pending_cow = self.pending_cow, []
        return out

    def _apply_cow(self, request_id: str, index: int, source: KVCacheBlock, target: KVCacheBlock) -> None:
        """Put ``target`` in place of the shared ``source`` and queue the copy; the
        source keeps the adoption's reference, the target takes one more."""
        m: SingleTypeKVCacheManager = self  # type: ignore[assignment]
        blocks = m.req_to_blocks[request_id]
        assert blocks[index] is source and not source.is_null and source.ref_cnt > 0
        blocks[index] = target
        self.pending_cow.append((source, target))
        target.ref_cnt += 1


def _partial_local_hit(
    block_size: int, new_computed_blocks: Sequence[KVCacheBlock], num_local_computed_tokens: int
) -> bool:
    return bool(new_computed_blocks) and num_local_computed_tokens % block_size != 0


class PartialFullAttentionManager(FullAttentionManager, CopyOnWrite):
    """Full attention in a pool with partial hits: one block more for a hit ending
    inside a block, and its tail copied on the request's first allocation."""

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        self._no_copies_yet()

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], local: int, external: int
    ) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks, local, external)
        self._mark_partial_hit(request_id, new_computed_blocks, local)

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
        # the pool takes no external tokens with partial hits: computed tokens are local
        n = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_tokens_main_model,
            prefill_end=prefill_end, record=record,
        )  # fmt: skip
        if request_id not in self.num_cached_block and _partial_local_hit(
            self.block_size, new_computed_blocks, total_computed_tokens
        ):
            n += 1
        return n

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        tail = self.partial_hit_reqs.pop(request_id, None)
        if tail is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        target = self.block_pool.get_new_blocks(1)[0]  # drawn before the request's new blocks
        self._apply_cow(request_id, tail[0], tail[1], target)
        return [target, *super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)]

    def free(self, request_id: str) -> None:
        self.partial_hit_reqs.pop(request_id, None)
        super().free(request_id)


class PartialMambaManager(MambaManager033, CopyOnWrite):
    """Mamba "align" in a pool with partial hits: one block
    more while a tail is to be copied, the copy on a waiting request's first allocation
    or, for a producer still running, the partial key moved to the new block; one more
    again for a prefill checkpoint block, as :class:`MambaManager033` takes it."""

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        self._no_copies_yet()
        assert self.align, "partial hits: align mode"
        #: producers of a partial tail: request -> (its block, boundary tokens)
        self.producer_tails: dict[str, tuple[KVCacheBlock, int]] = {}

    def add_local_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock], local: int, external: int
    ) -> None:
        super().add_local_computed_blocks(request_id, new_computed_blocks, local, external)
        self._mark_partial_hit(request_id, new_computed_blocks, local)

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
        if new_computed_blocks and self._hit_not_yet_usable(new_computed_blocks[-1]):
            return self.block_pool.num_blocks + 1
        S = self.num_speculative_blocks
        required = cdiv(num_tokens_main_model, self.block_size) + S
        new = required - len(new_computed_blocks) - len(self.req_to_blocks.get(request_id, ()))
        partial = (
            _partial_local_hit(self.block_size, new_computed_blocks, total_computed_tokens)
            or request_id in self.partial_hit_reqs
        )
        if partial:
            new = max(new, 0) + 1
        point = None
        if self.has_checkpoint_blocks:  # planned as without partial hits (vLLM 0.33)
            point = self.plan_checkpoint(
                request_id, total_computed_tokens, num_tokens_main_model, prefill_end
            )
            if record:
                if point is None:
                    self.checkpoints.pop(request_id, None)
                else:
                    self.checkpoints[request_id] = point
        if new > 0:
            first = 0 if request_id in self.allocated_block_reqs else S
            new = min(new, 1 + int(partial) + int(point is not None) + first)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return new + evictable

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        tail = self.partial_hit_reqs.pop(request_id, None)
        if tail is None:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        index, source = tail
        S = self.num_speculative_blocks
        blocks = self.req_to_blocks.setdefault(request_id, [])
        required = cdiv(num_tokens_main_model, self.block_size) + S
        prev = len(blocks)
        running = request_id in self.allocated_block_reqs
        if running:  # the previous step's state block, before its speculative blocks
            self.last_state_block_idx[request_id] = prev - 1 - S
        elif prev > 0:  # the hit's state block
            self.last_state_block_idx[request_id] = prev - 1
        checkpoint = int(request_id in self.checkpoints)  # its column is not nulled
        upto = required - S - 1 - checkpoint
        null = self.null_block
        if prev < upto:
            blocks.extend([null] * (upto - prev))
        if running:  # speculative blocks left behind move to the end (as without a tail)
            for j in range(prev - S, prev):
                if j >= upto:
                    break
                blocks.append(blocks[j])
                blocks[j] = null
        num_new = max(required - len(blocks), 0) + 1
        assert num_new <= 2 + checkpoint + (0 if running else S)
        new = self.block_pool.get_new_blocks(num_new)
        target, new = new[0], new[1:]
        returned = blocks[prev:]
        if running:
            # the request keeps writing its own block: the cache entry moves to the
            # target, which the queued copy fills first
            assert blocks[index] is source
            self.block_pool.move_block_hashes(source, target)
            self.pending_cow.append((source, target))
            source.ref_cnt += 1
            produced = self.producer_tails.pop(request_id, None)
            if produced is not None:
                self.pending_offloads.append((request_id, self.group_id, target, produced[1]))
            if target.cached_hash is not None:
                self.cached_this_step.add((target.cached_hash, target.cached_group))
        else:
            self._apply_cow(request_id, index, source, target)
            returned = [target, *returned]
        blocks.extend(new)
        self.allocated_block_reqs.add(request_id)
        returned.extend(new)
        return returned

    def check_allocation(
        self, request_id: str, num_tokens_main_model: int, query_start: int = 0, prefill_end: int = 0
    ) -> str | None:
        if request_id in self.partial_hit_reqs:
            if self.has_checkpoint_blocks and self.plan_checkpoint(
                request_id, query_start, num_tokens_main_model, prefill_end
            ):
                # the chunk reaching the prefill's end runs past block boundaries (vLLM
                # 0.33's scheduler does not stop it): the columns between are nulled
                return None
            have = len(self.req_to_blocks.get(request_id, ()))
            if cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks - have > 1:
                return (
                    f"mamba align mode: a step may add at most one block besides the copied "
                    f"tail; schedule chunks that end on block boundaries (block size {self.block_size})"
                )
            return None
        return super().check_allocation(request_id, num_tokens_main_model, query_start, prefill_end)

    def free(self, request_id: str) -> None:
        self.partial_hit_reqs.pop(request_id, None)
        self.producer_tails.pop(request_id, None)
        super().free(request_id)

    def finalize_partial_tail_offload(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int
    ) -> tuple[int, KVCacheBlock, int] | None:
        """vLLM 0.33's hand-off of a finishing producer's own tail: ``(group, block,
        tokens)`` when the request stopped exactly at its boundary with nothing in
        flight; the record is consumed either way."""
        produced = self.producer_tails.pop(request_id, None)
        if produced is None or num_in_flight_tokens or num_computed_tokens != produced[1]:
            return None
        return self.group_id, produced[0], produced[1]

    # -- caching -------------------------------------------------------------------------
    def _cache_prompt_boundary(self, request: Request, num_tokens: int, blocks: list[KVCacheBlock]) -> None:
        """The prompt's last hash boundary below its end, when a step stops exactly
        there: inside a block it becomes a partial key of that block (and the request a
        producer whose next allocation moves it); at a block end the block is cached
        whole. With :attr:`shared_prefix_checkpoint` (vLLM 0.33's
        ``enable_mamba_shared_prefix_checkpoint``, as its manager narrows it) the
        request's shared-prefix junction is keyed the same way, when the step computing
        it ends there inside the prompt (never from a decode step: the state block then
        changes in place)."""
        hbs = self.block_pool.hash_block_size
        if num_tokens <= 0 or num_tokens % hbs:
            return
        lag = max(1, self.block_pool.num_hash_lookahead_tokens)
        if num_tokens != max((request.num_prompt_tokens - lag) // hbs * hbs, 0) and not (
            self.shared_prefix_checkpoint
            and num_tokens == request.shared_prefix_boundary
            and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens
        ):
            return
        index = cdiv(num_tokens, self.block_size) - 1
        if num_tokens % self.block_size == 0:
            self._key_whole_block(request, index, blocks)
            return
        if index >= len(blocks) or blocks[index].is_null:
            return
        block = blocks[index]
        bp = self.block_pool
        if block.cached_hash is not None and bp.partial_tokens.get(block.block_id) == num_tokens:
            return  # keyed here already (a hit or an earlier step)
        bp.cache_partial_block(request, block, num_tokens, self.group_id)
        if block.cached_hash is not None:
            self.cached_this_step.add((block.cached_hash, block.cached_group))
        rid = request.request_id
        self.partial_hit_reqs[rid] = (index, block)
        self.num_cached_block[rid] = index
        self.producer_tails[rid] = (block, num_tokens)


def find_partial_full_hit(
    fine: Sequence[bytes],
    merged: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    block_pool: BlockPool,
    block_size: int,
) -> tuple[list[list[int]], int]:
    """Full attention's partial-hit search: cached whole blocks from the start, then
    the next block's interior hash boundaries from the highest down. Returns the block
    ids per group and the hit's length in tokens."""
    hbs = block_pool.hash_block_size
    get = block_pool.get_cached_block
    lists: list[list[int]] = [[] for _ in group_ids]
    for h in merged[: max_length // block_size]:
        cached = get(h, group_ids)
        if cached is None:
            break
        for lst, block_id in zip(lists, cached, strict=True):
            lst.append(block_id)
    hit = len(lists[0]) * block_size
    scale = block_size // hbs
    first = len(lists[0]) * scale
    last = min(first + scale - 1, max_length // hbs, len(fine))
    for i in range(last - 1, first - 1, -1):
        cached = get(fine[i], group_ids)
        if cached is None:
            continue
        for lst, block_id in zip(lists, cached, strict=True):
            lst.append(block_id)
        hit = (i + 1) * hbs
        break
    return lists, hit


def find_partial_mamba_hit(
    fine: Sequence[bytes],
    merged: Sequence[bytes],
    max_length: int,
    group_ids: Sequence[int],
    block_pool: BlockPool,
    block_size: int,
) -> tuple[list[list[int]], int]:
    """Mamba's partial-hit search: the longest hash boundary (at most ``max_length``)
    whose state is cached, the earlier positions null. Returns the block ids per group
    and the hit's length in tokens."""
    hbs = block_pool.hash_block_size
    scale = block_size // hbs
    get = block_pool.get_cached_block
    for i in range(min(max_length // hbs, len(fine)) - 1, -1, -1):
        end = (i + 1) % scale == 0
        cached = get(merged[(i + 1) // scale - 1] if end else fine[i], group_ids)
        if cached is None:
            continue
        pad = [0] * (i // scale)
        return [[*pad, block_id] for block_id in cached], (i + 1) * hbs
    return [[] for _ in group_ids], 0
