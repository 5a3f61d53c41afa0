"""Mamba (state space model) layers."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..request import Request
from ..specs import AttentionSpec, MambaCacheMode, MambaSpec
from .base import SingleTypeKVCacheManager, cdiv

__all__ = ["MambaManager", "MambaManager033"]


class MambaManager(SingleTypeKVCacheManager):
    """Only the latest state matters: every earlier position becomes null.

    Modes ``none`` and ``all`` allocate like other types, with ``num_speculative_blocks``
    extra blocks. Mode ``align`` keeps a state checkpoint at block boundaries: a request
    that already received blocks gets at most one new block per step, and the blocks
    of the previous step's speculative states move to the end of the list.
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        assert isinstance(spec, MambaSpec)
        self.align = spec.mamba_cache_mode == MambaCacheMode.ALIGN
        self.num_speculative_blocks = spec.num_speculative_blocks
        self.last_state_block_idx: dict[str, int] = {}
        self.allocated_block_reqs: set[str] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self._free_skipped(request_id, total_computed_tokens)
        if not self.align:
            return
        idx = self.last_state_block_idx.get(request_id)
        if idx is not None and idx < cdiv(total_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks.setdefault(request_id, [])
            if blocks[idx] is not self.null_block:
                self.block_pool.free_blocks([blocks[idx]])
                blocks[idx] = self.null_block

    def _free_skipped(self, request_id: str, total_computed_tokens: int) -> None:
        """The base rule: free the skipped prefix, from its end down to the first null."""
        super().remove_skipped_blocks(request_id, total_computed_tokens)

    def _hit_not_yet_usable(self, last: KVCacheBlock) -> bool:
        """A hit ending at ``last`` cannot be adopted yet (0.33's same-step refusal);
        0.16 adopts every hit."""
        return False

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
    ) -> int:
        if new_computed_blocks and self._hit_not_yet_usable(new_computed_blocks[-1]):
            # vLLM answers "one block more than the pool has", so the caller refuses
            return self.block_pool.num_blocks + 1
        S = self.num_speculative_blocks
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * S,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
            )
        required = cdiv(num_tokens_main_model, self.block_size) + S
        have = len(self.req_to_blocks.get(request_id, ()))
        new = required - len(new_computed_blocks) - have
        if new > 0:
            new = 1 if request_id in self.allocated_block_reqs else 1 + S
        evictable = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and not b.is_null)
        return new + evictable

    def check_allocation(self, request_id: str, num_tokens_main_model: int) -> str | None:
        """Mirror of the align-mode assertions in :meth:`allocate_new_blocks`, on lengths only."""
        if not self.align:
            return None
        S = self.num_speculative_blocks
        have = len(self.req_to_blocks.get(request_id, ()))
        required = cdiv(num_tokens_main_model, self.block_size) + S
        if required == have:
            return None
        if required < have:
            return (
                f"mamba align mode: the request already holds {have} blocks but this step "
                f"needs only {required}; token counts may not go backwards"
            )
        seen = request_id in self.allocated_block_reqs
        length = max(have, required - S - 1)
        if seen:
            length += sum(1 for j in range(have - S, have) if j < required - S - 1)
        new = required - length
        limit = 1 if seen else S + 1
        if new > limit:
            return (
                f"mamba align mode: this step would need {new} new blocks but at most "
                f"{limit} are allowed; schedule chunks that end on block boundaries "
                f"(block size {self.block_size})"
            )
        return None

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        S = self.num_speculative_blocks
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * S, num_tokens_main_model
            )
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        required = cdiv(num_tokens_main_model, self.block_size) + S
        prev = len(req_blocks)
        if required == prev:
            return []
        assert required > prev
        seen = request_id in self.allocated_block_reqs
        if seen:
            self.last_state_block_idx[request_id] = prev - 1 - S
        elif prev > 0:
            self.last_state_block_idx[request_id] = prev - 1
        upto = required - S - 1
        null = self.null_block
        if prev < upto:
            req_blocks.extend([null] * (upto - prev))
        if seen:
            for j in range(prev - S, prev):
                if j >= upto:
                    break
                req_blocks.append(req_blocks[j])
                req_blocks[j] = null
        num_new = required - len(req_blocks)
        assert num_new <= (1 if seen else S + 1)
        req_blocks.extend(self.block_pool.get_new_blocks(num_new))
        self.allocated_block_reqs.add(request_id)
        return req_blocks[prev:]

    def free(self, request_id: str) -> None:
        if self.align:
            self.allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
        super().free(request_id)

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
        bs = spec.block_size
        computed: list[list[int]] = [[] for _ in group_ids]
        aligned = bs == alignment_tokens
        for i in range(min(max_length // bs, len(block_hashes)) - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], group_ids)
            if cached is None:
                continue
            if not aligned and ((i + 1) * bs) % alignment_tokens:
                continue
            for lst, block_id in zip(computed, cached, strict=False):
                lst.extend([0] * i)
                lst.append(block_id)
            break
        return computed


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

    Sub-block (partial) hits with copy-on-write (a block larger than the hash block) are
    :class:`~kvcoord.engine.managers.partial.PartialMambaManager`'s. Not modelled, and
    refused by the configuration: prefill checkpoint blocks and prefix caching outside
    align mode.
    """

    def __init__(
        self, spec: AttentionSpec, block_pool: BlockPool, group_id: int, enable_caching: bool
    ) -> None:
        super().__init__(spec, block_pool, group_id, enable_caching)
        #: the hit alignment (the scheduler block size in a hybrid pool)
        self.alignment = spec.block_size
        #: sparse retention (``prefix_cache_retention_interval`` 0) rather than dense
        self.sparse = True
        #: align: positions below this are retired (freed or null) per request
        self.num_retired_blocks: dict[str, int] = {}
        #: keys ``(hash, group)`` of the blocks hashed since the last step boundary
        self.cached_this_step: set[tuple[bytes, int]] = set()
        #: boundary states not yet taken: (request, group, block, tokens)
        self.pending_offloads: list[tuple[str, int, KVCacheBlock, int]] = []

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

    def check_allocation(self, request_id: str, num_tokens_main_model: int) -> str | None:
        if not self.align:
            return None
        have = len(self.req_to_blocks.get(request_id, ()))
        if cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks <= have:
            return None  # 0.33 tolerates a step needing fewer blocks than held
        return super().check_allocation(request_id, num_tokens_main_model)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> list[KVCacheBlock]:
        if self.align:
            have = len(self.req_to_blocks.setdefault(request_id, []))
            if cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks <= have:
                self.allocated_block_reqs.add(request_id)
                return []
        return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)

    def free(self, request_id: str) -> None:
        self.num_retired_blocks.pop(request_id, None)
        if self.pending_offloads:
            # the blocks go back to the pool now: a later hand-off could name a block
            # another request holds by then
            self.pending_offloads = [e for e in self.pending_offloads if e[0] != request_id]
        super().free(request_id)

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
        if self.align:
            self._cache_prompt_boundary(request, num_tokens, blocks)
        for index in range(num_cached, num_full):
            block = blocks[index]
            if block.is_null or block.cached_hash is None:
                continue
            self.cached_this_step.add((block.cached_hash, block.cached_group))
            if self.align:
                self.pending_offloads.append((rid, self.group_id, block, (index + 1) * bs))

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
        index = cdiv(num_tokens, self.block_size) - 1
        if index >= len(blocks) or blocks[index].is_null or blocks[index].cached_hash is not None:
            return
        self.block_pool.cache_full_blocks(request, blocks, index, index + 1, self.block_size, self.group_id)
        block = blocks[index]
        if block.cached_hash is not None:
            self.cached_this_step.add((block.cached_hash, block.cached_group))
