"""A pool's allocations, as a Step applies them: AllocateOp (general, plain, in slices),
AllocateRunOp and DecodeOp (a decode step's allocations in columns), AdmitOp (a
scheduler's waiting loop), each adopting a reservation of its prompt when one is live.
A part of :class:`~.pool_service.PoolService` (its ``allocations``), run by its Step
(pool_steps.py); request syncs and ownership are pool_requests.py's."""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from typing import Any

from kvcoord.engine import RequestCheckpoint, StaleCacheHitError
from kvcoord.engine.results import BlockIds

from . import operations as op
from .errors import ErrorReason, ServiceError, Status, as_service_error
from .pool_core import PoolCore
from .pool_requests import RequestSyncs
from .pool_reservations import PoolReservations
from .pool_types import drain
from .sessions import Session

#: an Allocate of at least this many new tokens, in a Step applied in slices, takes its
#: blocks in slices too (the pool held: pool_locks.py)
SLICED_ALLOCATE_TOKENS = 4096
#: blocks taken or cached between two yields of such an Allocate
ALLOCATE_SLICE_BLOCKS = 256
#: a DecodeOp of more entries, in a Step applied in slices, is applied in slices of as
#: many (about 2 ms: a decode step's entry takes 3-4 µs); a shorter one at once
DECODE_SLICE_ENTRIES = 512

#: the checks of a run that has none
_NO_CHECKS = op.RunChecks((), (), (), (), (), ())


class PoolAllocations:
    """The allocating operations of one pool's Steps."""

    def __init__(self, pool: PoolCore, syncs: RequestSyncs, reserving: PoolReservations) -> None:
        self.pool = pool
        self.syncs = syncs
        self.reserving = reserving

    def allocate_adopting(self, s: Session, o: op.Allocate) -> op.Value:
        """:meth:`allocate`; a request's first allocation then adopts the oldest
        reservation made for its prompt (the pool is vLLM's exactly while none is live)."""
        engine = self.pool.engine
        if not engine.reservations.live:
            return self.allocate_plain(s, o) if o.plain else self.allocate(s, o)
        rid = o.sync.request_id
        first = not (rid in engine.requests and any(m.req_to_blocks.get(rid) for m in engine.managers))
        value = self.allocate(s, o)
        if first and isinstance(value, op.AllocateOutcome) and value.new_block_ids is not None:
            got = value.hit.num_tokens if value.hit is not None else o.num_new_computed_tokens
            self.reserving.adopt(rid, got)
        return value

    def admit_adopting(self, s: Session, o: op.Admit) -> op.Value:
        """:meth:`admit`; each admitted request then adopts a reservation of its prompt,
        in admission order."""
        if not self.pool.engine.reservations.live:
            return self.admit(s, o)
        value = self.admit(s, o)
        if isinstance(value, op.Admitted):
            for sync, outcome in zip(o.syncs, value.outcomes, strict=False):
                if outcome.new_block_ids is not None:
                    self.reserving.adopt(
                        sync.request_id, outcome.hit.num_tokens if outcome.hit is not None else 0
                    )
        return value

    def allocate(self, s: Session, o: op.Allocate) -> op.Value:
        engine = self.pool.engine
        rid = o.sync.request_id
        undo = self._allocate_begins(s, o)
        try:
            if o.lookup:
                res = engine.allocate_slots_with_lookup(
                    rid,
                    o.num_new_tokens,
                    o.num_lookahead_tokens,
                    o.num_external_computed_tokens,
                    o.delay_cache_blocks,
                    o.num_encoder_tokens,
                    o.full_sequence_must_fit,
                    o.reserved_blocks,
                    o.num_in_flight_tokens,
                    o.watermark_blocks,
                    o.skip_zeroing_group_ids,
                )
                if res.new_block_ids is None and o.must_succeed:
                    raise self.prediction_failed(rid)
                table = (
                    engine.get_block_ids(rid) if o.return_table and res.new_block_ids is not None else None
                )
                return op.AllocateOutcome(res.new_block_ids, res.num_new_tokens, res.hit, table=table)
            new = engine.allocate_slots(rid, *allocate_args(o))
            if new is None and o.must_succeed:
                raise self.prediction_failed(rid)
        except Exception as exc:
            return self._allocate_failed(exc, undo, o)
        return self._allocate_granted(new, o)

    def sliceable(self, o: op.Allocate) -> bool:
        """Whether an Allocate of a Step applied in slices takes its blocks in slices
        too (:meth:`allocating`): a large one without lookup, no reservation live
        (a first allocation may adopt one: :meth:`allocate_adopting`)."""
        return (
            not o.lookup
            and type(o.num_new_tokens) is int
            and o.num_new_tokens >= SLICED_ALLOCATE_TOKENS
            and not self.pool.engine.reservations.live
        )

    def allocating(self, s: Session, o: op.Allocate, every: int) -> Generator[None, None, op.Value]:
        """:meth:`allocate` without lookup, the engine taking and caching the blocks
        ``every`` at a time (yielding between slices, after every check that can
        refuse: engine.KVCachePool.allocating_slots); the same outcome and pool."""
        rid = o.sync.request_id
        undo = self._allocate_begins(s, o)
        try:
            new = yield from self.pool.engine.allocating_slots(every, rid, *allocate_args(o))
            if new is None and o.must_succeed:
                raise self.prediction_failed(rid)
        except Exception as exc:
            return self._allocate_failed(exc, undo, o)
        return self._allocate_granted(new, o)

    def _allocate_begins(self, s: Session, o: op.Allocate) -> Callable[[], None]:
        """An Allocate's checks and request sync; returns what undoes the sync."""
        if o.must_refuse and (o.must_succeed or o.lookup):
            raise ServiceError(Status.INVALID, "must_refuse cannot be combined with must_succeed or lookup")
        return self.syncs.sync(s, o.sync)

    def _allocate_failed(self, exc: Exception, undo: Callable[[], None], o: op.Allocate) -> op.Value:
        """An Allocate whose engine call raised ``exc``: the sync undone, the error
        raised again, except a stale hit."""
        undo()
        if not isinstance(exc, StaleCacheHitError):
            raise exc
        # A concurrency conflict, not bad input: an outcome with nothing changed
        # (the request sync that came with it is undone too) -- unless the client
        # already answered it as a success.
        if o.must_succeed:
            raise self.prediction_failed(o.sync.request_id) from None
        return op.AllocateOutcome(None, o.num_new_tokens, stale_hit=True)

    def _allocate_granted(self, new: BlockIds | None, o: op.Allocate) -> op.Value:
        """The outcome of an Allocate the engine answered ``new``."""
        engine = self.pool.engine
        rid = o.sync.request_id
        if new is not None and o.must_refuse:
            # Applied (its blocks stay with the request until the client frees it).
            raise ServiceError(
                Status.PRECONDITION,
                f"request {rid[:128]!r}: the pool granted an allocation the client had already answered "
                f"as refused ({engine.num_free_blocks} blocks free after it); its count of free blocks "
                "was wrong, treat the requests of this Step as lost and report this as a bug",
                ErrorReason.PREDICTION_FAILED,
            )
        table = engine.get_block_ids(rid) if o.return_table and new is not None else None
        return op.AllocateOutcome(new, o.num_new_tokens, table=table)

    def allocate_plain(self, s: Session, o: op.Allocate) -> op.Value:
        """:meth:`allocate` for a plain allocation (``o.plain``: a decode step's): the
        request's update and its allocation in one engine call, without the general
        path's undo. Anything the general path would refuse or treat otherwise (not
        this session's request, another position, nothing to update) goes to it."""
        sync = o.sync
        rid = sync.request_id
        req = self.pool.engine.requests.get(rid)
        if (
            self.pool.owners.get(rid) is not s
            or req is None
            or len(req.all_token_ids) != sync.base_num_tokens
            or len(req.block_hashes) != sync.base_num_hashes
            or not sync.append_token_ids
            or sync.rewind_num_tokens is not None
            or sync.num_prompt_tokens is not None
        ):
            return self.allocate(s, o)
        # A refused update changes nothing; an allocation that raises takes the update
        # back (as allocate's undo does); a refusal (None) keeps the update, as there.
        new = self.pool.engine.update_and_allocate(
            rid, sync.num_computed_tokens, sync.append_token_ids, sync.append_block_hashes, o.num_new_tokens
        )
        return op.AllocateOutcome(new, o.num_new_tokens)

    def allocate_run(self, s: Session, o: op.AllocateRun) -> op.Value:
        """Each entry as an AllocateOp with its sync and must_succeed, in order."""
        n = len(o.request_ids)
        columns = (o.base_num_tokens, o.base_num_hashes, o.num_computed_tokens, o.num_new_tokens,
                   o.num_lookahead_tokens, o.num_append_tokens, o.num_append_hashes)  # fmt: skip
        if any(len(c) != n for c in columns):
            raise ServiceError(Status.INVALID, "allocate_run: every column needs one value per entry")
        if sum(o.num_append_tokens) != len(o.append_token_ids) or sum(o.num_append_hashes) != len(
            o.append_block_hashes
        ):
            raise ServiceError(
                Status.INVALID,
                "allocate_run: num_append_tokens / num_append_hashes do not add up to the appended values",
            )
        engine = self.pool.engine
        requests = engine.requests
        tokens, hashes = o.append_token_ids, o.append_block_hashes
        groups = len(engine.managers)
        counts = [0] * (n * groups)  # an entry taking no block (most) leaves its zeros
        new_ids: list[int] = []
        checks = o.checks or _NO_CHECKS
        check_at = self._check_positions(checks, n)
        mine = self.syncs.owned_prefix(s, o.request_ids)
        i = t = h = c = 0
        while i < n:
            while c < len(check_at) and check_at[c] == i:
                self._check_unchanged(s, checks, c)
                c += 1
            stop = min(mine, check_at[c] if c < len(check_at) else n)
            if i < stop:
                # plain decode steps up to the next check, in one engine call; entry i
                # is the first it left (untouched) for the one-by-one path below
                i, t, h = engine.decode_run(o, i, stop, t, h, counts, new_ids)
                if i == stop:
                    continue
            rid = o.request_ids[i]
            nt, nh = o.num_append_tokens[i], o.num_append_hashes[i]
            base_t, base_h = o.base_num_tokens[i], o.base_num_hashes[i]
            req = requests.get(rid)
            if i >= mine or req is None or req.num_tokens != base_t or len(req.block_hashes) != base_h:
                # not this session's, or not at that position: the general path says which
                self.syncs.sync(s, op.RequestSync(rid, (), (), False, base_t, base_h))
                raise AssertionError(f"request {rid!r} passed the checks it failed")  # pragma: no cover
            before = (req.num_tokens, len(req.block_hashes), req.num_computed_tokens)
            engine.update_request(rid, num_computed_tokens=o.num_computed_tokens[i],
                                  append_token_ids=tokens[t : t + nt], append_block_hashes=hashes[h : h + nh])  # fmt: skip
            t += nt
            h += nh
            try:
                new = engine.allocate_slots(rid, o.num_new_tokens[i], 0, None, o.num_lookahead_tokens[i])
                if new is None:
                    raise self.prediction_failed(rid)
            except Exception:
                engine.restore_request(rid, RequestCheckpoint(*before))
                raise
            for g, group in enumerate(new):
                if group:
                    counts[i * groups + g] = len(group)
                    new_ids += group
            i += 1
        while c < len(check_at):
            self._check_unchanged(s, checks, c)
            c += 1
        return op.RunOutcome(counts, new_ids)

    @staticmethod
    def _check_positions(checks: op.RunChecks, n: int) -> Sequence[int]:
        """The checks' positions, once every column has one value per check and the
        positions go from 0 to ``n`` without going back."""
        m = len(checks.request_ids)
        if not m and not checks.at:
            return ()
        columns = (checks.at, checks.num_computed_tokens, checks.num_new_tokens, checks.num_lookahead_tokens,
                   checks.num_tokens)  # fmt: skip
        if any(len(col) != m for col in columns):
            raise ServiceError(
                Status.INVALID,
                "allocate_run: every check_* column needs one value per check",
            )
        at = checks.at
        if m and (at[-1] > n or any(a > b for a, b in zip(at, at[1:], strict=False))):
            raise ServiceError(
                Status.INVALID,
                f"allocate_run: check_at must not decrease and be at most the number of entries ({n})",
            )
        return at

    def _check_unchanged(self, s: Session, checks: op.RunChecks, j: int) -> None:
        """Check j of a run: the allocation the client answered as changing nothing would
        indeed change nothing."""
        rid = checks.request_ids[j]
        self.syncs.check_owned(s, rid)
        if not self.pool.engine.allocation_changes_nothing(
            rid, checks.num_computed_tokens[j], checks.num_new_tokens[j], checks.num_lookahead_tokens[j],
            checks.num_tokens[j],
        ):  # fmt: skip
            raise self.prediction_failed(
                rid, "an allocation the client had already answered as changing nothing would take, cache or "
                "free blocks"
            )  # fmt: skip

    def decode(self, s: Session, o: op.Decode) -> op.Value:
        """:meth:`decoding` at once (a Step's DecodeOp of up to DECODE_SLICE_ENTRIES entries)."""
        return drain(self.decoding(s, o, 0))

    def decoding(self, s: Session, o: op.Decode, every: int) -> Generator[None, None, op.Value]:
        """A DecodeOp, yielding after every ``every`` entries applied (0: never; the pool
        is held between slices: pool_locks.py; 65,536 entries at once held the event
        loop 220-230 ms). A decode step's allocations in columns, each entry answered, and
        leaving the pool, exactly as its AllocateOp would in the same Step. An entry of
        this session's request at its position with tokens to append, while no
        reservation is live, takes the engine's fused update-and-allocate (as
        :meth:`allocate_plain`); any other entry is built into its Allocate and applied
        by the Allocate handler, which says what is wrong with it. The first entry that
        fails fails the operation with its own error (op.DecodeFailed, carrying the
        entries before it, which stay applied).

        Raises:
            ServiceError: INVALID_ARGUMENT (nothing applied) when the columns do not have
                one value per entry or the appended values do not add up;
                :class:`~.operations.DecodeFailed` when an entry fails.
        """
        rids = o.request_ids
        n = len(rids)
        base_t, base_h, computed = o.base_num_tokens, o.base_num_hashes, o.num_computed_tokens
        new_tokens, look, num_t, num_h = (
            o.num_new_tokens,
            o.num_lookahead_tokens,
            o.num_append_tokens,
            o.num_append_hashes,
        )
        if set(map(len, (base_t, base_h, computed, new_tokens, look, num_t, num_h))) != {n}:
            raise ServiceError(Status.INVALID, "decode: every column needs one value per entry")
        tokens, hashes = o.append_token_ids, o.append_block_hashes
        if sum(num_t) != len(tokens) or sum(num_h) != len(hashes):
            raise ServiceError(
                Status.INVALID,
                "decode: num_append_tokens / num_append_hashes do not add up to the appended values",
            )
        engine = self.pool.engine
        must = o.must_succeed
        groups = len(engine.managers)
        counts = [0] * (n * groups)  # an entry taking no block (most) leaves its zeros
        ids: list[int] = []
        refused: list[int] = []
        # Entries of this session's requests, up to the first that is not (it fails and
        # stops the operation), take the engine's fused paths; none while a reservation is
        # live (a first allocation may adopt one: the handler's).
        mine = 0 if engine.reservations.live else self.syncs.owned_prefix(s, rids)
        requests = engine.requests
        run = engine.decode_run
        i = t = h = 0
        while i < n:
            if i < mine:
                # the run of plain decode steps, in one engine call; entry i is the first
                # it left (untouched) for the one-by-one path below
                stop = min(mine, i + every) if every else mine
                i, t, h = run(o, i, stop, t, h, counts, ids)
                if i == n:
                    break
                if i == stop < mine:  # (every entry of the slice applied)
                    yield
                    continue
            rid, bt, bh, c, nn, la, nt, nh = (
                rids[i], base_t[i], base_h[i], computed[i], new_tokens[i], look[i], num_t[i], num_h[i]
            )  # fmt: skip
            tk, hs = tokens[t : t + nt], hashes[h : h + nh]
            t += nt
            h += nh
            try:
                req = requests.get(rid)
                if (
                    i < mine
                    and nt
                    and req is not None
                    and len(req.all_token_ids) == bt
                    and len(req.block_hashes) == bh
                ):
                    before = RequestCheckpoint(bt, bh, req.num_computed_tokens)
                    new = engine.update_and_allocate(rid, c, tk, hs, nn, la)
                    if new is None and must:  # as the Allocate handler: the sync undone, then the error
                        engine.restore_request(rid, before)
                        raise self.prediction_failed(rid)
                else:
                    sync = op.RequestSync(rid, tk, hs, False, bt, bh, c)
                    value = self.allocate_adopting(
                        s, op.Allocate(sync, nn, num_lookahead_tokens=la, must_succeed=must)
                    )
                    assert isinstance(value, op.AllocateOutcome)
                    new = value.new_block_ids
            except Exception as exc:  # noqa: BLE001 - every failure is the entry's answer
                raise op.DecodeFailed(
                    as_service_error(exc), op.DecodeOutcome(i, counts[: i * groups], ids, refused)
                ) from exc
            if new is None:
                refused.append(i)
            else:
                for g, group in enumerate(new):
                    if group:
                        counts[i * groups + g] = len(group)
                        ids += group
            i += 1
            if every and not i % every:
                yield
        return op.DecodeOutcome(n, counts, ids, refused)

    def prediction_failed(self, rid: str, what: str = "") -> ServiceError:
        what = what or (
            f"the pool refused an allocation the client had already answered as successful "
            f"({self.pool.engine.num_free_blocks} blocks free); its bound was wrong"
        )
        return ServiceError(
            Status.PRECONDITION,
            f"request {rid[:128]!r}: {what}, treat the requests of this Step as lost and report this as a bug",
            ErrorReason.PREDICTION_FAILED,
        )

    def admit(self, s: Session, o: op.Admit) -> op.Value:
        """Lookup then allocate each request in order, as a scheduler's waiting loop
        does, until the budget is spent or the pool refuses one."""
        if o.token_budget < 0 or o.num_lookahead_tokens < 0:
            raise ServiceError(Status.INVALID, "token_budget and num_lookahead_tokens must be >= 0")
        engine = self.pool.engine
        budget = o.token_budget
        out: list[op.AllocateOutcome] = []
        for sync in o.syncs:
            if budget <= 0:
                break
            try:
                undo = self.syncs.sync(s, sync)
            except Exception:
                if out:
                    break  # stop before it (see below)
                raise
            rid = sync.request_id
            try:
                hit = engine.get_computed_blocks(rid)
                n = min(engine.requests[rid].num_tokens - hit.num_tokens, budget)
                new = engine.allocate_slots(
                    rid, n, hit.num_tokens, None if hit.is_empty else hit, o.num_lookahead_tokens
                )
            except Exception:
                undo()
                if out:
                    # Stop before the failing request (nothing of it applied): the
                    # admitted ones stand, and it fails on its own at the next admit.
                    break
                raise
            out.append(op.AllocateOutcome(new, n, hit))
            if new is None:
                break
            budget -= n
        return op.Admitted(out)


def allocate_args(o: op.Allocate) -> tuple[Any, ...]:
    """An Allocate's arguments to ``KVCachePool.allocate_slots`` after the request id, in
    its order: written once for the call made at once and the one made in slices (the
    two once carried different fields)."""
    return (
        o.num_new_tokens,
        o.num_new_computed_tokens,
        o.new_computed_blocks,
        o.num_lookahead_tokens,
        o.num_external_computed_tokens,
        o.delay_cache_blocks,
        o.num_encoder_tokens,
        o.full_sequence_must_fit,
        o.reserved_blocks,
        o.num_in_flight_tokens,
        o.watermark_blocks,
        o.skip_zeroing_group_ids,
    )
