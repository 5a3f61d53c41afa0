"""Mamba (state space model) layers: vLLM 0.16's manager (0.33's is
:mod:`~kvcoord.engine.managers.mamba033`)."""

from __future__ import annotations

from collections.abc import Sequence

from ..block_pool import BlockPool
from ..blocks import KVCacheBlock
from ..specs import AttentionSpec, MambaCacheMode, MambaSpec
from .base import SingleTypeKVCacheManager, cdiv

__all__ = ["MambaManager"]


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
        *,
        prefill_end: int = 0,
        record: bool = True,
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

    def check_allocation(
        self, request_id: str, num_tokens_main_model: int, query_start: int = 0, prefill_end: int = 0
    ) -> str | None:
        """Mirror of the align-mode assertions in :meth:`allocate_new_blocks`, on lengths
        only (``query_start`` and ``prefill_end``: for vLLM 0.33's prefill checkpoints)."""
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
        new = self._new_blocks_on_lengths(request_id, have, required)
        limit = 1 if seen else S + 1
        if new > limit:
            return (
                f"mamba align mode: this step would need {new} new blocks but at most "
                f"{limit} are allowed; schedule chunks that end on block boundaries "
                f"(block size {self.block_size})"
            )
        return None

    def _new_blocks_on_lengths(self, request_id: str, have: int, required: int) -> int:
        """Align mode: the new blocks :meth:`allocate_new_blocks` takes for a request
        holding ``have`` blocks when the step requires ``required``, on lengths only."""
        if required <= have:
            return 0
        S = self.num_speculative_blocks
        length = max(have, required - S - 1)
        if request_id in self.allocated_block_reqs:
            length += sum(1 for j in range(have - S, have) if j < required - S - 1)
        return required - length

    def _new_blocks_after_external(
        self,
        request_id: str,
        held: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        prefill_end: int,
    ) -> int:
        """The new blocks :meth:`allocate_new_blocks` takes right after a first adoption
        left the request ``held`` blocks (0.33 adds its prefill checkpoint rule)."""
        required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        return self._new_blocks_on_lengths(request_id, held, required)

    def uncounted_external_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        prefill_end: int = 0,
    ) -> int:
        """Align mode, a request's first allocation with external (KV connector) tokens:
        the blocks it takes less those :meth:`get_num_blocks_to_allocate` counts (no
        state change; call before the count, with the same values).

        Adopting the external tokens nulls the skipped prefix (the hit's blocks too: the
        state of the last computed token is all a mamba group keeps) and takes one new
        block for the last computed token's state; then :meth:`allocate_new_blocks`
        takes the step's blocks from there. vLLM (0.16.0 and 0.33.0) counts only the
        latter, so near a full pool its ``get_new_blocks`` runs out half way through
        the allocation. Positive: more blocks than counted; 0 outside align mode or for
        an admitted request (it adopts nothing)."""
        if not self.align or request_id in self.num_cached_block:
            return 0
        held = cdiv(total_computed_tokens, self.block_size)
        taken = 1 + self._new_blocks_after_external(
            request_id, held, total_computed_tokens, num_tokens_main_model, prefill_end
        )
        counted = self.get_num_blocks_to_allocate(
            request_id,
            num_tokens_main_model,
            new_computed_blocks,
            total_computed_tokens,
            num_tokens_main_model,
            prefill_end=prefill_end,
            record=False,
        )
        return taken - counted

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

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        if self.align:
            self.allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

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
