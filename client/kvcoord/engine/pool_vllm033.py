"""vLLM 0.33's calls beyond 0.16's manager: admission statistics and block counts,
step starts, zeroing, mamba boundary-state hand-offs, copy-on-write copies and their
retained blocks, partial-tail offloads, cached-token estimates. A vllm-0.16 pool
refuses the ones vLLM 0.16 has no counterpart for.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .errors import BlockNotRetainedError, FailedPreconditionError, InvalidArgumentError
from .managers import CrossAttentionManager
from .managers.partial import PartialMambaManager
from .pool_inspect import PoolInspection
from .request_table import check_count
from .results import BlockIds


class Pool033Calls(PoolInspection):
    """:class:`~kvcoord.engine.pool.KVCachePool`'s vllm-0.33 calls."""

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        """vLLM 0.33's ``record_prefix_cache_stats``: count an admitted request's lookup
        (``num_hits`` tokens found) in the prefix-cache statistics. Nothing for a request
        that skips reading the cache, with caching off, or without statistics.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: a bad count.
            FailedPreconditionError: the pool's profile counts at lookup (vllm-0.16).
        """
        req = self._get(request_id)
        check_count(num_hits, "num_hits")
        if not self.rules.stats_at_admission:
            raise FailedPreconditionError(
                f"this pool's profile ({self.config.profile}) records statistics at each lookup; "
                "record_prefix_cache_stats is a vllm-0.33 call"
            )
        if self.enable_caching and not req.skip_reading_prefix_cache:
            self.hits.record_admission(req, num_hits)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_encoder_tokens: int = 0,
    ) -> int:
        """vLLM 0.33's ``coordinator.get_num_blocks_to_allocate`` with no new hit: the
        free blocks the request would still take to hold ``num_tokens`` (its scheduler
        sums them into ``reserved_blocks``). Changes nothing, except as vLLM 0.33 does
        without ``apply_admission_cap``: a mamba group plans its prefill checkpoint.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: bad counts.
            FailedPreconditionError: a vllm-0.16 pool (vLLM 0.16 has no such call).
        """
        req = self._get(request_id)
        for name, value in (("num_tokens", num_tokens), ("total_computed_tokens", total_computed_tokens),
                            ("num_tokens_main_model", num_tokens_main_model),
                            ("num_encoder_tokens", num_encoder_tokens)):  # fmt: skip
            check_count(value, name)
        if not self.rules.full_sequence_admission:
            raise FailedPreconditionError(
                f"get_num_blocks_to_allocate is a vllm-0.33 call; this pool's profile is {self.config.profile}"
            )
        return self.coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            [[] for _ in self.managers],
            num_encoder_tokens,
            total_computed_tokens,
            num_tokens_main_model,
            self._admission_caps if apply_admission_cap else None,
            max(req.num_prompt_tokens, req.num_tokens - 1),
        )

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> BlockIds:
        """vLLM 0.33's ``get_block_ids_for_computed_tokens``: the request's table with
        each attention group cut to the blocks covering ``num_computed_tokens``
        (cross-attention groups whole)."""
        table = self.get_block_ids(request_id)
        check_count(num_computed_tokens, "num_computed_tokens")
        return tuple(
            ids if isinstance(m, CrossAttentionManager) else ids[: -(-num_computed_tokens // m.block_size)]
            for m, ids in zip(self.managers, table, strict=True)
        )

    def shared_prefix_boundary(self, request_id: str) -> int:
        """vLLM 0.33's third ``get_computed_blocks`` result, kept on the request by its
        last lookup: where a shared prefix ends that a sparse (sliding-window) group has
        not cached, or 0. Always 0 outside vllm-0.33 hybrid pools."""
        return self._get(request_id).shared_prefix_boundary

    def scheduler_state(self) -> str:
        """What this pool keeps of its scheduler's steps as the pool's own, not any
        request's ("" for none): vllm-0.33 fine-grained hits' copy-on-write pairs and
        retained blocks, mamba groups' boundary-state hand-offs and the hits a step may
        not take yet, the new blocks' ids to zero. Whoever takes it or starts a step
        takes or clears it for every user of the pool: one scheduler may use it."""
        parts = []
        if self.config.partial_hash_hits:
            parts.append(
                "fine-grained (partial) hits, whose copy-on-write pairs one session takes and releases"
            )
        if self._mamba033:
            parts.append(
                "mamba groups, whose boundary-state hand-offs and step-bound hits one scheduler takes"
            )
        if self._zeroed_groups:
            parts.append("new blocks' ids for its worker to zero, which one session takes")
        return "; ".join(parts)

    def new_step_starts(self) -> None:
        """vLLM 0.33's ``new_step_starts`` (the scheduler calls it at every step): a
        mamba group's hits on blocks cached during the step that ends become usable.
        Nothing changes in pools without mamba groups."""
        for m in self._mamba033:
            m.new_step_starts()

    def take_new_block_ids(self) -> list[int]:
        """vLLM 0.33's ``take_new_block_ids``: the ids of blocks attention groups took
        since the last call, for the worker to zero (group order, then allocation
        order). Only pools with mamba groups or ``needs_kv_cache_zeroing`` record them
        (vLLM zeroes for mamba models and mixed-precision KV caches); the others answer
        an empty list.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_new_block_ids")
        out: list[int] = []
        for gid in self._zeroed_groups:
            out.extend(self.pending_new_block_ids[gid])
            self.pending_new_block_ids[gid] = []
        return out

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM 0.33's ``take_boundary_state_offloads``: per request, the mamba state
        blocks hashed since the last call, as ``(group, block id, boundary tokens)``
        (a KV connector offloads them); requests freed since are left out.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_boundary_state_offloads")
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self._mamba033:
            for rid, gid, block, tokens in m.take_boundary_state_offloads():
                out.setdefault(rid, []).append((gid, block.block_id, tokens))
        return out

    def drop_boundary_state_offloads(self, request_id: str) -> None:
        """The part of vLLM 0.33's ``pop_blocks_for_free`` (a KV-consumer connector with
        overlapping steps: the free is deferred) that cannot wait for the deferred
        :meth:`free`: the request's boundary-state hand-offs not taken yet are dropped
        now (vLLM's scheduler drains them every step). Its blocks stay held.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
        """
        self._require_033("drop_boundary_state_offloads")
        self._get(request_id)
        for m in self._mamba033:
            m.drop_boundary_state_offloads(request_id)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM 0.33's ``record_blocks_for_zeroing`` (its scheduler calls it in a pool
        that zeroes new blocks when an asynchronous KV load failed but left valid
        computed tokens): the request's blocks from the one starting at ``start_token``
        on, in every group that records new block ids, are recorded again for
        :meth:`take_new_block_ids` (the failed load left them unwritten), as vLLM
        records them: every block the request holds there, a window's null blocks
        (id 0) included. A pool that records nothing records nothing here.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
            InvalidArgumentError: ``start_token`` not a count, or not a multiple of a
                recording group's block size (vLLM asserts it: zeroing a block would
                wipe its valid prefix); nothing is recorded then.
        """
        self._require_033("record_blocks_for_zeroing")
        self._get(request_id)
        check_count(start_token, "start_token")
        for gid in self._zeroed_groups:
            if start_token % self.managers[gid].block_size:
                raise InvalidArgumentError(
                    f"record_blocks_for_zeroing: start_token {start_token} is not a multiple of "
                    f"group {gid}'s block size {self.managers[gid].block_size}"
                )
        for gid in self._zeroed_groups:
            m = self.managers[gid]
            held = m.req_to_blocks.get(request_id, ())
            self.pending_new_block_ids[gid].extend(b.block_id for b in held[start_token // m.block_size :])

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """vLLM 0.33's ``take_kv_cache_block_copies``: the copy-on-write pairs
        ``(source, destination)`` made since the last call (group order, then the order
        they were made) and the ids of their blocks, each pair's source then its
        destination. The worker runs the copies in the step they are handed to; each id
        listed holds one reference (*retained*) until :meth:`release_retained_blocks`
        returns it. Only pools with fine-grained (partial) hits make copies (see
        :attr:`KVCacheConfig.partial_hash_hits`); the others answer empty lists.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_kv_cache_block_copies")
        copies: list[tuple[int, int]] = []
        retained: list[int] = []
        for m in self.cow_managers:
            for source, target in m.take_pending_cow_copies():
                copies.append((source.block_id, target.block_id))
                retained += (source.block_id, target.block_id)
        self.retained.update(retained)
        return copies, retained

    def release_retained_blocks(self, block_ids: Sequence[int]) -> None:
        """vLLM 0.33's ``block_pool.free_blocks(retained)`` once the copies ran: drop
        one retained reference per listed id, in order (a block reaching no reference
        goes to the free queue as any freed block). The ids must be ones
        :meth:`take_kv_cache_block_copies` handed out and not released yet (an id as
        many times as it is retained at most); otherwise nothing changes.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            InvalidArgumentError: an id is not an integer.
            BlockNotRetainedError: an id is not retained (that many times).
        """
        self._require_033("release_retained_blocks")
        ids = list(block_ids)
        for bid in ids:
            check_count(bid, "block id")
        wanted = Counter(ids)
        for bid, n in wanted.items():
            if self.retained[bid] < n:
                held = self.retained[bid]
                raise BlockNotRetainedError(
                    f"block {bid} is released {n} time(s) but retained {held} time(s): only ids "
                    "from take_kv_cache_block_copies not released yet can be released"
                )
        self.retained.subtract(wanted)
        self.retained += Counter()  # drop the ids at zero
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[bid] for bid in ids])

    def drop_block_copies(self) -> int:
        """The copy-on-write pairs' references end with the session that made them (its
        scheduler will never run the copies nor release the blocks): drop the pairs not
        taken yet and every retention, each reference returned as
        :meth:`release_retained_blocks` returns it, in ascending block id order (so a
        pool restored from its exported state drops them alike). Pools without
        fine-grained hits hold none: nothing changes.

        Returns:
            the number of references dropped.
        """
        for m in self.cow_managers:
            for source, target in m.take_pending_cow_copies():
                self.retained.update((source.block_id, target.block_id))
        if not self.retained:
            return 0
        blocks = self.block_pool.blocks
        ids = sorted(self.retained.elements())
        self.retained.clear()
        self.block_pool.free_blocks([blocks[bid] for bid in ids])
        return len(ids)

    def finalize_partial_tail_offloads(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int = 0
    ) -> list[tuple[int, int, int]]:
        """vLLM 0.33's ``finalize_partial_tail_offloads`` (a KV producer's request
        finishing): per mamba group that made the request a producer of a partial tail
        and saw it stop exactly at that boundary with nothing in flight, ``(group,
        block id, boundary tokens)``; the producer records are consumed. Call it before
        :meth:`free`.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
        """
        self._require_033("finalize_partial_tail_offloads")
        self._get(request_id)
        out: list[tuple[int, int, int]] = []
        for m in self.managers:
            if isinstance(m, PartialMambaManager):
                got = m.finalize_partial_tail_offload(request_id, num_computed_tokens, num_in_flight_tokens)
                if got is not None:
                    out.append((got[0], got[1].block_id, got[2]))
        return out

    def estimate_cached_tokens(self, request_id: str) -> int:
        """vLLM 0.33's ``estimate_cached_tokens``: per prefix-cacheable group, the end of
        the request's furthest block that holds a hash; the smallest over the groups
        (0 when caching is off or no group counts)."""
        self._get(request_id)
        if not self.enable_caching:
            return 0
        out: int | None = None
        for m in self.managers:
            if isinstance(m, CrossAttentionManager):
                continue
            blocks = m.req_to_blocks.get(request_id) or ()
            partial = self.block_pool.partial_tokens
            end = 0
            for i in range(len(blocks) - 1, -1, -1):
                if blocks[i].cached_hash is not None and not blocks[i].is_null:
                    end = partial.get(blocks[i].block_id, (i + 1) * m.block_size)
                    break
            out = end if out is None else min(out, end)
        return out or 0
