"""Operations collected for one Step: the item each manager call queues (:class:`Ops`)
and :class:`StepBatcher`, which gathers calls into one Step explicitly (the items and
the :class:`Pending` results callers hold are in :mod:`.items`).

:class:`StepBatcher` has one explicit method per manager call; each returns a
:class:`Pending`. ``RemoteKVCacheManager`` uses the same builders for its own calls.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op, free_op

from .errors import AbortedError
from .items import Admission, Item, KVCacheBlockIds, Pending, ids, no_answer, put_admission

if TYPE_CHECKING:
    from .sender import StepSender
    from .tracking import RequestTracker


class BatchOwner(Protocol):
    """What the batch builders need of the manager whose Steps carry their calls
    (``RemoteKVCacheManager``): its request positions, its stale-hit count, the
    sender of its Steps and vLLM 0.33's admission inputs (no import of the manager
    here, nothing private of it)."""

    tracker: RequestTracker
    stale_hits: int
    sender: StepSender
    admission: Admission


__all__ = ["Admitted", "BatchOwner", "Ops", "StepBatcher"]

T = TypeVar("T")
#: an admitted request's answer: its hit, hit tokens, tokens scheduled and new blocks
#: (``None``: refused)
Admitted = tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]


class Ops:
    """Builds the queued item of each manager call (one method per call)."""

    def __init__(self, m: BatchOwner) -> None:
        self.m = m

    def _item(
        self,
        op: pb.Operation,
        decode: Callable[[pb.OperationResult], T],
        touched: Sequence[str],
        deferred: bool = False,
        commits_itself: bool = False,
    ) -> Item[T]:
        """An item whose touched requests are marked at their positions right now."""
        mark = self.m.tracker.mark
        return Item(op, decode, touched, deferred, commits_itself, {rid: mark(rid) for rid in touched})

    def get_computed_blocks(self, request: Any) -> Item[tuple[KVCacheBlockIds, int]]:
        op = pb.Operation()
        self.m.tracker.sync(request, op.lookup.request)
        return self._item(
            op, lambda r: (ids(r.lookup.hit.groups), r.lookup.hit.num_tokens), [request.request_id]
        )

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> Item[KVCacheBlockIds | None]:  # fmt: skip
        hit = new_computed_blocks.block_ids if new_computed_blocks is not None else None
        op = pb.Operation()
        a = op.allocate
        self.m.tracker.sync(request, a.request)
        allocate_op(None, num_new_tokens, num_new_computed_tokens, hit, num_lookahead_tokens,
                       num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, into=a)  # fmt: skip
        a.return_table = return_table
        m = self.m
        # (vLLM 0.33's inputs, set around its adapter's allocate_slots; unset: not sent)
        put_admission(a, m.admission)

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
    ) -> Item[Admitted]:
        op = pb.Operation()
        a = op.allocate
        self.m.tracker.sync(request, a.request)
        allocate_op(
            None,
            max_num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            lookup=True,
            into=a,
        )

        def decode(r: pb.OperationResult) -> Admitted:
            res = r.allocate
            new = None if res.refused else ids(res.new_block_ids)
            return ids(res.hit.groups), res.hit.num_tokens, res.num_new_tokens, new

        return self._item(op, decode, [request.request_id])

    def admit(
        self, requests: Sequence[Any], token_budget: int, num_lookahead_tokens: int = 0
    ) -> Item[list[Admitted]]:
        tracker = self.m.tracker
        op = pb.Operation()
        admit = op.admit
        add = admit.requests.add
        for r in requests:
            tracker.sync(r, add())
        admit.token_budget = token_budget
        admit.num_lookahead_tokens = num_lookahead_tokens
        rids = [r.request_id for r in requests]

        def decode(r: pb.OperationResult) -> list[Admitted]:
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

    def free(self, request: Any, uncomputed_from: int | None = None) -> Item[None] | None:
        rid = request if isinstance(request, str) else request.request_id
        tracker = self.m.tracker
        tracker.lost.discard(rid)  # a lost request the scheduler frees is settled (vLLM frees
        # finished and preempted requests alike)
        if rid not in tracker:
            return None  # never sent to the server (e.g. aborted while waiting): nothing to free
        # Forgotten now: if the request comes back before the free is sent, it is
        # registered again after it (the server applies calls in order).
        tracker.forget([rid])
        op = pb.Operation(free=free_op(rid, uncomputed_from=uncomputed_from))
        return Item(op, no_answer, deferred=True)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> Item[None]:
        op = pb.Operation()
        self.m.tracker.sync(request, op.cache_blocks.request)
        op.cache_blocks.num_computed_tokens = num_computed_tokens
        return self._item(op, no_answer, [request.request_id], deferred=True)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> Item[None]:
        op = pb.Operation(
            remove_skipped_blocks=pb.RemoveSkippedBlocksOp(
                request=self.m.tracker.position(request_id), total_computed_tokens=total_computed_tokens
            )
        )
        return self._item(op, no_answer, [request_id], deferred=True)

    def evict_blocks(self, block_ids: Iterable[int]) -> Item[None]:
        # in the caller's order: vLLM's block pool evicts (and reports) in its set's order
        op = pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=list(block_ids)))
        return Item(op, no_answer, deferred=True)

    def get_block_ids(
        self, request_id: str, computed_tokens: int | None = None
    ) -> Item[tuple[list[int], ...]]:
        """The request's table (with ``computed_tokens``: vLLM 0.33's cut to that many tokens)."""
        op = pb.Operation(
            get_block_ids=pb.GetBlockIdsOp(request_id=request_id, computed_tokens=computed_tokens)
        )
        return Item(op, lambda r: tuple(list(g.block_ids) for g in r.get_block_ids.groups))

    def get_num_common_prefix_blocks(self, request_id: str) -> Item[list[int]]:
        op = pb.Operation(common_prefix=pb.CommonPrefixOp(request_id=request_id))
        return Item(op, lambda r: list(r.common_prefix.num_blocks))

    def reset_prefix_cache(self) -> Item[bool]:
        op = pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp())
        return Item(op, lambda r: bool(r.reset_prefix_cache.result))


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
        self._items: list[Item[Any]] = []
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
        aborted = AbortedError(grpc.StatusCode.ABORTED, "not sent: the batch was left by an exception")
        for item in items:
            if item.op.WhichOneof("op") == "free":
                item.deferred = True  # nobody waits for it now: its error is the sender's
                m.sender.defer(item)
            else:
                item.pending.set_error(aborted)

    def _moving(self, request_id: str) -> None:
        """A call of the batch is about to sync this request: remember where it stood."""
        if request_id not in self._before:
            self._before[request_id] = self.m.tracker.mark(request_id)

    def _add(self, item: Item[Any] | None) -> Pending[Any]:
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
        self._moving(request.request_id)
        return self._add(self._ops.cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> Pending[None]:
        self._moving(request_id)
        return self._add(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> Pending[None]:
        return self._add(self._ops.evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> Pending[tuple[list[int], ...]]:
        return self._add(self._ops.get_block_ids(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> Pending[list[int]]:
        return self._add(self._ops.get_num_common_prefix_blocks(request_id))

    def flush(self) -> None:
        """Send the collected operations (nothing to do when empty)."""
        items, self._items = self._items, []
        self.m.sender.send_items(items)
