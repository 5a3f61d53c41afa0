"""vLLM 0.33's mamba manager (profile vllm-0.33): what changed from 0.16's
(:mod:`~kvcoord.engine.managers.mamba`), prefill checkpoint blocks included."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..request import Request
from ..specs import AttentionSpec, MambaSpec
from .base import cdiv
from .mamba import MambaManager

__all__ = ["MambaManager033"]


class MambaManager033(MambaManager):
    """vLLM 0.33's mamba manager (profile vllm-0.33).

    What changed from :class:`MambaManager` (0.16):

    - *Same-step refusal* (0.17): a hit whose last block was cached during the current
      scheduler step (since the last :meth:`new_step_starts`) cannot be adopted yet; the
      allocation asks for more blocks than the pool has, so it is refused.
    - *Retired ranges* (align, 0.30): freeing the skipped prefix walks past nulls
      instead of stopping at the first one, and never revisits positions already
      retired.
    - *Over-allocation* (align, 0.23): a step needing no more blocks than the request
      holds returns nothing instead of being an error.
    - *Sparse retention* (0.30, ``prefix_cache_retention_interval`` 0): of the newly
      full blocks only the state block ending at a reachable boundary is hashed: the
      prompt's replay boundary (``num_prompt_tokens - 1``) or the request's
      shared-prefix junction, each rounded down to the hit alignment.
    - *Boundary-state hand-offs* (align, 0.29): every block newly hashed is recorded as
      ``(request, group, block, tokens)`` for the scheduler's
      ``take_boundary_state_offloads``; a request's records are dropped when it is
      freed.

    - *Speculative blocks* (MTP/EAGLE): as in 0.16; 0.33 caps align mode's new blocks
      at 1 + ``num_speculative_blocks`` for a request's first allocation and 1 after,
      where 0.16 set those counts, and a request needing any new block needs at least
      that many, so the answers are the same (checked against vLLM 0.33.0's manager:
      tests/conformance/test_differential_033.py and bench/vs_vllm.py).

    - *Prefill checkpoint blocks* (align, ``num_prefill_checkpoint_blocks`` > 0): the
      chunk reaching the prefill's end keeps one more block alive, at column
      ``cdiv(end, block_size) - 2``, where the worker exports the state at the last
      reusable boundary below the end (``checkpoint_position``); that block is not
      nulled, it is hashed at that boundary (or, when the boundary is not one a lookup
      can reach, its hash is dropped). Planned by the uncapped block count
      (:meth:`plan_checkpoint`), taken by :meth:`allocate_new_blocks`, keyed by
      :meth:`cache_blocks`. The worker needs nothing more: it derives the column from
      the same lengths (vLLM's ``compute_mamba_prefill_checkpoints``).

    Sub-block (partial) hits with copy-on-write (a block larger than the hash block) are
    :class:`~kvcoord.engine.managers.partial.PartialMambaManager`'s (prefill checkpoint
    blocks beside them included). Not modelled, and refused by the configuration: prefix
    caching outside align mode. (Shared-prefix checkpoints,
    :attr:`shared_prefix_checkpoint`, are modelled with partial hits only.)
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        #: the hit alignment (the scheduler block size in a hybrid pool)
        self.alignment = spec.block_size
        #: vLLM 0.33's ``shared_prefix_checkpoint`` (set by the coordinator from
        #: ``KVCacheConfig.mamba_shared_prefix_checkpoint``): also key the state at the
        #: request's shared-prefix junction (:class:`~.partial.PartialMambaManager`)
        self.shared_prefix_checkpoint = False
        #: sparse retention (``prefix_cache_retention_interval`` 0) rather than dense
        self.sparse = True
        #: align: positions below this are retired (freed or null) per request
        self.num_retired_blocks: dict[str, int] = {}
        #: keys ``(hash, group)`` of the blocks hashed since the last step boundary
        self.cached_this_step: set[tuple[bytes, int]] = set()
        #: boundary states not yet taken: (request, group, block, tokens)
        self.pending_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        assert isinstance(spec, MambaSpec)
        #: align mode with prefill checkpoint blocks (vLLM 0.33's ``has_prefill_checkpoint_blocks``)
        self.has_checkpoint_blocks = self.align and spec.num_prefill_checkpoint_blocks > 0
        self.checkpoint_alignment = spec.prefill_checkpoint_alignment
        #: per request, the planned prefill checkpoint: (position, block index)
        self.checkpoints: dict[str, tuple[int, int]] = {}

    # -- steps --------------------------------------------------------------------------
    def new_step_starts(self) -> None:
        """The scheduler's step boundary: hits on blocks cached before now are usable."""
        self.cached_this_step.clear()

    def take_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        """Drain the boundary states recorded since the last call, oldest first."""
        out, self.pending_offloads = self.pending_offloads, []
        return out

    # -- skipped blocks -------------------------------------------------------------------
    def _free_skipped(self, request_id: str, total_computed_tokens: int) -> None:
        """Align mode frees the skipped prefix past nulls, from the first position not
        yet retired (vLLM 0.30+); other modes by the base rule."""
        if not self.align:
            super()._free_skipped(request_id, total_computed_tokens)
            return
        skipped = self.get_num_skipped_tokens(total_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        first = self.num_retired_blocks.get(request_id, 0)
        last = min(skipped // self.block_size, len(blocks))
        if first >= last:
            return
        null = self.null_block
        freed = []
        for i in range(last - 1, first - 1, -1):
            if blocks[i] is not null:
                freed.append(blocks[i])
                blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)
        self.num_retired_blocks[request_id] = last

    def skips_blocks(self, request_id: str, total_computed_tokens: int) -> bool:
        return True  # conservative: callers then take the general path

    # -- allocation -----------------------------------------------------------------------
    # get_num_blocks_to_allocate is 0.16's: 0.33 caps align mode's new blocks (1, or
    # 1 + num_speculative_blocks for a first allocation) where 0.16 sets them; a first
    # allocation needs at least 1 + num_speculative_blocks blocks (its hit ends before
    # the tokens it computes), so the cap and the set count agree.
    def _hit_not_yet_usable(self, last: KVCacheBlock) -> bool:
        """The hit's last block was cached during the current scheduler step."""
        return last.cached_hash is not None and (last.cached_hash, last.cached_group) in self.cached_this_step

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
        if not self.has_checkpoint_blocks or (
            new_computed_blocks and self._hit_not_yet_usable(new_computed_blocks[-1])
        ):
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_tokens_main_model
            )
        point = self.plan_checkpoint(request_id, total_computed_tokens, num_tokens_main_model, prefill_end)
        if record:
            if point is None:
                self.checkpoints.pop(request_id, None)
            else:
                self.checkpoints[request_id] = point
        S = self.num_speculative_blocks
        have = len(self.req_to_blocks.get(request_id, ()))
        new = cdiv(num_tokens_main_model, self.block_size) + S - len(new_computed_blocks) - have
        if new > 0:
            cap = 1 + int(point is not None) + (0 if request_id in self.allocated_block_reqs else S)
            new = min(new, cap)
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return new + evictable

    def check_allocation(
        self, request_id: str, num_tokens_main_model: int, query_start: int = 0, prefill_end: int = 0
    ) -> str | None:
        if not self.align:
            return None
        have = len(self.req_to_blocks.get(request_id, ()))
        if cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks <= have:
            return None  # 0.33 tolerates a step needing fewer blocks than held
        if self.has_checkpoint_blocks and self.plan_checkpoint(
            request_id, query_start, num_tokens_main_model, prefill_end
        ):
            return self._check_checkpoint_allocation(request_id, num_tokens_main_model)
        return super().check_allocation(request_id, num_tokens_main_model)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        if self.align and request_id in self.checkpoints:
            return self._allocate_with_checkpoint(request_id, num_tokens_main_model)
        if self.align:
            have = len(self.req_to_blocks.setdefault(request_id, []))
            if cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks <= have:
                self.allocated_block_reqs.add(request_id)
                return []
        return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """As vLLM 0.33 drops a request's mamba state when it takes its blocks (at once
        for a free, a step before they return for a deferred one)."""
        self.num_retired_blocks.pop(request_id, None)
        self.checkpoints.pop(request_id, None)
        self.drop_boundary_state_offloads(request_id)
        return super().pop_blocks_for_free(request_id)

    def drop_boundary_state_offloads(self, request_id: str) -> None:
        """Forget the request's hand-offs not taken yet: its blocks are going back to the
        pool, so a later hand-off could name a block another request holds by then."""
        if self.pending_offloads:
            self.pending_offloads = [e for e in self.pending_offloads if e[0] != request_id]

    # -- caching ----------------------------------------------------------------------------
    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Hash the request's newly full state blocks up to ``num_tokens`` (already
        rounded down to the hit alignment by the coordinator): every one when dense,
        else only those ending at a reachable boundary."""
        rid = request.request_id
        bs = self.block_size
        num_cached = self.num_cached_block.get(rid, 0)
        hashed = len(request.block_hashes) * self.block_pool.hash_block_size
        num_full = min(num_tokens, hashed) // bs
        blocks = self.req_to_blocks.setdefault(rid, [])
        if num_cached < num_full:
            mask = None
            if self.sparse:
                mask = [False] * (num_full - num_cached)
                for boundary in self._reachable_boundaries(request):
                    index = boundary // self.alignment * self.alignment // bs - 1
                    if num_cached <= index < num_full:
                        mask[index - num_cached] = True
            self.block_pool.cache_full_blocks(request, blocks, num_cached, num_full, bs, self.group_id, mask)
            self.num_cached_block[rid] = num_full
        if self.align and rid in self.checkpoints:
            self._key_checkpoint(request, blocks)
        elif self.align:
            self._cache_prompt_boundary(request, num_tokens, blocks)
        for index in range(num_cached, num_full):
            block = blocks[index]
            if block.is_null or block.cached_hash is None:
                continue
            self.cached_this_step.add((block.cached_hash, block.cached_group))
            if self.align:  # at the tokens its key names (a checkpoint re-keyed inside it)
                tokens = self.block_pool.partial_tokens.get(block.block_id, (index + 1) * bs)
                self.pending_offloads.append((rid, self.group_id, block, tokens))

    def _reachable_boundaries(self, request: Request) -> list[int]:
        out = [request.num_prompt_tokens - 1]
        if request.shared_prefix_boundary:
            out.append(request.shared_prefix_boundary)
        return out

    def _cache_prompt_boundary(self, request: Request, num_tokens: int, blocks: list[KVCacheBlock]) -> None:
        """vLLM 0.33 also keys the state at the prompt's last hash boundary below its
        end when a step stops exactly there. With the block size equal to the hash
        block size (the only layout taken) that is a whole block, usually hashed by
        the sparse mask already; otherwise it is hashed here, as one more full block."""
        hbs = self.block_pool.hash_block_size
        lag = max(1, self.block_pool.num_hash_lookahead_tokens)
        boundary = max((request.num_prompt_tokens - lag) // hbs * hbs, 0)
        if num_tokens <= 0 or num_tokens % hbs or num_tokens != boundary:
            return
        self._key_whole_block(request, cdiv(num_tokens, self.block_size) - 1, blocks)

    def _key_whole_block(self, request: Request, index: int, blocks: list[KVCacheBlock]) -> None:
        """Hash block ``index`` as one more full block, unless null or keyed already."""
        if index >= len(blocks) or blocks[index].is_null or blocks[index].cached_hash is not None:
            return
        self.block_pool.cache_full_blocks(request, blocks, index, index + 1, self.block_size, self.group_id)
        block = blocks[index]
        if block.cached_hash is not None:
            self.cached_this_step.add((block.cached_hash, block.cached_group))

    # -- prefill checkpoint blocks (vLLM 0.33) ----------------------------------------------
    def _checkpoint_position(self, num_tokens: int) -> int:
        """vLLM 0.33's reusable boundary of a prefix of ``num_tokens``: the last hit
        alignment strictly below it, leaving the token(s) whose hash is not known yet."""
        lag = max(1, self.block_pool.num_hash_lookahead_tokens)
        return max((num_tokens - lag) // self.alignment * self.alignment, 0)

    def plan_checkpoint(
        self, request_id: str, query_start: int, query_end: int, prefill_end: int
    ) -> tuple[int, int] | None:
        """The prefill checkpoint a step computing tokens ``query_start..query_end`` takes,
        as ``(position, block index)``, or ``None``: only the chunk reaching the prefill's
        end (``prefill_end``) takes one, where the backend can export the state (its start
        on a hash block, on the checkpoint grid from the start, a whole hash block below
        the position, the column past the one holding the initial state), and only where
        that column holds no live block yet (or a speculative block the step relocates)."""
        if not self.has_checkpoint_blocks or self.checkpoint_alignment is None or query_end < prefill_end:
            return None
        bs = self.block_size
        hbs = self.block_pool.hash_block_size
        position = self._checkpoint_position(query_end)
        index = cdiv(query_end, bs) - 2
        if not (
            query_start % hbs == 0
            and index > (query_start - 1) // bs
            and query_start + hbs <= position
            and query_start < position < query_end
            and (position - query_start) % self.checkpoint_alignment == 0
            and index >= 0
        ):
            return None
        blocks = self.req_to_blocks.get(request_id, [])
        if (
            index >= len(blocks)
            or blocks[index].is_null
            or (
                request_id in self.allocated_block_reqs and index >= len(blocks) - self.num_speculative_blocks
            )
        ):
            return position, index
        return None

    def _check_checkpoint_allocation(self, request_id: str, num_tokens_main_model: int) -> str | None:
        """:meth:`check_allocation` for a step taking a checkpoint block: one more new
        block allowed, the checkpoint column not nulled."""
        S = self.num_speculative_blocks
        have = len(self.req_to_blocks.get(request_id, ()))
        required = cdiv(num_tokens_main_model, self.block_size) + S
        seen = request_id in self.allocated_block_reqs
        new = self._checkpoint_new_blocks(request_id, have, required)
        limit = 2 if seen else S + 2
        if new > limit:
            return (
                f"mamba align mode: this step would need {new} new blocks but at most "
                f"{limit} are allowed (a prefill checkpoint step); schedule chunks that end on "
                f"block boundaries (block size {self.block_size})"
            )
        return None

    def _checkpoint_new_blocks(self, request_id: str, have: int, required: int) -> int:
        """The new blocks :meth:`_allocate_with_checkpoint` takes for a request holding
        ``have`` blocks when the step requires ``required``, on lengths only."""
        S = self.num_speculative_blocks
        upto = required - S - 2
        length = max(have, upto)
        if request_id in self.allocated_block_reqs:
            length += sum(1 for j in range(have - S, have) if j < upto)
        return max(required - length, 0)

    def _new_blocks_after_external(
        self,
        request_id: str,
        held: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        prefill_end: int,
    ) -> int:
        """As 0.16's, but a step planning a prefill checkpoint (planned by the count,
        before the adoption) allocates by the checkpoint rule."""
        if self.has_checkpoint_blocks and self.plan_checkpoint(
            request_id, total_computed_tokens, num_tokens_main_model, prefill_end
        ):
            required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
            return self._checkpoint_new_blocks(request_id, held, required)
        return super()._new_blocks_after_external(
            request_id, held, total_computed_tokens, num_tokens_main_model, prefill_end
        )

    def _allocate_with_checkpoint(self, request_id: str, num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Align mode's allocation for a step taking a prefill checkpoint: as without
        one, except that the column before the last state block is left for a new block
        (the checkpoint target) instead of a null, and a speculative block standing
        there stays in place."""
        S = self.num_speculative_blocks
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        required = cdiv(num_tokens_main_model, self.block_size) + S
        prev = len(req_blocks)
        seen = request_id in self.allocated_block_reqs
        if seen:
            self.last_state_block_idx[request_id] = prev - 1 - S
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        upto = required - S - 2  # the skipped columns, less the checkpoint's
        null = self.null_block
        if prev < upto:
            req_blocks.extend([null] * (upto - prev))
        if seen:
            for j in range(prev - S, prev):
                if j >= upto:
                    break
                req_blocks.append(req_blocks[j])
                req_blocks[j] = null
        num_new = max(required - len(req_blocks), 0)
        assert num_new <= (2 if seen else S + 2)
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))
        self.allocated_block_reqs.add(request_id)
        return req_blocks[prev:]

    def _key_checkpoint(self, request: Request, blocks: list[KVCacheBlock]) -> None:
        """vLLM 0.33 keys the checkpoint block at its boundary when that boundary is one
        a lookup can reach (the prompt's own, every one under dense retention, the
        request's shared-prefix junction); otherwise the exported state is transient and
        any key the block got this step is dropped."""
        position, index = self.checkpoints[request.request_id]
        block = blocks[index]
        reachable = (
            position == self._checkpoint_position(request.num_prompt_tokens)
            or (not self.sparse and position % self.block_size == 0)
            or position == request.shared_prefix_boundary
        )
        if not reachable:
            self._drop_keys(block)
            return
        if block.cached_hash is not None:
            if position == self.block_pool.partial_tokens.get(block.block_id, (index + 1) * self.block_size):
                return  # keyed at this boundary already (the block ends there, or an earlier step)
            self._drop_keys(block)  # the exported state replaced what the key named
        self.block_pool.cache_partial_block(request, block, position, self.group_id)
        if block.cached_hash is not None:
            self.cached_this_step.add((block.cached_hash, block.cached_group))

    def _drop_keys(self, block: KVCacheBlock) -> None:
        bp = self.block_pool
        if bp.multi_key_blocks:
            bp.evict_all_keys(block)
        else:
            bp.evict_cached_block(block)
