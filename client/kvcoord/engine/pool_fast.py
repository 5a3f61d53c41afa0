"""The fused fast paths: the common allocations answered in one pass per phase.

An allocation without a hit in a pool whose managers all allocate and cache by the base
rules (:meth:`FastPaths._allocate_without_hit`, and sliced: :meth:`FastPaths.allocating_slots`),
a running request's update and allocation in one call, and a decode step inside its
blocks answered without either (:meth:`FastPaths._decode_inside_blocks`, and a run of
them: :mod:`~kvcoord.engine.decode_run`). Each gives exactly the general path's state
and answer; anything else goes to the general path.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence

from .decode_run import DecodeColumns, decode_run, grow_entry, plain_values
from .errors import RequestNotFoundError
from .pool_lookups import PoolLookups
from .request import Request
from .request_table import TokenIds
from .results import BlockIds, CacheHit, RequestCheckpoint

#: The token sequences the decode fast path reads (anything else takes the general path).
_TOKEN_LISTS = (list, TokenIds, tuple)


class FastPaths(PoolLookups):
    """:class:`~kvcoord.engine.pool.KVCachePool`'s fused paths."""

    #: the general allocation (:class:`~kvcoord.engine.pool.KVCachePool`)
    allocate_slots: Callable[..., BlockIds | None]

    def _plain_call(
        self, req: Request, num_new_tokens: int, num_new_computed_tokens: int, num_lookahead_tokens: int,
        num_external_computed_tokens: int, delay_cache_blocks: bool, num_encoder_tokens: int,
        full_sequence_must_fit: bool, reserved_blocks: int, num_in_flight_tokens: int, watermark_blocks: int,
    ) -> bool:  # fmt: skip
        """Whether an ``allocate_slots`` call without a hit is the common one
        (:meth:`_allocate_without_hit`): valid counts, no external, encoder or in-flight
        tokens, cached as usual, within ``max_model_len``, plain managers."""
        return (
            self._plain_managers
            and type(num_new_tokens) is int
            and num_new_tokens > 0
            and type(num_lookahead_tokens) is int
            and num_lookahead_tokens >= 0
            and num_new_computed_tokens == 0
            and num_external_computed_tokens == 0
            and num_encoder_tokens == 0
            and type(num_new_computed_tokens) is int
            and type(num_external_computed_tokens) is int
            and type(num_encoder_tokens) is int
            and delay_cache_blocks is False
            and full_sequence_must_fit is False
            and reserved_blocks == 0
            and num_in_flight_tokens == 0
            and watermark_blocks == 0
            and req.num_computed_tokens + num_new_tokens <= self.max_model_len
        )

    def allocating_slots(
        self,
        every: int,
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
    ) -> Generator[None, None, BlockIds | None]:
        """:meth:`allocate_slots` in slices: a generator that returns its answer and,
        for the common call (no hit, no external, encoder or in-flight tokens: a large
        prompt's first allocation), yields after every ``every`` blocks taken or cached.
        Everything that can refuse or raise (the counts, the free-block check) happens
        before the first yield; nothing after it can fail. Its caller must let nothing
        else touch the pool until it returns; the blocks, the answer and the events are
        then those of one call. Any other call is made at once (no yield).

        Raises:
            As :meth:`allocate_slots`, before the first yield.
        """
        req = self.requests.get(request_id)
        if (
            req is None
            or every <= 0
            or new_computed_blocks is not None
            or skip_zeroing_group_ids
            or not self._plain_call(
                req,
                num_new_tokens,
                num_new_computed_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
                full_sequence_must_fit,
                reserved_blocks,
                num_in_flight_tokens,
                watermark_blocks,
            )  # fmt: skip
        ):
            return self.allocate_slots(
                request_id, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
                num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit,
                reserved_blocks, num_in_flight_tokens, watermark_blocks, skip_zeroing_group_ids,
            )  # fmt: skip
        rid = req.request_id
        total = req.num_computed_tokens
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        for m in self.skipping_managers:
            m.remove_skipped_blocks(rid, total)
        if self.num_to_take(rid, need, total, main) > self.block_pool.free_block_queue.num_free_blocks:
            self.num_refusals += 1
            return None
        # Nothing below can fail: the blocks are taken, then cached, ``every`` at a time.
        bp = self.block_pool
        managers = self.managers
        out: list[tuple[int, ...]] | None = None
        for i, m in enumerate(managers):
            req_blocks = m.req_to_blocks.get(rid)
            if req_blocks is None:
                req_blocks = m.req_to_blocks[rid] = []
            n = -(-need // m.block_size) - len(req_blocks)
            ids: list[int] = []
            while n > 0:
                yield
                new_blocks = bp.get_new_blocks(min(n, every))
                req_blocks += new_blocks
                ids += [b.block_id for b in new_blocks]
                n -= len(new_blocks)
            if ids:
                if out is None:
                    out = [()] * len(managers)
                out[i] = tuple(ids)
        if self.enable_caching:
            num_tokens = len(req.all_token_ids) - self.hash_lag
            cached = main if main < num_tokens else num_tokens
            for m in managers:
                num_full = cached // m.block_size
                num_cached = m.num_cached_block.get(rid, 0)
                if num_cached < num_full:
                    yield from bp.caching_full_blocks(
                        req, m.req_to_blocks[rid], num_cached, num_full, m.block_size, m.group_id, None, every
                    )
                    m.num_cached_block[rid] = num_full
        return self._no_new_blocks if out is None else tuple(out)

    def update_and_allocate(
        self,
        request_id: str,
        num_computed_tokens: int | None,
        append_token_ids: Sequence[int],
        append_block_hashes: Sequence[bytes],
        num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        inside_checked: bool = False,
    ) -> BlockIds | None:
        """:meth:`update_request` then :meth:`allocate_slots` without a hit, in one call
        (a running request's step, above all a decode): the same checks and the same
        answer. A refused update changes nothing; an allocation that raises takes the
        update back with it. A ``None`` answer (too few free blocks) keeps the update,
        as the two calls would. ``num_computed_tokens`` ``None`` leaves the count as it is.
        A decode step inside the request's blocks is answered without either call
        (:meth:`_decode_inside_blocks`: the same state and answer); ``inside_checked``:
        the caller's :meth:`decode_token` of these very values just answered ``None``
        (so that check would fail: it is not made again).

        Raises:
            RequestNotFoundError, InvalidArgumentError, FailedPreconditionError: as the
                two calls raise them.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if (
            self.decode_fast_path
            and not inside_checked
            and self._decode_inside_blocks(
                req,
                num_computed_tokens,
                append_token_ids,
                append_block_hashes,
                num_new_tokens,
                num_lookahead_tokens,
            )
        ):
            return self._no_new_blocks
        before = (len(req.all_token_ids), len(req.block_hashes), req.num_computed_tokens)
        self._update(request_id, num_computed_tokens, append_token_ids, append_block_hashes)
        try:
            if (
                self._plain_managers
                and type(num_new_tokens) is int
                and num_new_tokens > 0
                and type(num_lookahead_tokens) is int
                and num_lookahead_tokens >= 0
                and req.num_computed_tokens + num_new_tokens <= self.max_model_len
            ):
                return self._allocate_without_hit(req, num_new_tokens, num_lookahead_tokens)
            return self.allocate_slots(request_id, num_new_tokens, 0, None, num_lookahead_tokens)
        except BaseException:
            self.request_table.restore(request_id, RequestCheckpoint(*before))
            raise

    def decode_run(
        self, cols: DecodeColumns, start: int, stop: int, t: int, h: int, counts: list[int], ids: list[int]
    ) -> tuple[int, int, int]:
        """Entries ``start .. stop-1`` of a decode step's columns, each applied as
        :meth:`update_and_allocate` would, until the first that is not a plain decode
        step (left untouched, for the general path): see :mod:`.decode_run`."""
        return decode_run(self, cols, start, stop, t, h, counts, ids)

    def _decode_inside_blocks(
        self,
        req: Request,
        num_computed_tokens: int | None,
        append_token_ids: Sequence[int],
        append_block_hashes: Sequence[bytes],
        num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> bool:
        """:meth:`update_and_allocate`'s decode step inside the request's blocks: one
        valid token appended completing no hashed block, valid counts, every group's
        blocks already covering the slots, no block leaving a window and none to cache.
        Then the update is applied and ``True`` returned: the general path would change
        nothing else and answer no new block (no refusal is possible: it takes none).
        Anything else returns ``False`` with nothing changed, for the general path,
        which raises what it raises.

        Only for pools whose groups all allocate and cache by the base rules (the
        caller's ``decode_fast_path``): there the general path is
        :meth:`_allocate_without_hit`, whose every step this checks.
        """
        if type(append_token_ids) not in _TOKEN_LISTS or len(append_token_ids) != 1 or append_block_hashes:
            return False
        if num_computed_tokens is None:
            num_computed_tokens = req.num_computed_tokens
        return (
            self.decode_token(
                req.request_id, num_computed_tokens, append_token_ids[0], num_new_tokens, num_lookahead_tokens
            )
            is not None
        )

    def decode_token(
        self, request_id: str, computed: int, token: int, num_new_tokens: int, num_lookahead_tokens: int
    ) -> BlockIds | None:
        """A decode step inside the request's blocks, its one token given alone:
        ``update_and_allocate(request_id, computed, [token], [], num_new_tokens,
        num_lookahead_tokens)`` when that would append the token, set the computed
        count and answer no new block (what :meth:`_decode_inside_blocks` checks,
        written out for a running request's every step). Then the update is applied
        and that answer returned (the shared empty one); anything else (an unknown
        request, a pool without ``decode_fast_path``, a hash due, a block to take,
        cache or leave a window, values the fast paths do not read) returns ``None``
        with nothing changed, for :meth:`update_and_allocate`. Never raises."""
        req = self.requests.get(request_id)
        if req is None or not self.decode_fast_path:
            return None
        tokens = req.all_token_ids
        have = len(tokens)
        max_len = self.max_model_len
        if (
            have >= max_len  # (the token would pass it)
            or type(token) is not int or token < 0
            or type(computed) is not int or computed < 0
            or type(num_new_tokens) is not int or num_new_tokens <= 0
            or type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0
        ):  # fmt: skip
            return None
        main = computed + num_new_tokens
        if main > max_len:
            return None
        need = main + num_lookahead_tokens
        if need > max_len:
            need = max_len
        caching = self.enable_caching
        cached = 0
        if caching:
            hashed = have + 1 - self.hash_lag
            if (hashed if hashed > 0 else 0) // self.hash_block_size != len(req.block_hashes):
                return None  # a block hash due (or one too many): the general path checks it
            cached = main if main < hashed else hashed
        m = self._lone_manager
        if m is not None:  # (_changes_nothing's checks, written out for one group)
            blocks = m.req_to_blocks.get(request_id)
            size = m.block_size
            if blocks is None or len(blocks) * size < need:
                return None
            if caching and m.num_cached_block.get(request_id, 0) < cached // size:
                return None
        elif not self._changes_nothing(request_id, computed, need, cached):
            return None
        req.num_computed_tokens = computed
        tokens.append(token)
        return self._no_new_blocks

    def decode_step(
        self, request_id: str, computed: int, token: int, block_hash: bytes | None, num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> BlockIds | None:  # fmt: skip
        """A decode step that takes a block or caches one, its one token given alone
        with the hash of the block it completes (``None``: none), in a pool of one group
        that skips no block: ``update_and_allocate(request_id, computed, [token],
        [block_hash] or [], num_new_tokens, num_lookahead_tokens)`` applied as one entry
        of :meth:`decode_run` applies it (the update, the blocks taken, the full ones
        cached: :func:`~.decode_run.grow_entry`), its new block ids per group returned.
        Anything else (another layout, an unknown request or one holding no block,
        values the fast paths do not read, a hash due and not given or given and not
        due, too few free blocks) returns ``None`` with nothing changed, for
        :meth:`update_and_allocate`. Never raises."""
        m = self._lone_manager
        req = self.requests.get(request_id)
        if (
            m is None
            or req is None
            or not self.decode_fast_path
            or not plain_values(1, token, computed, num_new_tokens, num_lookahead_tokens)
        ):
            return None
        have = len(req.all_token_ids)
        max_len = self.max_model_len
        main = computed + num_new_tokens
        if have >= max_len or main > max_len:  # (at max_model_len: the token would pass it)
            return None
        need = main + num_lookahead_tokens
        if need > max_len:
            need = max_len
        given = 0 if block_hash is None else 1
        if self.enable_caching:
            hashed = have + 1 - self.hash_lag
            if (hashed if hashed > 0 else 0) // self.hash_block_size - len(req.block_hashes) != given:
                return None  # a hash due and not given, or given and not due: the general path says so
            cached = main if main < hashed else hashed
        elif given:
            return None  # (hashes are ignored without caching: the general path reads them)
        else:
            cached = 0
        if m.req_to_blocks.get(request_id) is None:
            return None  # (no block yet: a first allocation, the general path's)
        counts = [0]
        ids: list[int] = []
        if not grow_entry(self, req, computed, main, need, cached, token, block_hash, counts, 0, ids):
            return None
        return (tuple(ids),) if ids else self._no_new_blocks

    def _allocate_without_hit(
        self, req: Request, num_new_tokens: int, num_lookahead_tokens: int
    ) -> BlockIds | None:
        """``allocate_slots`` for the common call: no hit, no external or encoder tokens,
        cache as usual, and every group of a type using the base allocation rules.

        The same steps as the general path, fused into one pass per phase: counts are
        valid and within ``max_model_len`` (checked by the caller), adoption is skipped
        (there is nothing to adopt), and a step adding no block returns a shared
        empty answer.
        """
        rid = req.request_id
        total = req.num_computed_tokens
        main = total + num_new_tokens
        need = main + num_lookahead_tokens
        if need > self.max_model_len:
            need = self.max_model_len
        for m in self.skipping_managers:
            m.remove_skipped_blocks(rid, total)
        managers = self.managers
        bp = self.block_pool
        if self.num_to_take(rid, need, total, main) > bp.free_block_queue.num_free_blocks:
            self.num_refusals += 1
            return None
        out: list[tuple[int, ...]] | None = None
        for i, m in enumerate(managers):
            req_blocks = m.req_to_blocks.get(rid)
            if req_blocks is None:
                req_blocks = m.req_to_blocks[rid] = []
            n = -(-need // m.block_size) - len(req_blocks)
            if n > 0:
                new_blocks = bp.get_new_blocks(n)
                req_blocks += new_blocks
                if out is None:
                    out = [()] * len(managers)
                out[i] = tuple([b.block_id for b in new_blocks])
        result = self._no_new_blocks if out is None else tuple(out)
        if self.enable_caching:
            num_tokens = len(req.all_token_ids) - self.hash_lag
            self.cache_full_request_blocks(req, main if main < num_tokens else num_tokens)
        return result

    def cache_full_request_blocks(self, req: Request, cached: int) -> None:
        """Cache every group's full blocks of ``req`` up to ``cached`` tokens (the base
        rule: :meth:`_allocate_without_hit`'s last phase)."""
        rid = req.request_id
        bp = self.block_pool
        for m in self.managers:
            num_full = cached // m.block_size
            num_cached = m.num_cached_block.get(rid, 0)
            if num_cached < num_full:
                bp.cache_full_blocks(
                    req, m.req_to_blocks[rid], num_cached, num_full, m.block_size, m.group_id
                )
                m.num_cached_block[rid] = num_full

    def num_to_take(self, rid: str, need: int, total: int, main: int) -> int:
        """Blocks a call without a hit takes for ``need`` slots (skipped blocks removed)."""
        k = 0
        for m in self.managers:
            if rid in m.num_cached_block:  # admitted: no hit possible, nothing skipped to add
                blocks = m.req_to_blocks.get(rid)
                n = -(-need // m.block_size) - (len(blocks) if blocks is not None else 0)
                if n > 0:
                    k += n
            else:
                k += m.get_num_blocks_to_allocate(rid, need, (), total, main)
        return k

    def allocation_changes_nothing(
        self,
        request_id: str,
        num_computed_tokens: int,
        num_new_tokens: int,
        num_lookahead_tokens: int,
        num_tokens: int,
    ) -> bool:
        """Whether ``allocate_slots(request_id, num_new_tokens, num_lookahead_tokens=...)``,
        made once the request has ``num_computed_tokens`` computed and ``num_tokens``
        tokens, would leave the pool exactly as it is: no hit, no block taken, no block
        newly cached, none leaving a window (a decode step inside its last block). Such
        a call returns no block ids in vLLM and changes none of its manager's state, so
        a client may answer it itself and only have it checked here. Nothing changes.

        ``False`` for anything else, including counts out of range, fewer tokens than the
        pool already has for the request, and pools whose groups do not all allocate by
        the base rules (mamba, cross-attention).

        Raises:
            RequestNotFoundError: unknown request.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if (
            not self._plain_managers
            or type(num_computed_tokens) is not int
            or type(num_new_tokens) is not int
            or type(num_lookahead_tokens) is not int
            or type(num_tokens) is not int
            or num_computed_tokens < 0
            or num_new_tokens <= 0
            or num_lookahead_tokens < 0
            or num_tokens < req.num_tokens
            or num_computed_tokens + num_new_tokens > self.max_model_len
        ):
            return False
        main = num_computed_tokens + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        hashed = num_tokens - self.hash_lag
        cached = main if main < hashed else hashed
        return self._changes_nothing(request_id, num_computed_tokens, need, cached)

    def _changes_nothing(self, request_id: str, num_computed_tokens: int, need: int, cached: int) -> bool:
        """Whether an allocation of a request with ``num_computed_tokens`` computed that
        needs slots for ``need`` tokens and caching up to ``cached`` tokens (used only
        when caching is on) leaves every group as it is: no block leaving a window, every
        group's blocks covering ``need``, every full block up to ``cached`` cached."""
        for m in self.skipping_managers:
            if m.skips_blocks(request_id, num_computed_tokens):
                return False
        caching = self.enable_caching
        for m in self.managers:
            blocks = m.req_to_blocks.get(request_id)
            if blocks is None or len(blocks) * m.block_size < need:
                return False
            if caching and m.num_cached_block.get(request_id, 0) < cached // m.block_size:
                return False
        return True
