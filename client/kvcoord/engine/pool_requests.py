"""The pool's requests: register, update, checkpoint and restore, read, free and preempt.

Requests live in the :class:`~kvcoord.engine.request_table.RequestTable`; freeing one
gives its blocks back (:meth:`PoolRequests._release`: the coordinator's free, fused
for managers that free by the base rule).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from .errors import FailedPreconditionError, InvalidArgumentError, RequestNotFoundError
from .extra_keys import ExtraKeySources
from .managers import SingleTypeKVCacheManager
from .pool_parts import PoolParts
from .request import LoRA, Request
from .request_table import check_count
from .results import RequestCheckpoint, RequestRewind


class PoolRequests(PoolParts):
    """:class:`~kvcoord.engine.pool.KVCachePool`'s request calls."""

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes] = (),
        *,
        lora: LoRA | None = None,
        skip_reading_prefix_cache: bool = False,
        num_preemptions: int = 0,
        cache_namespace: str = "",
        cache_salt: str | None = None,
        extra_key_sources: ExtraKeySources | None = None,
        num_prompt_tokens: int | None = None,
        kv_cache_report_full: bool = False,
    ) -> None:
        """Register a request with its prompt and the prompt's block hashes.

        ``num_prompt_tokens`` (default: every token given) is how many of the tokens are
        the prompt, for a request registered again after a preemption with its output
        tokens: vllm-0.33 pools keep its replay boundary at the prompt's end, as vLLM.

        ``cache_salt`` and ``extra_key_sources`` (multimodal items, prompt-embeds
        digests) are only reported in vllm-0.33 pools' KV events (the hashes already
        include them).

        ``kv_cache_report_full`` is vLLM 0.33's ``kv_cache_report_mode == "full"``: in a
        vllm-0.33 pool with KV events each lookup of the request that finds a hit
        re-announces the hit's blocks (:meth:`PrefixHits.hit_events`); vllm-0.16 pools
        ignore it, as vLLM 0.16 does.

        ``cache_namespace`` isolates prefix caching: the request hits only blocks cached
        by requests of the same namespace, whatever its hashes. ``""`` (the default) is
        vLLM's single cache, with vLLM's keys.

        Raises:
            RequestExistsError: the id is in use.
            InvalidArgumentError: bad id, tokens, hashes or LoRA, or an empty prompt
                (vLLM never schedules one: its lookup would search ``-1`` tokens).
        """
        self.request_table.add(
            request_id,
            prompt_token_ids,
            block_hashes,
            lora,
            skip_reading_prefix_cache,
            num_preemptions,
            cache_namespace,
            cache_salt,
            extra_key_sources,
            num_prompt_tokens,
            kv_cache_report_full,
        )

    @property
    def cache_namespaces(self) -> dict[str, bytes]:
        """Cache namespace name -> its key prefix (see :meth:`add_request`)."""
        return self.request_table.cache_namespaces

    def cache_namespace_prefix(self, name: str) -> bytes:
        """The key prefix of a cache namespace, assigned on first use."""
        return self.request_table.namespace_prefix(name)

    def update_request(
        self,
        request_id: str,
        *,
        num_computed_tokens: int | None = None,
        append_token_ids: Sequence[int] = (),
        append_block_hashes: Sequence[bytes] = (),
        num_prompt_tokens: int | None = None,
    ) -> None:
        """Report the scheduler's progress: computed tokens, then appended tokens.

        ``append_block_hashes`` are the hashes of blocks the appended tokens completed.
        Only the delta is checked, so a decode step costs O(1) whatever the request's
        length.

        ``num_prompt_tokens`` (vllm-0.33 pools): the request's prompt length once the
        tokens are appended, when it moved: vLLM 0.33's cut of a waiting streaming-input
        session makes every token it keeps, and the next chunk's, part of the prompt
        (``Scheduler._update_request_as_session`` sets ``num_prompt_tokens`` to the
        session's new length). The replay boundary of sparse sliding-window and mamba
        retention follows it. Equal to the request's own: nothing to do.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: counts, tokens or hashes that do not fit; a prompt
                length past the request's tokens once the update is applied.
            FailedPreconditionError: a prompt length that moves on a vllm-0.16 pool (vLLM
                0.16 has no streaming sessions), that shrinks (vLLM's only grows), or
                that moves below the computed tokens the update sets. Nothing changed.
        """
        if num_prompt_tokens is None:
            self._update(request_id, num_computed_tokens, append_token_ids, append_block_hashes)
            return
        req = self._get(request_id)
        if num_prompt_tokens != req.num_prompt_tokens:
            computed = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
            self._check_prompt_move(req, num_prompt_tokens, computed, req.num_tokens + len(append_token_ids))
        self._update(request_id, num_computed_tokens, append_token_ids, append_block_hashes)
        req.num_prompt_tokens = num_prompt_tokens

    def _check_prompt_move(
        self, req: Request, num_prompt_tokens: int, computed: int, num_tokens: int
    ) -> None:
        """Refuse a prompt length :meth:`update_request` cannot move the request to (its
        ``computed`` and ``num_tokens`` are those the update leaves)."""
        rid = req.request_id
        check_count(num_prompt_tokens, "num_prompt_tokens")
        self._require_033(f"request {rid!r}: a prompt length that moves (num_prompt_tokens)")
        if num_prompt_tokens < req.num_prompt_tokens:
            raise FailedPreconditionError(
                f"request {rid!r}: num_prompt_tokens {num_prompt_tokens} is below its prompt's "
                f"{req.num_prompt_tokens} tokens (a prompt only grows: vLLM's streaming-input cut)"
            )
        if num_prompt_tokens > num_tokens:
            raise InvalidArgumentError(
                f"request {rid!r}: num_prompt_tokens {num_prompt_tokens} is past its {num_tokens} tokens"
            )
        if num_prompt_tokens < computed:
            raise FailedPreconditionError(
                f"request {rid!r}: num_prompt_tokens {num_prompt_tokens} is below its {computed} computed "
                "tokens (vLLM's cut makes the whole session its prompt: never fewer than it computed)"
            )

    def checkpoint_request(self, request_id: str) -> RequestCheckpoint | None:
        """What :meth:`restore_request` needs to undo later request updates
        (``None`` for an unknown id, meaning "undo = forget it")."""
        return self.request_table.checkpoint(request_id)

    def restore_request(self, request_id: str, checkpoint: RequestCheckpoint | None) -> None:
        """Undo :meth:`add_request` / :meth:`update_request` calls made since ``checkpoint``.

        Only valid while no pool operation has run for the request in between (the
        service uses it when the operation that followed a request update failed).

        Raises:
            FailedPreconditionError: ``checkpoint`` is ``None`` (forget the request)
                but the request holds blocks.
        """
        if checkpoint is not None:
            self.request_table.restore(request_id, checkpoint)
            return
        if request_id not in self.requests:
            return
        if any(self.coordinator.get_blocks(request_id)):
            raise FailedPreconditionError(f"request {request_id!r} holds blocks; cannot forget it")
        self.coordinator.free(request_id)
        del self.requests[request_id]

    def rewind_request(
        self, request_id: str, num_tokens: int, num_computed_tokens: int | None = None
    ) -> RequestRewind:
        """Cut the request's record back as vLLM 0.33 cuts a waiting streaming-input
        session (``Scheduler._update_request_as_session``: its last sampled token is
        discarded when the next input chunk arrives): its tokens past ``num_tokens``
        and its block hashes from ``num_tokens // hash_block_size`` on are dropped; its
        blocks and computed count stay. The tokens and hashes that follow are appended
        by :meth:`update_request` as usual. Returns what was dropped, for
        :meth:`unrewind_request`.

        ``num_computed_tokens``: the computed count the request has once the caller's
        update is applied (default: its current one).

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: ``num_tokens`` not a count, or past the request's tokens.
            FailedPreconditionError: ``num_tokens`` below the computed count (those
                positions' KV is written: a token there cannot change), or a dropped hash
                is one of a block cached for the request (the block would stay in the
                cache under the dropped token's hash).
        """
        req = self._get(request_id)
        have = len(req.all_token_ids)
        if not check_count(num_tokens, "rewind num_tokens") <= have:
            raise InvalidArgumentError(
                f"request {request_id!r}: a rewind to {num_tokens} tokens, but it holds {have}"
            )
        computed = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if num_tokens < computed:
            raise FailedPreconditionError(
                f"request {request_id!r}: a rewind to {num_tokens} tokens, below its {computed} computed "
                "tokens (their KV is written: a computed token never changes)"
            )
        hbs = self.hash_block_size
        keep_hashes = min(len(req.block_hashes), num_tokens // hbs)
        for m in self.managers:
            cached = m.num_cached_block.get(request_id, 0)
            if cached * m.block_size > keep_hashes * hbs:
                raise FailedPreconditionError(
                    f"request {request_id!r}: a rewind to {num_tokens} tokens drops the hash of a block "
                    f"cached for it (group {m.group_id}: {cached} blocks of {m.block_size} cached; "
                    f"{keep_hashes} hashes of {hbs} tokens kept)"
                )
        rewind = RequestRewind(
            num_tokens,
            keep_hashes,
            tuple(req.all_token_ids[num_tokens:]),
            tuple(req.block_hashes[keep_hashes:]),
        )
        # A new list, not the old one cut in place: a registration's list may be one its
        # maker still reads its first tokens from (a client's HandedTokenIds, written
        # into its message later); rewinds are rare, the copy is theirs alone.
        req.all_token_ids = req.all_token_ids[:num_tokens]
        del req.block_hashes[keep_hashes:]
        return rewind

    def unrewind_request(self, request_id: str, rewind: RequestRewind) -> None:
        """Undo :meth:`rewind_request` (and the updates made since, which only append):
        the request's tokens and hashes as they were before it. Only valid while no
        pool operation has run for the request in between. A no-op for an unknown id."""
        req = self.requests.get(request_id)
        if req is None:
            return
        del req.all_token_ids[rewind.num_tokens :]
        del req.block_hashes[rewind.num_block_hashes :]
        req.all_token_ids += rewind.dropped_token_ids
        req.block_hashes += rewind.dropped_block_hashes

    def update_rewound(
        self,
        request_id: str,
        num_tokens: int,
        num_computed_tokens: int | None,
        append_token_ids: Sequence[int],
        append_block_hashes: Sequence[bytes],
        num_prompt_tokens: int | None = None,
    ) -> Callable[[], None]:
        """A rewinding sync's update, as the server and the predicting client's mirror both
        apply it: :meth:`rewind_request` to ``num_tokens`` (checked against the computed
        count the update sets), then :meth:`update_request` (with the session's new
        prompt length when it moved); refused with nothing changed. Returns how to undo
        all of it (valid while no pool operation ran for the request).

        Raises:
            as :meth:`rewind_request` and :meth:`update_request`.
        """
        checkpoint = self.checkpoint_request(request_id)
        rewind = self.rewind_request(request_id, num_tokens, num_computed_tokens)
        try:
            self.update_request(
                request_id,
                num_computed_tokens=num_computed_tokens,
                append_token_ids=append_token_ids,
                append_block_hashes=append_block_hashes,
                num_prompt_tokens=num_prompt_tokens,
            )
        except BaseException:
            self.unrewind_request(request_id, rewind)
            raise

        def undo() -> None:
            self.unrewind_request(request_id, rewind)
            self.restore_request(request_id, checkpoint)

        return undo

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def get_request(self, request_id: str) -> Request:
        """The request's state (read it, do not change it).

        Raises:
            RequestNotFoundError: unknown id.
        """
        return self._get(request_id)

    def free(
        self, request_id: str, all_groups_reversed: bool = False, uncomputed_from: int | None = None
    ) -> None:
        """Release the request's blocks (tail first, group order) and forget it.

        ``all_groups_reversed`` (vllm-0.33 only): the order of vLLM 0.33's deferred
        free (``pop_blocks_for_free`` then ``block_pool.free_blocks(reversed(...))``, a
        KV-consumer connector with overlapping steps): all groups' blocks concatenated
        in group order (each group's leading nulls left out), released in one reversed
        pass. The same as the plain order for one group. A mamba group drops its
        per-request state as its plain free does; its pending boundary-state hand-offs
        were dropped when vLLM took the blocks (:meth:`drop_boundary_state_offloads`).

        ``uncomputed_from``: an undone step's free (the client undid a scheduler step
        an outage cut short, which the worker never ran): before the blocks are
        released, the cache entries of those holding any position at or past this
        token are dropped, as :meth:`evict_blocks` drops them (BlockRemoved events
        included). The step's allocation cached the hashes of the full blocks it was
        to compute; their KV was never written, and a later hit would read garbage.

        Raises:
            RequestNotFoundError: unknown request.
            FailedPreconditionError: ``all_groups_reversed`` on a vllm-0.16 pool, or with a
                group whose free has a rule of its own (fine-grained hits' copy-on-write
                managers: their tails are not dropped at the take).
        """
        if all_groups_reversed:
            self._require_033("a deferred free (all_groups_reversed)")
            if any(type(m).free is not SingleTypeKVCacheManager.free for m in self.managers):
                raise FailedPreconditionError(
                    "a deferred free (all_groups_reversed) needs every group to free by the base "
                    "rule or mamba's (not fine-grained hits' copy-on-write managers)"
                )
        if self.requests.pop(request_id, None) is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if uncomputed_from is not None:
            self._drop_uncomputed(request_id, uncomputed_from)
        if all_groups_reversed and len(self.managers) > 1:
            self.coordinator.free_all_groups_reversed(request_id)
            return
        self._release(request_id)

    def drop_uncomputed(self, request_id: str, uncomputed_from: int) -> None:
        """An undone step's deferred free, at the take (vLLM 0.33's
        ``pop_blocks_for_free``, a KV-consumer connector with overlapping steps): the
        cache entries of the request's blocks holding any position at or past token
        ``uncomputed_from`` are dropped now, as :meth:`free` drops them with
        ``uncomputed_from``, so that no lookup before the deferred free hits them; the
        blocks stay held.

        Raises:
            RequestNotFoundError: unknown request.
        """
        self._get(request_id)
        self._drop_uncomputed(request_id, uncomputed_from)

    def free_abandoned(
        self, request_id: str, drop_reserved: bool = True, reserved: Mapping[int, int] | None = None
    ) -> None:
        """Free a request its worker abandoned (its session ended holding it: a detach,
        a lease that ran out, a restored server's void sessions), whose KV may never
        have been written where the pool's cache says: its last allocation cached the
        hashes of the blocks its worker was to compute, and a worker that stopped with
        a step in flight (asynchronous scheduling: two) never wrote them.

        Before the blocks are released, the cache entries of those no other request
        holds are dropped (BlockRemoved told, as :meth:`evict_blocks` drops them). A
        block another live request holds stays cached: that request hit it and reads it
        as computed (a hit on a block another engine has yet to compute is the race the
        engines sharing a pool must rule out themselves).
        Blocks two requests of one ending session share are dropped with the last one
        freed. A router's reservation reads nothing: a block only reservations hold
        besides this request is dropped too (``drop_reserved``; else it stayed cached,
        and the request adopting the reservation was handed KV nobody wrote; False
        replays a journal written before that rule). The price is cache (a
        continuation of the abandoned requests computes their blocks again, a
        reservation's request gets a shorter hit), never a block: block ids and free
        counts are as :meth:`free` leaves them.

        ``reserved``: the reservations' :meth:`held_blocks` as they are now, computed by
        a caller freeing several requests at once (a session's end: computed here per
        request, it cost every request a pass over every reservation's blocks).

        Raises:
            RequestNotFoundError: unknown request.
        """
        self._get(request_id)
        null = self.block_pool.null_block
        if not drop_reserved:
            reserved = {}
        elif reserved is None:
            reserved = self.reservations.held_blocks() if self.reservations.live else {}
        # (no live request holds a block evicted here once it is freed: the invariants
        # stay whole, unlike after evict_blocks)
        self.block_pool.evict_blocks([
            b.block_id
            for m in self.managers
            for b in m.req_to_blocks.get(request_id) or ()
            if b is not null and b.ref_cnt - reserved.get(b.block_id, 0) == 1
        ])  # fmt: skip
        self.free(request_id)

    def _drop_uncomputed(self, request_id: str, uncomputed_from: int) -> None:
        """Drop the cache entries of the request's blocks from table index
        ``uncomputed_from // block_size`` on, per group (the null block skipped): the
        blocks holding a position at or past token ``uncomputed_from``."""
        null = self.block_pool.null_block
        ids = [
            b.block_id
            for m in self.managers
            for b in (m.req_to_blocks.get(request_id) or ())[uncomputed_from // m.block_size :]
            if b is not null
        ]
        if ids:
            self.evict_blocks_called = True  # (the invariants' flag, as evict_blocks sets it)
            self.block_pool.evict_blocks(ids)

    def preempt(self, request_id: str) -> None:
        """Release the request's blocks but keep it: computed tokens go back to 0 and its
        later lookups count as preempted."""
        req = self._get(request_id)
        self._release(request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def _release(self, request_id: str) -> None:
        """The coordinator's ``free``, fused for managers that free by the base rule: each
        group's list goes to the free queue tail first, group order."""
        if self._fused_free is None:
            self.coordinator.free(request_id)
            return
        bp = self.block_pool
        null = bp.null_block
        freed = 0
        if bp.prepend_unhashed_frees:
            split = bp.free_block_queue.release_split
            caching = self.enable_caching
            for m, may_hold_null in self._fused_free:
                blocks = m.req_to_blocks.pop(request_id, None)
                if blocks:
                    freed += split(reversed(blocks), null if may_hold_null else None, caching)
                m.num_cached_block.pop(request_id, None)
            bp.num_freed += freed
            return
        release = bp.free_block_queue.release
        for m, may_hold_null in self._fused_free:
            blocks = m.req_to_blocks.pop(request_id, None)
            if blocks:
                freed += release(reversed(blocks), null if may_hold_null else None)
            m.num_cached_block.pop(request_id, None)
        bp.num_freed += freed
