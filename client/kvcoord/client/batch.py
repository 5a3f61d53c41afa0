"""Operations collected for one Step: what to send, how to read each answer, and the
:class:`Pending` results the callers hold until the Step is answered.

:class:`StepBatcher` has one explicit method per manager call; each returns a
:class:`Pending`. ``RemoteKVCacheManager`` uses the same builders for its own calls.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import block_ids_to_pb

from . import _requests as rq
from .errors import AbortedError, KVCoordError

if TYPE_CHECKING:
    from .promises import BlockBudget
    from .tracking import RequestTracker


class BatchOwner(Protocol):
    """What the batch builders need of the manager whose Steps carry their calls
    (``RemoteKVCacheManager``): its request positions, its block budget, and one
    public method per thing a batched call tells it (no import of the manager here,
    and nothing private of it used)."""

    tracker: RequestTracker
    budget: BlockBudget
    stale_hits: int

    def freeing(self, request_id: str) -> None: ...
    def caching(self, request: Any, num_computed_tokens: int) -> None: ...
    def skipping(self, request_id: str, total_computed_tokens: int) -> None: ...
    def batched_allocation(self, request_id: str) -> None: ...
    def abandoned(self, request_ids: Iterable[str]) -> None: ...
    def defer(self, item: Item | None) -> None: ...
    def send_items(self, items: list[Item], force: bool = False) -> None: ...
    def clear_hints(self) -> None: ...


__all__ = ["KVCacheBlockIds", "Pending", "StepBatcher"]

T = TypeVar("T")


class Pending(Generic[T]):
    """The result of a batched call, available once its Step was answered.

    Args:
        resolve: called by :meth:`result` while the value is not there yet (the
            manager flushes its queue); ``None``: result() before the flush raises.
    """

    __slots__ = ("_done", "_error", "_value", "resolver")

    def __init__(self, resolve: Callable[[], None] | None = None) -> None:
        self._value: T | None = None
        self._error: KVCoordError | None = None
        self._done = False
        #: called by :meth:`result` while the value is not there (the sender's flush)
        self.resolver = resolve

    def set_result(self, value: T) -> None:
        """The call's answer (its Step was answered)."""
        self._value, self._done = value, True

    def set_error(self, error: KVCoordError) -> None:
        """The call failed (or was aborted): :meth:`result` raises ``error``."""
        self._error, self._done = error, True

    @property
    def done(self) -> bool:
        return self._done

    def result(self) -> T:
        """The value; raises the call's error, or RuntimeError before the flush."""
        if not self._done and self.resolver is not None:
            self.resolver()
        if not self._done:
            raise RuntimeError("the batch has not been flushed yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


class KVCacheBlockIds:
    """Block ids per KV cache group (0 = null block), like vLLM's ``KVCacheBlocks``.

    May be lazy: an allocation the manager proved will succeed is answered at once,
    and its ids arrive with the next Step; reading them sends that Step if needed.
    ``table`` is the request's whole block table after the allocation, when asked for
    (``allocate_slots(..., return_table=True)``).
    """

    __slots__ = ("_ids", "_index", "_pending", "_run", "_table")

    def __init__(
        self,
        block_ids: tuple[list[int], ...] | None = None,
        pending: Pending[KVCacheBlockIds | None] | None = None,
        table: tuple[list[int], ...] | None = None,
        run: Run | None = None,
        index: int = 0,
    ) -> None:
        self._ids = block_ids
        self._pending = pending
        self._table = table
        self._run = run  # an entry of a run of promised allocations: its slice of the answer
        self._index = index

    def _resolve(self) -> None:
        if self._ids is None:
            run = self._run
            if run is not None:
                run.item.pending.result()  # sends the Step if needed; raises the run's error
                self._ids = run.ids_of(self._index)
                self._run = None
                return
            assert self._pending is not None
            resolved = self._pending.result()
            assert resolved is not None
            self._ids, self._table = resolved.block_ids, resolved.table
            self._pending = None

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        self._resolve()
        assert self._ids is not None
        return self._ids

    @property
    def table(self) -> tuple[list[int], ...] | None:
        self._resolve()
        return self._table

    @property
    def resolved(self) -> bool:
        """True when the ids are here (reading them sends nothing)."""
        if self._run is not None:
            return self._run.item.pending.done
        return self._ids is not None or (self._pending is not None and self._pending.done)

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids

    def is_empty(self) -> bool:
        return not any(self.block_ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVCacheBlockIds) and self.block_ids == other.block_ids

    def __hash__(self) -> int:
        return hash(tuple(tuple(g) for g in self.block_ids))

    def __repr__(self) -> str:
        return (
            f"KVCacheBlockIds({self.block_ids!r})" if self._ids is not None else "KVCacheBlockIds(<pending>)"
        )


#: the ``op`` of a run's item (its AllocateRunOp is built when the Step is sent)
_NO_OP = pb.Operation()


class Run:
    """A Step's promised plain allocations, in columns: one AllocateRunOp, answered
    as a whole. Each entry's :class:`KVCacheBlockIds` reads its slice of the answer
    when asked (nothing is built per entry when the answer comes).

    Args:
        num_groups: the pool's KV cache groups.
        resolve: sends the Step, when an entry's ids are read before it was sent.
    """

    __slots__ = ("base_h", "base_t", "check_at", "check_computed", "check_look", "check_new", "check_rids",
                 "check_tokens", "computed", "counts", "expected", "hashes", "item", "look", "marks", "n_hash",
                 "n_tok", "new", "new_ids", "num_groups", "promises", "rids", "starts", "tokens", "touched")  # fmt: skip

    def __init__(self, num_groups: int, resolve: Callable[[], None]) -> None:
        self.num_groups = num_groups
        #: every request of the run, entries and checks (lost together if it fails)
        self.touched: list[str] = []
        self.rids: list[str] = []
        self.base_t: list[int] = []
        self.base_h: list[int] = []
        self.computed: list[int] = []
        self.new: list[int] = []
        self.look: list[int] = []
        self.n_tok: list[int] = []
        self.tokens: list[int] = []
        self.n_hash: list[int] = []
        self.hashes: list[bytes] = []
        #: per entry, the request's position once the entry's sync is applied
        self.marks: list[tuple[int, int, int, bool] | None] = []
        #: per entry and group (entry-major), the new blocks its bound expects (-1: unknown)
        self.expected: list[int] = []
        #: (entry, ledger, promise) of the entries whose new blocks the ledger waits for
        self.promises: list[tuple[int, Any, Any]] = []
        self.counts: list[int] = []
        self.new_ids: list[int] = []
        self.starts: list[int] = []
        # checks: allocations answered as changing nothing, each before entry check_at[j]
        self.check_rids: list[str] = []
        self.check_at: list[int] = []
        self.check_computed: list[int] = []
        self.check_new: list[int] = []
        self.check_look: list[int] = []
        self.check_tokens: list[int] = []
        self.item = Item(
            _NO_OP, _no_decode, self.touched, Pending(resolve), deferred=True, commits_itself=True
        )
        self.item.run = self

    def add(
        self,
        request_id: str,
        fields: tuple[int, int, Sequence[int], Sequence[bytes], int],
        num_new_tokens: int,
        num_lookahead_tokens: int,
        mark: tuple[int, int, int, bool] | None,
        expected: Sequence[int] | None,
    ) -> int:
        """Append an entry (``fields`` from :meth:`RequestTracker.sync_run`); its index."""
        bt, bh, toks, hs, comp = fields
        self.touched.append(request_id)
        self.rids.append(request_id)
        self.base_t.append(bt)
        self.base_h.append(bh)
        self.computed.append(comp)
        self.new.append(num_new_tokens)
        self.look.append(num_lookahead_tokens)
        self.n_tok.append(len(toks))
        self.tokens.extend(toks)
        self.n_hash.append(len(hs))
        self.hashes.extend(hs)
        self.marks.append(mark)
        if expected is None:
            self.expected.extend([-1] * self.num_groups)
        else:
            self.expected.extend(expected)
        return len(self.rids) - 1

    def check(
        self, request_id: str, num_computed_tokens: int, num_new_tokens: int, num_lookahead_tokens: int,
        num_tokens: int,
    ) -> None:  # fmt: skip
        """Append a check: an allocation answered as changing nothing, for the server to
        confirm (it comes before the next entry added)."""
        self.touched.append(request_id)
        self.check_rids.append(request_id)
        self.check_at.append(len(self.rids))
        self.check_computed.append(num_computed_tokens)
        self.check_new.append(num_new_tokens)
        self.check_look.append(num_lookahead_tokens)
        self.check_tokens.append(num_tokens)

    def op(self) -> pb.Operation:
        return pb.Operation(
            allocate_run=pb.AllocateRunOp(
                request_ids=self.rids, base_num_tokens=self.base_t, base_num_hashes=self.base_h,
                num_computed_tokens=self.computed, num_new_tokens=self.new, num_lookahead_tokens=self.look,
                num_append_tokens=self.n_tok, append_token_ids=self.tokens, num_append_hashes=self.n_hash,
                append_block_hashes=[bytes(h) for h in self.hashes], check_request_ids=self.check_rids,
                check_at=self.check_at, check_num_computed_tokens=self.check_computed,
                check_num_new_tokens=self.check_new, check_num_lookahead_tokens=self.check_look,
                check_num_tokens=self.check_tokens,
            )
        )  # fmt: skip

    def answered(self, answer: pb.AllocateRunResult) -> list[int] | None:
        """Take the answer: None when it does not fit the run, else the entries whose
        block counts differ from what their bounds expected."""
        counts = list(answer.num_new_blocks)
        new_ids = list(answer.new_block_ids)
        if len(counts) != self.num_groups * len(self.rids) or sum(counts) != len(new_ids):
            return None
        self.counts, self.new_ids = counts, new_ids
        self.starts = list(itertools.accumulate(counts, initial=0))
        if counts == self.expected:
            return []
        ng = self.num_groups
        expected = self.expected
        return [
            k
            for k in range(len(self.rids))
            if any(
                e not in (-1, c)
                for e, c in zip(expected[k * ng : (k + 1) * ng], counts[k * ng : (k + 1) * ng], strict=True)
            )
        ]

    def ids_of(self, index: int) -> tuple[list[int], ...]:
        """Entry ``index``'s new block ids per group (the answer must be in)."""
        ng, s, ids = self.num_groups, self.starts, self.new_ids
        at = index * ng
        if ng == 1:
            return (ids[s[at] : s[at + 1]],)
        return tuple(ids[s[at + g] : s[at + g + 1]] for g in range(ng))


def _no_decode(result: Any) -> Any:  # a run's answer is taken by Run.answered
    raise AssertionError("a run is answered by Run.answered")


def ids(groups: Iterable[pb.BlockIds]) -> KVCacheBlockIds:
    return KVCacheBlockIds(tuple(list(g.block_ids) for g in groups))


@dataclasses.dataclass(slots=True)
class Item:
    """One queued operation: the op, how to read its result, the requests whose
    positions it moves, and who waits for it."""

    op: pb.Operation
    #: reads the answer: an OperationResult, or a run entry's block ids per group
    decode: Callable[[Any], Any]
    touched: Sequence[str]
    pending: Pending[Any]
    #: True when nobody waits for the answer (frees, cache_blocks, ...): its error, if
    #: any, is raised by whichever call sends it
    deferred: bool = False
    #: True when ``decode`` commits positions itself (an Admit commits only the
    #: requests the server processed)
    commits_itself: bool = False
    #: per touched request, its position right after this call's sync (what the
    #: server holds once this call is applied)
    marks: dict[str, tuple[int, int, int, bool] | None] | None = None
    #: the run of promised allocations this item sends (its op is built at sending)
    run: Run | None = None


class Ops:
    """Builds the queued item of each manager call (one method per call)."""

    def __init__(self, m: BatchOwner) -> None:
        self.m = m

    def _item(
        self,
        op: pb.Operation,
        decode: Callable[[pb.OperationResult], Any],
        touched: Sequence[str],
        deferred: bool = False,
        commits_itself: bool = False,
    ) -> Item:
        """An item whose touched requests are marked at their positions right now."""
        mark = self.m.tracker.mark
        return Item(
            op, decode, touched, Pending(), deferred, commits_itself, {rid: mark(rid) for rid in touched}
        )

    def get_computed_blocks(self, request: Any) -> Item:
        op = pb.Operation()
        self.m.tracker.sync(request, op.lookup.request)
        return self._item(
            op, lambda r: (ids(r.lookup.hit.groups), r.lookup.hit.num_tokens), [request.request_id]
        )

    def hint_lookup(self, request: Any, walk_limit: int) -> Item:
        """A lookup that records nothing and answers ``(hit, hit_tokens, eviction_margin)``."""
        op = pb.Operation()
        lookup = op.lookup
        self.m.tracker.sync(request, lookup.request)
        lookup.hint = True
        lookup.walk_limit = walk_limit

        def decode(r: pb.OperationResult) -> tuple[KVCacheBlockIds, int, int]:
            return ids(r.lookup.hit.groups), r.lookup.hit.num_tokens, r.lookup.eviction_margin

        return self._item(op, decode, [request.request_id])

    def answered_lookup(self, request: Any, hit: KVCacheBlockIds, num_tokens: int) -> Item:
        """The lookup the client answered from a hint, for the server to check and record."""
        op = pb.Operation()
        lookup = op.lookup
        self.m.tracker.sync(request, lookup.request)
        lookup.answered.groups.extend(block_ids_to_pb(hit.block_ids))
        lookup.answered.num_tokens = num_tokens
        return self._item(op, lambda r: None, [request.request_id], deferred=True)

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> Item:  # fmt: skip
        hit = new_computed_blocks.block_ids if new_computed_blocks is not None else None
        op = pb.Operation()
        a = op.allocate
        self.m.tracker.sync(request, a.request)
        rq.allocate_op(None, num_new_tokens, num_new_computed_tokens, hit, num_lookahead_tokens,
                       num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, into=a)  # fmt: skip
        a.return_table = return_table
        m = self.m

        def decode(r: pb.OperationResult) -> KVCacheBlockIds | None:
            if r.allocate.stale_hit:
                m.stale_hits += 1
                return None
            if r.allocate.refused:
                return None
            table = tuple(list(g.block_ids) for g in r.allocate.table) if return_table else None
            return KVCacheBlockIds(tuple(list(g.block_ids) for g in r.allocate.new_block_ids), table=table)

        return self._item(op, decode, [request.request_id])

    def allocate_with_lookup(
        self,
        request: Any,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> Item:
        op = pb.Operation()
        a = op.allocate
        self.m.tracker.sync(request, a.request)
        rq.allocate_op(
            None,
            max_num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            lookup=True,
            into=a,
        )

        def decode(r: pb.OperationResult) -> tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]:
            res = r.allocate
            new = None if res.refused else ids(res.new_block_ids)
            return ids(res.hit.groups), res.hit.num_tokens, res.num_new_tokens, new

        return self._item(op, decode, [request.request_id])

    def admit(self, requests: Sequence[Any], token_budget: int, num_lookahead_tokens: int = 0) -> Item:
        tracker = self.m.tracker
        op = pb.Operation()
        admit = op.admit
        add = admit.requests.add
        for r in requests:
            tracker.sync(r, add())
        admit.token_budget = token_budget
        admit.num_lookahead_tokens = num_lookahead_tokens
        rids = [r.request_id for r in requests]

        def decode(r: pb.OperationResult) -> list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]]:
            out = []
            for a in r.admit.results:
                new = None if a.refused else ids(a.new_block_ids)
                out.append((ids(a.hit.groups), a.hit.num_tokens, a.num_new_tokens, new))
            # the server applied the syncs of the requests it processed, not the others
            tracker.commit(rids[: len(out)], item.marks)
            tracker.rollback(rids[len(out) :])
            return out

        # positions are committed by decode (only the processed requests')
        item = self._item(op, decode, rids, commits_itself=True)
        return item

    def free(self, request: Any) -> Item | None:
        rid = request if isinstance(request, str) else request.request_id
        self.m.freeing(rid)  # a lost request the scheduler frees is settled
        if rid not in self.m.tracker:
            return None  # never sent to the server (e.g. aborted while waiting): nothing to free
        # Forgotten now: if the request comes back before the free is sent, it is
        # registered again after it (the server applies calls in order).
        self.m.tracker.forget([rid])
        self.m.budget.forget(rid)
        return Item(
            pb.Operation(free=pb.FreeOp(request_id=rid)), lambda r: None, [], Pending(), deferred=True
        )

    def free_again(self, request_id: str) -> Item:
        """A free sent again (its first one's outcome unknown): a request the pool no
        longer holds is not an error."""
        op = pb.Operation(free=pb.FreeOp(request_id=request_id, if_held=True))
        return Item(op, lambda r: None, [], Pending(), deferred=True)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> Item:
        op = pb.Operation()
        self.m.tracker.sync(request, op.cache_blocks.request)
        op.cache_blocks.num_computed_tokens = num_computed_tokens
        return self._item(op, lambda r: None, [request.request_id], deferred=True)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> Item:
        op = pb.Operation(
            remove_skipped_blocks=pb.RemoveSkippedBlocksOp(
                request=self.m.tracker.position(request_id), total_computed_tokens=total_computed_tokens
            )
        )
        return self._item(op, lambda r: None, [request_id], deferred=True)

    def evict_blocks(self, block_ids: Iterable[int]) -> Item:
        # in the caller's order: vLLM's block pool evicts (and reports) in its set's order
        op = pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=list(block_ids)))
        return Item(op, lambda r: None, [], Pending(), deferred=True)

    def get_block_ids(self, request_id: str, answered: Sequence[Sequence[int]] | None = None) -> Item:
        """With ``answered`` (the table its caller already has), the server checks it,
        and a table found wrong loses the request (it cannot be trusted any more)."""
        op = pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id=request_id))
        if answered is not None:
            op.get_block_ids.answered.groups.extend(block_ids_to_pb(answered))
            item = Item(op, lambda r: tuple(list(g.block_ids) for g in r.get_block_ids.groups), [request_id],
                        Pending(), commits_itself=True)  # fmt: skip
            return item
        return Item(op, lambda r: tuple(list(g.block_ids) for g in r.get_block_ids.groups), [], Pending())

    def get_num_common_prefix_blocks(self, request_id: str) -> Item:
        op = pb.Operation(common_prefix=pb.CommonPrefixOp(request_id=request_id))
        return Item(op, lambda r: list(r.common_prefix.num_blocks), [], Pending())

    def reset_prefix_cache(self) -> Item:
        op = pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp())
        return Item(op, lambda r: bool(r.reset_prefix_cache.result), [], Pending())


class StepBatcher:
    """Calls collected into one Step RPC, sent on :meth:`flush` (or on leaving a
    ``with`` block). Each call returns a :class:`Pending`; operations apply in order,
    and after a failed one the rest are not applied (their Pending raises AbortedError).

    Leaving the ``with`` block by an exception sends nothing of the batch but its
    frees (queued with the manager's next Step: their requests are forgotten already,
    and a free is always safe to send); the other calls' Pendings raise AbortedError,
    and the requests they synced go back to where they stood before the batch.
    """

    def __init__(self, manager: BatchOwner) -> None:
        self.m = manager
        self._ops = Ops(manager)
        self._items: list[Item] = []
        #: per request a call of this batch synced or freed, its position before the
        #: batch (None: not tracked, or freed by the batch, whose free is sent anyway)
        self._before: dict[str, tuple[int, int, int, bool] | None] = {}
        #: per such request, its position after the batch's last call for it
        self._after: dict[str, tuple[int, int, int, bool] | None] = {}

    def __enter__(self) -> StepBatcher:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.flush()
        else:
            self._abandon()

    def _abandon(self) -> None:
        """The batch is left by an exception: its frees go with the manager's next Step,
        the rest is dropped, and only the requests it moved are moved back."""
        items, self._items = self._items, []
        before, after = self._before, self._after
        self._before, self._after = {}, {}
        m = self.m
        tracker = m.tracker
        # A request synced by a call outside the batch since (e.g. a queued
        # cache_blocks) is left as it is: that call's sync starts where the batch's
        # ended, and fails loudly (SYNC_MISMATCH) when sent.
        tracker.restore({rid: mark for rid, mark in before.items() if tracker.mark(rid) == after[rid]})
        if items:
            m.abandoned(list(before))
        aborted = AbortedError(grpc.StatusCode.ABORTED, "not sent: the batch was left by an exception")
        for item in items:
            if item.op.WhichOneof("op") == "free":
                item.deferred = True  # nobody waits for it now: its error is the sender's
                m.defer(item)
            else:
                item.pending.set_error(aborted)

    def _moving(self, request_id: str) -> None:
        """A call of the batch is about to sync this request: remember where it stood."""
        if request_id not in self._before:
            self._before[request_id] = self.m.tracker.mark(request_id)

    def _add(self, item: Item | None) -> Pending[Any]:
        if item is None:
            done: Pending[Any] = Pending()
            done.set_result(None)
            return done
        item.deferred = False  # an explicit batch: every caller holds its Pending
        self._items.append(item)
        mark = self.m.tracker.mark
        for rid in item.touched:
            self._after[rid] = mark(rid)
        return item.pending

    def get_computed_blocks(self, request: Any) -> Pending[tuple[KVCacheBlockIds, int]]:
        self._moving(request.request_id)
        return self._add(self._ops.get_computed_blocks(request))

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> Pending[KVCacheBlockIds | None]:  # fmt: skip
        self.m.batched_allocation(request.request_id)
        self._moving(request.request_id)
        return self._add(self._ops.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens))  # fmt: skip

    def free(self, request: Any) -> Pending[None]:
        item = self._ops.free(request)
        if item is not None:  # forgotten now, and freed whatever happens to the batch
            rid = request if isinstance(request, str) else request.request_id
            self._before[rid] = self._after[rid] = None
        return self._add(item)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> Pending[None]:
        self.m.caching(request, num_computed_tokens)
        self._moving(request.request_id)
        return self._add(self._ops.cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> Pending[None]:
        self.m.skipping(request_id, total_computed_tokens)
        self._moving(request_id)
        return self._add(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> Pending[None]:
        self.m.clear_hints()
        return self._add(self._ops.evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> Pending[tuple[list[int], ...]]:
        return self._add(self._ops.get_block_ids(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> Pending[list[int]]:
        return self._add(self._ops.get_num_common_prefix_blocks(request_id))

    def flush(self) -> None:
        """Send the collected operations (nothing to do when empty)."""
        items, self._items = self._items, []
        self.m.send_items(items)
