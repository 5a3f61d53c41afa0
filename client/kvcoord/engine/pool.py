"""The pool facade: vLLM's ``KVCacheManager`` plus the request table a remote pool needs.

:class:`KVCachePool` is the engine's one entry point. Its parts are built in
:mod:`~kvcoord.engine.pool_parts` (the request table, the prefix-hit search, the
coordinator with its block pool and per-group managers, the reservations); its calls
are split by role, one module each:

- :mod:`~kvcoord.engine.pool_requests`: register, update, restore, free, preempt;
- :mod:`~kvcoord.engine.pool_lookups`: prefix lookups, reservations, lookup-then-allocate;
- :mod:`~kvcoord.engine.pool_fast`: the fused fast paths (allocation without a hit,
  update and allocate, decode steps inside their blocks);
- :mod:`~kvcoord.engine.pool_vllm033`: vLLM 0.33's extra calls;
- :mod:`~kvcoord.engine.pool_inspect`: statistics, events, tables, replica state, snapshots;
- here: the general allocation (``allocate_slots``), caching, skipped blocks,
  eviction and teardown.

Hot paths reach the parts through bound methods and the shared request dict taken
once in ``__init__``, so delegation costs no attribute lookup per block.

Every public method validates its input completely before changing anything, so a
raised :class:`~kvcoord.engine.errors.EngineError` leaves the pool as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from .blocks import KVCacheBlock
from .errors import (
    FailedPreconditionError,
    HitBlockTakenError,
    InvalidArgumentError,
    RequestNotFoundError,
    UncountedBlocksError,
)
from .pool_fast import FastPaths
from .request import Request
from .request_table import check_count
from .results import AllocationResult, BlockIds, CacheHit, PoolSnapshot, RequestCheckpoint, RequestRewind

# The result types are re-exported: ``from kvcoord.engine.pool import CacheHit`` works.
__all__ = [
    "AllocationResult",
    "CacheHit",
    "KVCachePool",
    "PoolSnapshot",
    "RequestCheckpoint",
    "RequestRewind",
]

_ALLOCATE_COUNT_NAMES = (
    "num_new_tokens",
    "num_new_computed_tokens",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "num_encoder_tokens",
)


class KVCachePool(FastPaths):
    """One pool of KV blocks shared by all groups, with vLLM's manager semantics.

    Creating a pool costs O(1) in ``num_blocks``: block objects are created on first
    use (see :class:`~kvcoord.engine.block_pool.BlockPool`), and a dropped pool is
    reclaimed by reference counting (blocks hold no links to each other).

    Args:
        config: the validated layout; see :class:`KVCacheConfig`.
        materialize_blocks: create every block object up front instead (identical
            answers; the reference the lazy pool is tested against).
    """

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: CacheHit | Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> BlockIds | None:
        """vLLM's ``allocate_slots``: adopt a prefix hit, take new blocks, cache full ones.

        Args:
            request_id: a registered request.
            num_new_tokens: tokens to compute this step (drafts included).
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``.
            new_computed_blocks: the hit from :meth:`get_computed_blocks`, adopted by the
                request's first allocation; checked to be still cached.
            num_lookahead_tokens: extra slots for speculative tokens.
            num_external_computed_tokens: tokens loaded by a KV connector.
            delay_cache_blocks: do not cache yet (asynchronous external load).
            num_encoder_tokens: encoder input length for cross-attention groups.
            full_sequence_must_fit: (vllm-0.33 only) refuse, changing nothing, unless
                the request's whole sequence fits (vLLM 0.33's admission gate).
            reserved_blocks: (vllm-0.33 only) free blocks the allocation must leave
                for other in-flight requests.
            num_in_flight_tokens: (vllm-0.33 only) the request's computed tokens still in
                flight (an asynchronous scheduler's or a batch queue's steps whose output
                is not applied yet): blocks leave a window on the processed-token basis,
                ``computed - in flight``, as vLLM 0.33 frees them.
            watermark_blocks: (vllm-0.33 only) vLLM 0.33's watermark: free blocks the
                allocation must leave besides ``reserved_blocks``, in the full-sequence
                gate too (the caller sends 0 unless vLLM 0.33 would apply it: a waiting
                or preempted request while another is already scheduled).
            skip_zeroing_group_ids: (vllm-0.33 only) groups whose blocks for
                ``num_external_computed_tokens`` an asynchronous load writes: they are
                not recorded for zeroing (:meth:`take_new_block_ids`), as vLLM 0.33's
                ``skip_zeroing_group_ids``.

        Returns:
            The newly taken block ids per group, or ``None`` when too few blocks are
            free; ``None`` changes nothing except skipped-block removal.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: counts out of range or a malformed hit.
            StaleCacheHitError: a hit block is no longer cached for this prefix.
            FailedPreconditionError: the request already holds blocks and cannot adopt
                a hit, or the call breaks a manager rule (mamba align chunking).
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if new_computed_blocks is None and not skip_zeroing_group_ids and self._plain_call(
            req, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
            delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit, reserved_blocks, num_in_flight_tokens, watermark_blocks,
        ):  # fmt: skip
            return self._allocate_without_hit(req, num_new_tokens, num_lookahead_tokens)
        counts = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
                  num_encoder_tokens)  # fmt: skip
        if not all(type(v) is int and v >= 0 for v in counts):  # fast path; the loop names the culprit
            for name, value in zip(_ALLOCATE_COUNT_NAMES, counts, strict=True):
                check_count(value, name)
        if not isinstance(delay_cache_blocks, bool):
            raise InvalidArgumentError("delay_cache_blocks must be a bool")
        if not isinstance(full_sequence_must_fit, bool):
            raise InvalidArgumentError("full_sequence_must_fit must be a bool")
        check_count(reserved_blocks, "reserved_blocks")
        check_count(num_in_flight_tokens, "num_in_flight_tokens")
        check_count(watermark_blocks, "watermark_blocks")
        if (
            full_sequence_must_fit or reserved_blocks or num_in_flight_tokens or watermark_blocks
        ) and not self.rules.full_sequence_admission:
            raise InvalidArgumentError(
                "full_sequence_must_fit, reserved_blocks, num_in_flight_tokens and watermark_blocks are "
                f"vLLM 0.33 inputs; "
                f"this pool's profile is {self.config.profile}"
            )
        skip_zeroing = self._check_skip_zeroing(skip_zeroing_group_ids)
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            # vLLM 0.31+ also lets a step adopt a local hit with no new token.
            if not (self.rules.full_sequence_admission and num_new_computed_tokens):
                raise InvalidArgumentError(
                    "num_new_tokens must be > 0 unless num_external_computed_tokens is > 0"
                )
        if num_external_computed_tokens and self.cow_managers:
            raise FailedPreconditionError(
                "external (KV connector) tokens in a pool with fine-grained (partial) prefix hits "
                "are not supported yet"
            )
        hit_blocks = self._resolve_hit(req, new_computed_blocks, num_new_computed_tokens)
        local = req.num_computed_tokens + num_new_computed_tokens
        if local + num_external_computed_tokens + num_new_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"computed plus new tokens ({local + num_external_computed_tokens} + "
                f"{num_new_tokens}) exceed max_model_len {self.max_model_len}"
            )
        if any(hit_blocks) or num_external_computed_tokens > 0:
            self._check_adoption(request_id, hit_blocks)
        total = min(local + num_external_computed_tokens, self.max_model_len)
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        # vLLM 0.33's prefill end (mamba prefill checkpoints): resumed requests replay outputs
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        for manager in self._prechecked_managers:
            reason = manager.check_allocation(request_id, main, total, prefill_end)
            if reason is not None:
                raise FailedPreconditionError(f"group {manager.group_id}: {reason}")

        coordinator = self.coordinator
        if full_sequence_must_fit:
            # vLLM 0.33's gate, before anything is released: the whole sequence must fit.
            full = min(req.num_tokens, self.max_model_len)
            k = coordinator.get_num_blocks_to_allocate(
                request_id,
                full,
                hit_blocks,
                num_encoder_tokens,
                local + num_external_computed_tokens,
                full,
                self._admission_caps,
                prefill_end,
            )
            if k + watermark_blocks > self.block_pool.get_num_free_blocks():
                self.num_refusals += 1
                return None
        if num_external_computed_tokens and self._prechecked_managers:
            self._refuse_uncounted_external(
                request_id, hit_blocks, num_encoder_tokens, local + num_external_computed_tokens, main,
                need, prefill_end, reserved_blocks + watermark_blocks,
            )  # fmt: skip
        if num_external_computed_tokens and hit_blocks and not self.rules.two_phase_external:
            self._refuse_hit_block_taken(
                request_id, hit_blocks, num_encoder_tokens, local, num_external_computed_tokens, main, need,
                prefill_end,
            )  # fmt: skip
        # vLLM 0.33 frees on the processed-token basis (steps in flight still read the window)
        coordinator.remove_skipped_blocks(request_id, max(0, total - num_in_flight_tokens))
        k = coordinator.get_num_blocks_to_allocate(
            request_id,
            need,
            hit_blocks,
            num_encoder_tokens,
            local + num_external_computed_tokens,
            main,
            prefill_end=prefill_end,
        )
        if k + watermark_blocks > self.block_pool.get_num_free_blocks() - reserved_blocks:
            self.num_refusals += 1
            return None
        if any(hit_blocks) or num_external_computed_tokens > 0:
            first_adoption = (
                self._zeroed_groups
                and num_external_computed_tokens > 0
                and not any(coordinator.get_blocks(request_id))
            )
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, local, num_external_computed_tokens
            )
            if first_adoption:  # blocks for the external tokens are zeroed too (unless loaded)
                for gid in self._zeroed_groups:
                    if gid in skip_zeroing:
                        continue
                    m = self.managers[gid]
                    held = m.req_to_blocks.get(request_id, ())
                    self.pending_new_block_ids[gid].extend(
                        b.block_id for b in held[m.num_cached_block.get(request_id, 0) :]
                    )
        new = coordinator.allocate_new_blocks(request_id, need, main, num_encoder_tokens)
        for gid in self._zeroed_groups:
            self.pending_new_block_ids[gid].extend(b.block_id for b in new[gid])
        if self.enable_caching and not delay_cache_blocks:
            self._cache_finalized(req, min(total + num_new_tokens, req.num_tokens))
        return tuple([tuple([b.block_id for b in lst]) for lst in new])

    def _refuse_uncounted_external(
        self,
        request_id: str,
        hit_blocks: list[list[KVCacheBlock]],
        num_encoder_tokens: int,
        total_computed_tokens: int,
        main: int,
        need: int,
        prefill_end: int,
        held_back: int,
    ) -> None:
        """Raise before anything changes where vLLM would run out of blocks half way: a
        first allocation with external tokens in a pool with a mamba ``align`` group
        takes a block vLLM's count leaves out (see
        :meth:`~kvcoord.engine.managers.mamba.MambaManager.uncounted_external_blocks`).
        Where the count refuses (too few free blocks even without that block) the caller
        returns ``None`` as vLLM; where the free blocks cover that block too it allocates
        as vLLM. (The request holds no blocks yet, so the skipped-block removal the
        caller runs next frees nothing: the free count here is the count's.)"""
        coordinator = self.coordinator
        uncounted = coordinator.uncounted_external_blocks(
            request_id, hit_blocks, total_computed_tokens, main, prefill_end
        )
        extra = sum(n for _, n in uncounted)
        if extra <= 0:
            return
        counted = coordinator.get_num_blocks_to_allocate(
            request_id, need, hit_blocks, num_encoder_tokens, total_computed_tokens, main,
            prefill_end=prefill_end, record=False,
        )  # fmt: skip
        free = self.block_pool.get_num_free_blocks()
        if counted + held_back > free or counted + extra <= free:
            return
        groups = ", ".join(f"group {gid}: {n:+d}" for gid, n in uncounted)
        raise UncountedBlocksError(
            f"request {request_id!r}: this first allocation with external (KV connector) tokens "
            f"takes {counted + extra} blocks but only {free} are free; vLLM counts {counted} "
            f"(it leaves out the block a mamba align group takes for the external tokens' "
            f"last state: {groups}), so it would run out of blocks half way through the "
            "allocation and raise; refused before anything changed (retry when more blocks are free)"
        )

    def _refuse_hit_block_taken(
        self,
        request_id: str,
        hit_blocks: list[list[KVCacheBlock]],
        num_encoder_tokens: int,
        local: int,
        external: int,
        main: int,
        need: int,
        prefill_end: int,
    ) -> None:
        """Raise before anything changes where vLLM 0.16's group-by-group adoption would
        hand one block to two groups: an earlier group takes a later group's free hit
        block from the free queue for its external tokens, and the later group then
        touches it (see
        :meth:`~kvcoord.engine.coordinators_base.KVCacheCoordinator.external_blocks_taking_hits`).
        Where vLLM's count refuses (``None``) the caller returns ``None`` as vLLM; every
        other allocation is vLLM's. (A first-use request holds no blocks, so the
        skipped-block removal the caller runs next frees nothing: the queue read here is
        the one the adoption meets.)"""
        coordinator = self.coordinator
        taken = coordinator.external_blocks_taking_hits(request_id, hit_blocks, local, external)
        if not taken:
            return
        counted = coordinator.get_num_blocks_to_allocate(
            request_id, need, hit_blocks, num_encoder_tokens, local + external, main,
            prefill_end=prefill_end, record=False,
        )  # fmt: skip
        if counted > self.block_pool.get_num_free_blocks():
            return
        which = ", ".join(f"block {bid} (group {hit}'s hit) by group {gid}" for gid, hit, bid in taken)
        raise HitBlockTakenError(
            f"request {request_id!r}: this first allocation with external (KV connector) tokens "
            f"would hand a prefix-hit block to two groups: vLLM 0.16 adopts group by group, so an "
            f"earlier group's blocks for the external tokens take a later group's free hit block "
            f"from the free queue before that group touches it ({which}); refused before anything "
            "changed (the hit is still valid; retry once the free queue has moved, or without the "
            "hit; a vllm-0.33 pool touches every hit first)"
        )

    def _check_skip_zeroing(self, group_ids: Sequence[int]) -> frozenset[int]:
        """``allocate_slots``' ``skip_zeroing_group_ids``, checked: group ids of this
        pool, vllm-0.33 only."""
        if not group_ids:
            return frozenset()
        if not self.rules.full_sequence_admission:
            raise InvalidArgumentError(
                f"skip_zeroing_group_ids is a vLLM 0.33 input; this pool's profile is {self.config.profile}"
            )
        for gid in group_ids:
            if type(gid) is not int or not 0 <= gid < len(self.managers):
                raise InvalidArgumentError(
                    f"skip_zeroing_group_ids: {gid!r} is not a group of this pool (0..{len(self.managers) - 1})"
                )
        return frozenset(group_ids)

    def cache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to ``num_computed_tokens`` hittable
        (after a delayed external load)."""
        req = self._get(request_id)
        check_count(num_computed_tokens, "num_computed_tokens")
        if num_computed_tokens > req.num_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} exceeds the request's {req.num_tokens} tokens"
            )
        if not self.enable_caching:
            return
        hashed = min(max(0, num_computed_tokens - self._reprefillable), req.num_tokens - self.hash_lag)
        for m in self.managers:
            full = hashed // m.block_size
            held = len(m.req_to_blocks.get(request_id, ()))
            if full > m.num_cached_block.get(request_id, 0) and full > held:
                raise FailedPreconditionError(
                    f"group {m.group_id}: caching {full} blocks but request {request_id!r} holds only {held}"
                )
        self._cache_finalized(req, num_computed_tokens)

    def _cache_finalized(self, req: Request, num_tokens: int) -> None:
        """The coordinator caches the request's blocks up to ``num_tokens`` less the
        re-prefillable tail, and short of the tokens not hashed yet."""
        self.coordinator.cache_blocks(
            req, min(max(0, num_tokens - self._reprefillable), req.num_tokens - self._cache_lag)
        )

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free blocks that attention no longer reads after ``total_computed_tokens``."""
        self._get(request_id)
        check_count(total_computed_tokens, "total_computed_tokens")
        if total_computed_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"total_computed_tokens {total_computed_tokens} exceeds max_model_len {self.max_model_len}"
            )
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each block (KV connector load failures)."""
        ids = list(block_ids)
        for bid in ids:
            check_count(bid, "block id")
            if bid >= self.config.num_blocks:
                raise InvalidArgumentError(
                    f"block id {bid} is out of range (pool has {self.config.num_blocks} blocks)"
                )
        if ids:
            self.evict_blocks_called = True
        self.block_pool.evict_blocks(ids)

    def teardown(self, chunk: int = 16_384) -> Iterator[None]:
        """Release the pool's objects a slice at a time, yielding after each slice.

        A caller on an event loop steps through it between other work, so deleting a
        pool whose millions of blocks were used never stalls anything for long (each
        slice frees at most ``chunk`` objects, or one request: its block hashes). The
        pool is unusable afterwards.
        """
        for m in self.managers:
            tables = m.req_to_blocks
            while tables:
                tables.popitem()[1].clear()
                yield
        requests = self.requests
        while requests:
            requests.popitem()
            yield
        yield from self.block_pool.teardown(chunk)
