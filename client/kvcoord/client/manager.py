"""``RemoteKVCacheManager``: vLLM's KVCacheManager interface, served by a kvcoord pool.

A scheduler that calls ``get_computed_blocks`` / ``allocate_slots`` / ``free`` on vLLM's
in-process manager can call the same methods here. Requests are any objects with the
attributes vLLM's ``Request`` has (``request_id``, ``all_token_ids``,
``num_computed_tokens``; optionally ``block_hashes``, ``lora_request``, ``cache_salt``,
``skip_reading_prefix_cache``, ``num_preemptions``, ``mm_items``). Block hashes are taken
from ``request.block_hashes`` when present, else computed here with the pool's hash
settings. Only what changed since the last call is sent.

Round trips: calls whose answer nobody waits for (``free``, ``cache_blocks``,
``remove_skipped_blocks``, ``evict_blocks``) are queued and ride with the next call
that needs an answer. Every answer carries the pool's usage and this session's new
events and statistics, so ``usage``, ``take_events`` and ``make_prefix_cache_stats``
usually cost nothing. With ``exclusive=True`` (the session is the pool's only one, as
for one vLLM engine per pool) the manager knows the pool's free blocks exactly and
answers an ``allocate_slots`` it can prove will succeed at once; its block ids arrive
with the next Step (reading them sends it). On pools of full-attention and sliding-window groups it also keeps a
ledger of every block its requests hold, so a refusal it can prove is answered at once
too. With ``upcoming`` set (a callable naming the requests a scheduler will look up
after a given one; ``KVCoordScheduler`` sets it), a lookup's round trip fetches hints
for those requests, and their lookups are answered from the hints while the manager can
prove them still valid. The server checks every answer given ahead (``must_succeed``,
``must_refuse``, answered lookups): a wrong one is ``PREDICTION_FAILED``, raised as
:class:`RequestsLostError`. vLLM's scheduler step then costs at most three round trips
with blocks to spare. Promised plain allocations (a decode step's) are sent together as
one ``AllocateRunOp``, in columns, with no message built per call; one that changes
nothing (inside the request's last block) is answered with no block ids and sent only
as a check of that claim, without its tokens, which go with the request's next sync.

vLLM's scheduler calls ``free`` for finished and preempted requests alike; a freed
request that comes back is registered again with all its tokens (its
``num_preemptions`` keeps the prefix-cache statistics exact).

Safety: the manager keeps its session alive on a background thread and never hands
out block ids once its lease may have ended. Every request change names the position
it applies at; a call whose outcome is unknown is retried with the same idempotency
key. When requests are lost anyway (the session expired, the server restarted, an
outcome could not be settled, the positions disagree), the call raises
:class:`RequestsLostError` naming them, after re-attaching or cleaning up, so the
scheduler can preempt and recompute them; the next call works normally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import grpc
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import group_kinds

from .batch import Ops, StepBatcher
from .client import KVCoordClient
from .errors import (
    AbortedError,
    AnswerEvictedError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    PermissionDeniedError,
    RequestsLostError,
    RequestUnknownError,
    ResourceExhaustedError,
    SessionExpiredError,
    SyncMismatchError,
    UnavailableError,
    error_from_code,
    status_code,
)
from .hashing import pool_seed
from .hints import Hint, LookupHints
from .items import Item, KVCacheBlockIds, Pending, Run
from .promises import BlockBudget, BlockLedger
from .session import LEASE_MARGIN, SessionKeeper
from .tracking import RequestTracker

__all__ = ["KVCacheBlockIds", "Pending", "RemoteKVCacheManager", "StepBatcher"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

_STAT_FIELDS = ("requests", "queries", "hits", "preempted_requests", "preempted_queries", "preempted_hits")


#: empty Steps take_events sends at most to fetch events the server cut from answers
#: (StepResponse.events_more); each answer carries up to max_message_bytes of them
MAX_EVENT_ROUNDS = 64


#: errors after which a free is sent again with the next Step (the server may answer
#: it then); any other refusal would refuse it again
_TRANSIENT = (UnavailableError, AbortedError, ResourceExhaustedError, LeaseExpiredError)

#: queued operations that make no KV events (nor does a run of checks alone)
_NO_EVENTS = ("free", "remove_skipped_blocks", "lookup", "get_block_ids")


def _answer(item: Item) -> Any:
    """A hint lookup's answer, or None when it failed (a hint is only an optimisation:
    that lookup will take a round trip)."""
    try:
        return item.pending.result()
    except KVCoordError:
        return None


def _touched(items: list[Item]) -> list[str]:
    """The requests a Step's items sync (only theirs roll back when it fails: calls
    collected in an open batch keep theirs)."""
    return [rid for i in items for rid in i.touched]


def _pack(items: list[Item]) -> list[pb.Operation]:
    """The Step's operations, one per item (a run's AllocateRunOp is built now)."""
    return [item.op if item.run is None else item.run.op() for item in items]


class RemoteKVCacheManager:
    """vLLM KVCacheManager methods over a kvcoord pool.

    Args:
        client: a connected :class:`KVCoordClient`.
        pool: the pool's name (create it first, e.g. with ``client.create_pool``).
        hash_seed: the seed workers hash with; defaults to ``$PYTHONHASHSEED``. A remote
            pool is refused without one, since random seeds never match across processes.
        client_name: shown in server logs.
        lease_seconds: the session lease to ask for (0 = the server's default).
        renew: renew the lease on a background thread (turn off only in tests).
        exclusive: be the pool's only session, and answer provable allocations at once.
        profile, num_hash_lookahead_tokens: the semantics profile the caller follows
            (``vllm-0.16`` when empty, or ``vllm-0.33``) and its look-ahead hash tokens,
            checked by the handshake: a pool of another profile is refused.

    Raises:
        RandomSeedError: caching is on and no seed is known.
        HashMismatchError: the pool hashes differently.
        FailedPreconditionError: ``exclusive`` and the pool has another session.
    """

    def __init__(
        self,
        client: KVCoordClient,
        pool: str,
        *,
        hash_seed: str | None = None,
        client_name: str = "",
        lease_seconds: float = 0,
        renew: bool = True,
        exclusive: bool = False,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
    ) -> None:
        self.client = client
        self.pool = pool
        info = client.get_pool(pool).pool
        cfg = info.config
        self.config = cfg
        self.enable_caching = cfg.enable_caching
        seed, none = pool_seed(cfg, hash_seed)
        self.tracker = RequestTracker(cfg, none)
        self.exclusive = exclusive
        self.keeper = SessionKeeper(
            client,
            # the semantics profile the caller follows is part of the handshake ("": vllm-0.16)
            lambda: client.attach(
                pool,
                cfg.hash_algo,
                cfg.hash_block_size,
                seed or "",
                client_name,
                lease_seconds,
                exclusive,
                profile=profile,
                num_hash_lookahead_tokens=num_hash_lookahead_tokens,
            ),
            renew=renew,
        )
        self.num_groups = len(cfg.groups)
        self.log_stats = cfg.log_stats if cfg.HasField("log_stats") else True
        self._ops = Ops(self)
        self.budget = BlockBudget(cfg.groups, cfg.max_model_len)
        #: calls sent with the next Step (frees, cache_blocks, promised allocations)
        self._queue: list[Item] = []
        #: with exclusive: free blocks as of the last answer, less what promises may take
        self._free_estimate: int | None = None
        self._usage: float | None = None
        self._events: list[pb.KVEvent] = []
        #: the last answer's events were cut (StepResponse.events_more): more wait
        self._events_more = False
        self._stats = pb.PrefixCacheStats()
        self._reattach = False
        #: allocate_slots calls answered None because the hit had gone stale (another
        #: worker reused its blocks after the lookup); the scheduler looks up again.
        self.stale_hits = 0
        #: requests reported lost (RequestsLostError) since the manager was created
        self.lost_requests = 0
        #: Step round trips sent, the seconds spent waiting on them (from sending the
        #: request to holding the answer), and allocations answered without one
        self.round_trips = 0
        self.round_trip_seconds = 0.0
        self.promised = 0
        #: lookup hints (exclusive sessions; see get_computed_blocks): given the request
        #: being looked up, the requests the scheduler may look up next, in its order
        self.upcoming: Callable[[Any], Iterable[Any]] | None = None
        #: free-queue positions the server walks for a hint's eviction margin
        self.hint_walk_limit = 4096
        #: answered lookups queued and not yet recorded by the server
        self._unrecorded = 0
        #: lookups answered from a hint (no round trip)
        self.hinted_lookups = 0
        kinds = group_kinds(cfg.groups)
        #: lookups answered ahead, and what they stay valid under
        self.hints = LookupHints(int(cfg.hash_block_size), kinds == ["full"])
        #: with exclusive on a full / sliding-window pool: every block this session holds, so
        #: the free count stays exact between answers (None while it cannot be trusted)
        self._ledger_possible = exclusive and all(k in ("full", "sliding_window") for k in kinds)
        self._ledger_shape = (
            [int(getattr(g, k).block_size) for g, k in zip(cfg.groups, kinds, strict=True)],
            [
                int(g.sliding_window.sliding_window) if k == "sliding_window" else 0
                for g, k in zip(cfg.groups, kinds, strict=True)
            ],
        )
        self._ledger: BlockLedger | None = self._new_ledger()
        #: _free_estimate is exact (else a lower bound)
        self._free_exact = False
        #: allocations answered as refused without a round trip
        self.refused = 0
        #: promised allocations sent as entries of an AllocateRunOp (columns)
        self.run_entries = 0
        #: allocations answered as changing nothing (no block, nothing synced), sent as
        #: checks of an AllocateRunOp
        self.checked = 0
        #: the run the next promised plain allocation joins (see _open_run)
        self._run: Run | None = None

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    def batch(self) -> StepBatcher:
        """Collect calls into one Step RPC: ``with manager.batch() as b: b.free(r) ...``."""
        return StepBatcher(self)

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit (a hint until adopted by allocate_slots).

        With an exclusive session and ``upcoming`` set (a scheduler names the requests
        its waiting loop will look up next), the round trip that answers a lookup also
        fetches hints for the upcoming requests. Their lookups are then answered here,
        without a round trip, while the manager can prove each hint still holds: no
        more blocks left the free queue than the hint's eviction margin, and no hash of
        the request that could lengthen the hit was cached since. The server checks
        every such answer when it records the lookup (a wrong one is PREDICTION_FAILED,
        raised as :class:`RequestsLostError`, never a silent difference).
        """
        rid = request.request_id
        hint = self.hints.by_request.get(rid)
        if hint is not None and self._hint_holds(hint, request):
            item = self._ops.answered_lookup(request, hint.hit, hint.tokens)
            item.pending.resolver = self.flush
            item.deferred = True
            self._queue.append(item)
            self._unrecorded += 1
            self.hinted_lookups += 1
            return hint.hit, hint.tokens
        item = self._ops.get_computed_blocks(request)
        upcoming = self._upcoming(request)
        if not upcoming:
            looked_up: tuple[KVCacheBlockIds, int] = self._now(item)
            return looked_up
        hint_items = [self._ops.hint_lookup(r, self.hint_walk_limit) for r in upcoming]
        self.clear_hints()
        self.send_items([item, *hint_items])
        # Held hit blocks reach the free queue only when freed: the ledger sees each
        # free (see free()); without it, a freed block waits behind at least every
        # block free now.
        tracked = self._ledger is not None and self._free_exact
        cap = self.hint_walk_limit if tracked else (self._free_estimate or 0)
        self.hints.adopt(upcoming, [_answer(hi) for hi in hint_items], cap, tracked)
        result: tuple[KVCacheBlockIds, int] = item.pending.result()
        return result

    def _upcoming(self, request: Any) -> list[Any]:
        """The requests to fetch hints for with this lookup (none unless hints can be
        proved: an exclusive session with caching on, and a scheduler that names them)."""
        if self.upcoming is None or not self.enable_caching or not (self.exclusive and self.keeper.exclusive):
            return []
        rid = request.request_id
        seen: set[str] = {rid}
        out = [request]  # for its next lookup, should this step not admit it
        for r in self.upcoming(request):
            if r.request_id not in seen and r.request_id not in self.tracker.lost:
                seen.add(r.request_id)
                out.append(r)
        return out

    def _hint_holds(self, hint: Hint, request: Any) -> bool:
        """Whether the pool would still answer this request's lookup with ``hint``."""
        keeper = self.keeper
        if keeper.lost is not None or keeper.clock() >= keeper.valid_until or not keeper.exclusive:
            return False
        return self.hints.still_holds(hint, request, lambda: self.tracker.hashes(request))

    def clear_hints(self) -> None:
        self.hints.clear()

    def _cached(self, request: Any, num_tokens: int, cached_before: int = 0) -> None:
        """The pool caches the request's blocks up to ``num_tokens`` (see
        :meth:`LookupHints.cached`)."""
        self.hints.cached(request, num_tokens, cached_before, lambda: self.tracker.hashes(request))

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, return_table: bool = False) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids per group, or ``None`` when the pool has too few free blocks.

        With ``return_table`` the answer's ``table`` is the request's whole block table.
        """
        if (
            self._ledger is not None
            and new_computed_blocks is None
            and not num_new_computed_tokens
            and not num_external_computed_tokens
            and not num_encoder_tokens
            and not delay_cache_blocks
            and not return_table
        ):
            answered = self._plain_promise(request, num_new_tokens, num_lookahead_tokens)
            if answered is not None:
                return answered
        if self._ledger is None and self._ledger_possible and self.keeper.exclusive:
            self._rebuild_ledger()
        rid = request.request_id
        self.hints.admitted(rid)
        hit = new_computed_blocks.block_ids if new_computed_blocks is not None else None
        need, before, after = self.budget.bound(
            rid, int(request.num_computed_tokens), num_new_tokens, num_new_computed_tokens, hit,
            num_lookahead_tokens, num_external_computed_tokens, num_encoder_tokens)  # fmt: skip
        cache_to = -1  # tokens the allocation caches up to, when it succeeds
        cached_before = int(request.num_computed_tokens) + num_new_computed_tokens  # a hit is cached
        if self.enable_caching and not delay_cache_blocks:
            total = int(request.num_computed_tokens) + num_new_computed_tokens + num_external_computed_tokens
            cache_to = min(total + num_new_tokens, len(request.all_token_ids))
        ledger = self._ledger
        new_blocks: list[int] | None = None  # new blocks per group, when known exactly
        total_computed = cached_before + num_external_computed_tokens
        # A connector's tokens: the blocks taken for them are not among the answer's new
        # ids, so the allocation waits for its answer and asks for the whole table,
        # which enters the ledger and the bounds as it is.
        whole_table = bool(num_external_computed_tokens)
        if ledger is not None:
            if whole_table and rid in ledger.held:
                self._ledger_off("external tokens for a request that holds blocks")
                ledger = None
            elif not whole_table:
                # vLLM's allocate_slots first nulls what left the window, refused or not
                self._released(*ledger.skip(rid, total_computed))
                if before is not None and after is not None:
                    new_blocks = [a - b for a, b in zip(after, before, strict=True)]
        keeper = self.keeper
        free = self._free_estimate
        if (
            not whole_table
            and free is not None
            and keeper.lost is None
            and keeper.clock() < keeper.valid_until
        ):
            exact = ledger is not None and new_blocks is not None and self._free_exact
            if exact:
                assert ledger is not None and new_blocks is not None
                need = ledger.need(rid, hit, new_blocks, total_computed)
            self.hints.taking(need)  # at most this many blocks leave the free queue
            if need <= free:
                # Provably enough free blocks (this session is the pool's only one):
                # answer now, send with the next Step.
                self._free_estimate = free - need
                if not exact:
                    self._free_exact = False  # an upper bound was taken: a lower bound left
                fields = None
                if (
                    not hit
                    and not num_new_computed_tokens
                    and not num_encoder_tokens
                    and not num_external_computed_tokens
                    and not delay_cache_blocks
                    and not return_table
                ):
                    fields = self.tracker.sync_run(request)  # None: not registered yet
                answer: KVCacheBlockIds
                if fields is None:
                    item = self._item(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                      num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                      num_encoder_tokens, return_table, before, after)  # fmt: skip
                    item.op.allocate.must_succeed = True
                    self._held(item, rid, hit, new_blocks, total_computed)
                    self._promise(item)
                    answer = KVCacheBlockIds(pending=item.pending)
                else:
                    # an entry of the Step's run: checked and named in bulk when answered
                    run = self._open_run()
                    expected = (
                        None
                        if before is None or after is None
                        else [a - b for a, b in zip(after, before, strict=True)]
                    )
                    k = run.add(
                        rid, fields, num_new_tokens, num_lookahead_tokens, self.tracker.mark(rid), expected
                    )
                    if ledger is not None and self._ledger is ledger:
                        if new_blocks is None:
                            self._ledger_off("an allocation's block count was not known exactly")
                        elif any(new_blocks) or rid not in ledger.held:
                            run.promises.append(
                                (k, ledger, ledger.allocated(rid, None, new_blocks, total_computed))
                            )
                    answer = KVCacheBlockIds(run=run, index=k)
                self.budget.applied(rid, after)
                self.promised += 1
                if cache_to >= 0:
                    self._cached(request, cache_to, cached_before)
                return answer
            if exact:
                # Provably too few (the session knows every block it holds): refused,
                # as vLLM's refusal changes nothing for full attention; the server
                # checks it with the next Step.
                item = self._item(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                  num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                                  num_encoder_tokens, return_table, None, None)  # fmt: skip
                item.op.allocate.must_refuse = True
                item.decode = lambda r: None
                self._promise(item)
                self.refused += 1
                return None
        else:
            self.hints.taking(need)
        self._free_exact = False  # the answer changes the count: re-learned from it
        if whole_table:
            before = after = None  # the new ids leave the external blocks out: no bound to check
        item = self._item(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
                          num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                          return_table or whole_table, before, after)  # fmt: skip
        new: KVCacheBlockIds | None = self._now(item)
        if new is not None and whole_table:
            table = new.table
            assert table is not None
            self.budget.applied(rid, [len(g) for g in table] if self.budget.exact else None)
            if ledger is not None and self._ledger is ledger:
                ledger.adopt_table(rid, table)
            if cache_to >= 0:
                self._cached(request, cache_to, cached_before)
        elif new is not None:
            self.budget.applied(rid, after)
            if ledger is not None and self._ledger is ledger:
                ids = new.block_ids
                ledger.named(ledger.allocated(rid, hit, [len(g) for g in ids], total_computed), ids)
            if cache_to >= 0:
                self._cached(request, cache_to, cached_before)
        return new

    def _plain_promise(
        self, request: Any, num_new_tokens: int, num_lookahead_tokens: int
    ) -> KVCacheBlockIds | None:
        """The common case of allocate_slots, decode above all, in one pass: a request
        whose table lengths are known, no hit, the ledger exact, enough free blocks.
        Answered as the general path below would answer it (an entry of the Step's
        run); ``None``, with nothing changed that the general path would not redo
        identically, when any of that does not hold."""
        budget, ledger = self.budget, self._ledger
        free = self._free_estimate
        rid = request.request_id
        known = budget.lengths.get(rid) if budget.exact else None
        keeper = self.keeper
        if (
            known is None
            or ledger is None
            or free is None
            or not self._free_exact
            or keeper.lost is not None
            or keeper.clock() >= keeper.valid_until
        ):
            return None
        computed = int(request.num_computed_tokens)
        self.hints.admitted(rid)
        skipped = ledger.has_windows and ledger.skips(rid, computed)
        if skipped:
            # vLLM's allocate_slots first nulls what left the window (idempotent: the
            # general path finds nothing more to null)
            self._released(*ledger.skip(rid, computed))
            free = self._free_estimate
            assert free is not None
        need_slot = min(computed + num_new_tokens + num_lookahead_tokens, budget.max_model_len)
        new_blocks = []
        after = []
        need = 0
        for bs, have in zip(budget.block_sizes, known, strict=True):
            required = -(-need_slot // bs)
            if required > have:
                need += required - have
                new_blocks.append(required - have)
                after.append(required)
            else:
                new_blocks.append(0)
                after.append(have)
        if need > free:
            return None  # a refusal: the general path proves and sends it
        if not need and not skipped and rid in ledger.held:  # (the ledger knows its table)
            num_tokens = len(request.all_token_ids)
            if not self.enable_caching or self.hints.caches_nothing_new(
                rid, min(computed + num_new_tokens, num_tokens)
            ):
                # Nothing to take, cache or null (a decode step inside its last block):
                # vLLM's answer is no block ids and none of its state changes. Answered
                # now with nothing synced; the server checks the claim with the next Step.
                self._open_run().check(rid, computed, num_new_tokens, num_lookahead_tokens, num_tokens)
                self.promised += 1
                self.checked += 1
                return KVCacheBlockIds(
                    ([],) if self.num_groups == 1 else tuple([] for _ in range(self.num_groups))
                )
        fields = self.tracker.sync_run(request)
        if fields is None:
            return None  # not registered yet: a full sync
        self.hints.taking(need)  # at most this many blocks leave the free queue
        self._free_estimate = free - need
        run = self._open_run()
        k = run.add(rid, fields, num_new_tokens, num_lookahead_tokens, self.tracker.mark(rid), new_blocks)
        if need or rid not in ledger.held:
            run.promises.append((k, ledger, ledger.allocated(rid, None, new_blocks, computed)))
        budget.lengths[rid] = after
        self.promised += 1
        if self.enable_caching:
            self._cached(request, min(computed + num_new_tokens, len(request.all_token_ids)), computed)
        return KVCacheBlockIds(run=run, index=k)

    def _item(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int,
              new_computed_blocks: KVCacheBlockIds | None, num_lookahead_tokens: int,
              num_external_computed_tokens: int, delay_cache_blocks: bool, num_encoder_tokens: int,
              return_table: bool, before: list[int] | None, after: list[int] | None) -> Item:  # fmt: skip
        """allocate_slots as a full AllocateOp (checked against the bound when known)."""
        item = self._ops.allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens, return_table)  # fmt: skip
        if before is not None and after is not None:
            self._verify_lengths(item, request.request_id, before, after)
        return item

    def _open_run(self) -> Run:
        """The run that new promised entries join: the last queued item, or a new one
        (anything queued after a run starts another, so the Step keeps call order)."""
        run = self._run
        if run is None or not self._queue or self._queue[-1] is not run.item:
            run = self._run = Run(self.num_groups, self.flush)
            self._queue.append(run.item)
        return run

    def _promise(self, item: Item) -> None:
        """Queue an allocation answered without a round trip (sent with the next Step)."""
        item.pending.resolver = self.flush
        item.deferred = True  # its caller has its answer: a failure is raised by the sender
        self._queue.append(item)

    def _held(
        self,
        item: Item,
        rid: str,
        hit: Sequence[Sequence[int]] | None,
        new_blocks: list[int] | None,
        total_computed: int,
    ) -> None:
        """Enter a promised allocation in the ledger; its answer names the new blocks."""
        ledger = self._ledger
        if ledger is None:
            return
        if new_blocks is None:
            self._ledger_off("an allocation's block count was not known exactly")
            return
        h = ledger.allocated(rid, hit, new_blocks, total_computed)
        decode = item.decode

        def named(r: pb.OperationResult) -> Any:
            value = decode(r)
            if isinstance(value, KVCacheBlockIds):
                ledger.named(h, value.block_ids)
            return value

        item.decode = named

    def _verify_lengths(self, item: Item, rid: str, before: list[int], after: list[int]) -> None:
        """Check, when the answer comes, that it took the blocks the bound expected."""
        decode, budget = item.decode, self.budget

        def checked(r: pb.OperationResult) -> Any:
            value = decode(r)
            if isinstance(value, KVCacheBlockIds):
                budget.verify(rid, before, after, value.block_ids)
            return value

        item.decode = checked

    def allocate_with_lookup(
        self,
        request: Any,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]:
        """Look up and allocate atomically (the hit cannot go stale in between).

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)``: the adopted hit, the tokens
            scheduled (``min(remaining, max_num_new_tokens)``) and the new blocks, or
            ``None`` for them when the pool is out of blocks.
        """
        self.clear_hints()  # the blocks it takes are known only from its answer
        self._ledger_off("allocate_with_lookup")
        result: tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None] = self._now(
            self._ops.allocate_with_lookup(
                request,
                max_num_new_tokens,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
            )
        )
        return result

    def admit(
        self, requests: Sequence[Any], token_budget: int, num_lookahead_tokens: int = 0
    ) -> list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]]:
        """A scheduler's waiting loop, usually in one round trip: for each request in
        order, its prefix hit, then ``allocate_slots`` for ``min(remaining tokens, budget
        left)``, exactly as ``get_computed_blocks`` + ``allocate_slots`` one by one; stops
        when the budget is spent or after the first refusal.

        Requests are sent in chunks whose prompts cover the budget (a waiting queue's
        tail is not sent); only when prefix hits leave budget over is another chunk sent.

        Returns:
            ``(hit, hit_tokens, num_new_tokens, new_blocks)`` per request processed, in
            order; ``new_blocks`` is ``None`` for a last, refused one.
        """
        self.clear_hints()  # the blocks it takes are known only from its answer
        ledger = self._ledger  # kept: each admitted request enters it from the answer
        out: list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]] = []
        start, budget = 0, token_budget
        while start < len(requests) and budget > 0:
            end, covered = start, 0
            while end < len(requests) and covered < budget:
                covered += len(requests[end].all_token_ids) - int(requests[end].num_computed_tokens)
                end += 1
            chunk = requests[start:end]
            self._free_exact = False  # the answer tells the count (its allocations are not known before)
            result: list[tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]] = self._now(
                self._ops.admit(chunk, budget, num_lookahead_tokens)
            )
            for request, (hit, hit_tokens, n, new) in zip(chunk, result, strict=False):
                if new is not None:  # its table lengths from now on: the hit, then what it took
                    rid = request.request_id
                    _, _, after = self.budget.bound(
                        rid, 0, n, hit_tokens, hit.block_ids, num_lookahead_tokens
                    )
                    self.budget.applied(rid, after)
                    budget -= n
                    if ledger is not None and self._ledger is ledger:
                        ids = new.block_ids
                        ledger.named(
                            ledger.allocated(rid, hit.block_ids, [len(g) for g in ids], hit_tokens), ids
                        )
            out.extend(result)
            if len(result) < len(chunk) or (result and result[-1][3] is None):
                break  # stopped by the budget or a refusal
            start = end
        return out

    def free(self, request: Any) -> None:
        """Free the request's blocks (sent with the next call)."""
        self.defer(self._ops.free(request))

    def freeing(self, rid: str) -> None:
        """What a free changes here, whichever way it is sent (this manager's queue or a
        :meth:`batch`): nothing it cached or held may be assumed any more."""
        self.tracker.lost.discard(rid)  # vLLM frees finished and preempted requests alike
        self.hints.forget(rid)
        if self._ledger is not None:
            self._released(*self._ledger.release(rid))

    def _released(self, count: int, ids: list[int]) -> None:
        """The ledger's blocks that a queued call frees: the free count grows, and a
        hint block among them lowers its hints' margins (it waits behind every block
        free now)."""
        free = self._free_estimate
        self.hints.released(ids, free)
        if free is not None:
            self._free_estimate = free + count

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self.defer(self._ops.cache_blocks(request, num_computed_tokens))
        self.caching(request, num_computed_tokens)

    def caching(self, request: Any, num_computed_tokens: int) -> None:
        """What a cache_blocks changes here, whichever way it is sent."""
        if self.enable_caching:
            self._cached(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self.skipping(request_id, total_computed_tokens)
        self.defer(self._ops.remove_skipped_blocks(request_id, total_computed_tokens))

    def skipping(self, request_id: str, total_computed_tokens: int) -> None:
        """What a remove_skipped_blocks changes here, whichever way it is sent."""
        if self._ledger is not None:
            self._released(*self._ledger.skip(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self.clear_hints()
        self.defer(self._ops.evict_blocks(block_ids))

    def batched_allocation(self, request_id: str) -> None:
        """An allocation sent through :meth:`batch`, which this manager does not answer
        or follow: the ledger, bounds and hints that relied on following every
        allocation are dropped (rebuilt or re-learned from the next answers)."""
        self._ledger_off("an allocation sent through batch()")
        self.budget.forget(request_id)
        self.hints.forget(request_id)
        self.clear_hints()

    def abandoned(self, request_ids: Iterable[str]) -> None:
        """A batch's calls were dropped unsent (it was left by an exception): what was
        assumed from them here (ledger, bounds, cached hashes, hints) is dropped too,
        and re-learned from the next answers."""
        self._ledger_off("a batch was left by an exception")
        self.clear_hints()
        for rid in request_ids:
            self.budget.forget(rid)
            self.hints.forget(rid)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group (null blocks as 0). From the block ledger
        when it holds the whole table (every id in it came from an answer; what is
        queued cannot change it): the server checks that answer with the next Step
        (``PREDICTION_FAILED`` and :class:`RequestsLostError` if it differs). Else one
        round trip."""
        keeper = self.keeper
        if self._ledger is not None and keeper.lost is None and keeper.clock() < keeper.valid_until:
            # (as for a promise: only while the session's lease is one the client can
            # vouch for; after it the server may have handed the blocks out again)
            table = self._ledger.table(request_id)
            if table is not None:
                item = self._ops.get_block_ids(request_id, table)
                item.pending.resolver = self.flush
                item.deferred = True  # answered: a failure is raised by the sender
                self._queue.append(item)
                return table
        ids: tuple[list[int], ...] = self._now(self._ops.get_block_ids(request_id))
        return ids

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        n: list[int] = self._now(self._ops.get_num_common_prefix_blocks(request_id))
        return n

    def reset_prefix_cache(self) -> bool:
        self.clear_hints()
        return bool(self._now(self._ops.reset_prefix_cache()))

    def take_events(self) -> list[pb.KVEvent]:
        """The pool's KV events since the previous call (this session's cursor)."""
        if not self.keeper.exclusive:
            self.send_items([], force=True)  # other sessions' calls make events too
        elif any(
            bool(i.run.rids) if i.run is not None else i.op.WhichOneof("op") not in _NO_EVENTS
            for i in self._queue
        ):
            self.flush()  # queued calls that make events (allocations and cache_blocks store blocks)
        for _ in range(MAX_EVENT_ROUNDS):
            if not self._events_more:
                break
            self.send_items([], force=True)  # an answer holds what fits below max_message_bytes
        events, self._events = self._events, []
        return events

    def make_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """This session's prefix-cache statistics since the previous call (None when the
        pool keeps none)."""
        if not self.log_stats:
            return None
        if self._unrecorded:
            self.flush()  # lookups answered from hints are counted when the server checks them
        stats, self._stats = self._stats, pb.PrefixCacheStats()
        return stats

    def peek_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """What make_prefix_cache_stats would return, without resetting it."""
        if not self.log_stats:
            return None
        if self._unrecorded:
            self.flush()
        copy = pb.PrefixCacheStats()
        copy.CopyFrom(self._stats)
        return copy

    @property
    def usage(self) -> float:
        """The pool's usage: exact, from the free count this exclusive session knows
        exactly (queued frees and promises counted), else sending queued calls first."""
        free, keeper = self._free_estimate, self.keeper
        if (
            self._free_exact
            and free is not None
            and keeper.exclusive
            and keeper.lost is None
            and keeper.clock() < keeper.valid_until
        ):  # as for a promise: only while the session's lease is one the client can vouch for
            total = self.config.num_blocks - 1  # vLLM's formula and float order
            return 0.0 if not total else 1.0 - (free / total)
        if self._queue or self._usage is None:
            if self._queue:
                self.flush()
            else:
                self._usage = float(self.client.get_stats(self.pool).usage)
        assert self._usage is not None
        return self._usage

    def flush(self) -> None:
        """Send every queued call now."""
        if self._queue:
            self.send_items([])

    def close(self) -> None:
        """Send what is queued, then end the session (the server frees its requests)."""
        try:
            self.flush()
        finally:
            self.keeper.close()
            try:
                self.client.detach(self.session_id, self.keeper.fence)
            except (SessionExpiredError, FencedError):
                pass  # already gone: its requests were freed

    # -- sending ----------------------------------------------------------------------------
    def defer(self, item: Item | None) -> None:
        if item is not None:
            item.pending.resolver = self.flush
            self._queue.append(item)

    def _now(self, item: Item) -> Any:
        self.send_items([item])
        return item.pending.result()

    def send_items(self, items: list[Item], force: bool = False) -> None:
        """One Step with the queued calls, then ``items``; every Pending gets its answer.
        Without anything to send, nothing is sent unless ``force``.

        Raises:
            the error of a queued call nobody waited for (after every Pending is set).
        """
        items = self._queue + items
        self._queue = []
        self._unrecorded = 0
        if not items and not force:
            return
        keeper = self.keeper
        try:
            if self._reattach:  # the session was lost and re-attaching failed last time
                self.keeper.start_again()
                self._reattach = False
            keeper.vouch()
            sent = keeper.clock()
            self.round_trips += 1
            ops = _pack(items)
            self.run_entries += sum(len(i.run.rids) for i in items if i.run is not None)
            waited = time.perf_counter()
            try:
                resp = self.client.step(self.pool, ops, keeper.session_id, keeper.fence, include_state=True)
            finally:
                self.round_trip_seconds += time.perf_counter() - waited
            if keeper.clock() >= sent + keeper.lease * (1 - LEASE_MARGIN):
                raise LeaseExpiredError("the answer came after the session's lease could have ended")
        except KVCoordError as err:
            self._ledger_off(f"a Step failed: {err}")
            if isinstance(err, (SessionExpiredError, FencedError, LeaseExpiredError)):
                failure: KVCoordError = self._session_lost(err)  # its end frees everything
            else:
                if isinstance(err, (OutcomeUnknownError, AnswerEvictedError)) or any(
                    i.run is not None or (i.deferred and i.touched) for i in items
                ):
                    # Applied or not, unknown; or not applied while calls in it were
                    # already answered (promises, checks, hinted lookups, ledger tables):
                    # none of its requests can be trusted.
                    failure = self._forget([rid for i in items for rid in i.touched], err)
                else:
                    self.tracker.rollback(_touched(items))
                    failure = err
                # Its queued frees may not have happened: free again (an unknown
                # request is already free).
                self._free_again(items)
            self._fail_all(items, failure)
            if not items or any(i.deferred for i in items):
                # Queued calls have no caller waiting to see this: the caller that sent
                # them (take_events, usage, flush, close, any other call) must.
                raise failure from None
            return
        keeper.renewed(sent)
        keeper.adopt(resp.fence)
        self._absorb(resp)
        failed: KVCoordError | None = None
        for item, result in zip(items, resp.results, strict=True):
            if result.status_code == 0:
                if item.run is None:
                    if not item.commits_itself:
                        self.tracker.commit(item.touched, item.marks)
                    item.pending.set_result(item.decode(result))
                    continue
                if self._run_answered(item.run, result.allocate_run):
                    continue
                # else an answer that does not fit the run: a failure (below)
            reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
            op_err = error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
            if result.status_code == 0:  # an answer that does not fit what was sent
                op_err = KVCoordError(
                    grpc.StatusCode.INTERNAL, "allocate_run: the answer does not match the run"
                )
            if reason == "PREDICTION_FAILED":
                # A promise was broken: nothing in this Step can be trusted.
                lost = self._forget([rid for i in items for rid in i.touched], op_err)
                later = items[items.index(item) + 1 :]
                self._free_again(later)  # calls after the failed one were not applied
                for rest in items:
                    if not rest.pending.done:
                        rest.pending.set_error(lost)
                failed = failed or lost
                break
            if item.run is not None:
                # A run of promised allocations failed (entries before the failing one
                # stay applied): none of its requests can be trusted any more.
                lost = self._forget(item.touched, op_err)
                item.pending.set_error(lost)
                failed = failed or lost
                continue
            kind = item.op.WhichOneof("op")
            promised = kind == "allocate" and item.op.allocate.must_succeed
            if (promised or isinstance(op_err, (SyncMismatchError, RequestUnknownError))) and item.touched:
                # The server holds another state than this client believed (or than it
                # already told its caller): the request cannot be trusted any more.
                op_err = self._forget(item.touched, op_err)
            elif kind == "free" and item.deferred:
                # A queued free did not happen and nobody waits to see it: free the
                # request now, or its blocks stay held by a request the client forgot.
                self._free_now(item.op.free.request_id)
            item.pending.set_error(op_err)
            if item.deferred and failed is None:
                failed = op_err
        if any(r.status_code for r in resp.results):
            self.tracker.rollback(_touched(items))
            self._ledger_off("an operation of a Step failed")
        if failed is not None:
            raise failed

    def _run_answered(self, run: Run, answer: pb.AllocateRunResult) -> bool:
        """A run's answer: its entries' positions committed, counts checked against
        their bounds, promised blocks named in the ledger (False, nothing set, when
        the answer does not fit the run)."""
        differ = run.answered(answer)
        if differ is None:
            return False
        ng = self.num_groups
        for k in differ:  # logs, and turns exact bounds off
            self.budget.verify(run.rids[k], [0] * ng, run.expected[k * ng : (k + 1) * ng], run.ids_of(k))
        for k, ledger, promise in run.promises:  # the ledger it was made in (a newer one ignores it)
            ledger.named(promise, run.ids_of(k))
        self.tracker.commit_marks(run.rids, run.marks)
        run.item.pending.set_result(run)
        return True

    def _new_ledger(self) -> BlockLedger | None:
        return BlockLedger(*self._ledger_shape) if self._ledger_possible else None

    def _ledger_off(self, why: str) -> None:
        """Stop trusting the ledger (refusals take a round trip again) until it is
        rebuilt from the server's tables (:meth:`_rebuild_ledger`). Hints whose margins
        relied on it go too."""
        if self._ledger is not None:
            logger.info("block ledger of session %s rebuilt at the next allocation: %s", self.session_id, why)
            self.clear_hints()
        self._ledger = None
        self._free_exact = False

    def _rebuild_ledger(self) -> None:
        """One Step reading the block table of every request this session holds. If it
        fails, the manager goes on without a ledger (allocations it cannot prove take a
        round trip) and does not try again."""
        rids = self.tracker.registered_ids()
        items = [self._ops.get_block_ids(rid) for rid in rids]
        ledger = BlockLedger(*self._ledger_shape)
        self.send_items(items)  # a queued call's failure (or a lost session) is the caller's to hear
        try:
            for rid, item in zip(rids, items, strict=True):
                table = item.pending.result()
                if any(table):
                    ledger.adopt_table(rid, table)
                # else registered (looked up) but never allocated: not held, so its first
                # allocation adopts its hit, as vLLM's does
        except KVCoordError as err:
            logger.warning("block ledger of session %s not rebuilt, refusals take round trips: %s",
                           self.session_id, err)  # fmt: skip
            self._ledger_possible = False
            return
        self._ledger = ledger
        self._free_exact = self._free_estimate is not None

    def _absorb(self, resp: pb.StepResponse) -> None:
        """What every answer carries: usage, free blocks, events, statistics."""
        self._usage = resp.usage
        if self.exclusive and self.keeper.exclusive:
            free = resp.num_free_blocks
            if self._ledger is not None and self._free_exact and self._free_estimate != free:
                # Every claim made from the ledger is checked by the server; the usage
                # it gave is not: say so loudly.
                logger.warning(
                    "session %s counted %s free blocks, the pool has %s: its block ledger was wrong "
                    "(usage read since the previous answer may have been off; please report this)",
                    self.session_id, self._free_estimate, free,
                )  # fmt: skip
                self._ledger_off(f"{self._free_estimate} free blocks counted, {free} on the server")
            self._free_estimate = free
            self._free_exact = self._ledger is not None
        if resp.events:
            self._events.extend(resp.events)
        self._events_more = resp.events_more
        if resp.HasField("prefix_cache_stats"):
            s, new = self._stats, resp.prefix_cache_stats
            for name in _STAT_FIELDS:
                setattr(s, name, getattr(s, name) + getattr(new, name))
            s.reset = s.reset or new.reset

    @staticmethod
    def _fail_all(items: list[Item], err: KVCoordError) -> None:
        for i in items:
            i.pending.set_error(err)

    # -- loss handling ------------------------------------------------------------------
    def _session_lost(self, err: KVCoordError) -> RequestsLostError:
        """Every tracked request is gone with the session: forget them and re-attach."""
        lost = self.tracker.clear()
        self.budget.clear()
        self.hints.reset()
        # the new session holds nothing: an empty ledger is exact
        self._ledger = self._new_ledger()
        self._free_exact = False
        self.lost_requests += len(lost)
        self._free_estimate = None
        try:
            self.keeper.start_again()
        except KVCoordError:  # e.g. unreachable, or the server's grace period: next call
            self._reattach = True
        return RequestsLostError(lost, err)

    def _free_now(self, request_id: str) -> None:
        """Free a request on the server at once. When the server cannot be reached, the
        free is queued for the next Step (its blocks must not stay held by a request
        nobody tracks); an unknown request is free already, a lost session's end frees
        everything it held, and a request of another session is not this one's to free
        (its id was taken after this session's request was gone). Any other refusal is
        logged and the free dropped: sent again it would fail every later Step."""
        try:
            self.client.free(self.pool, [request_id], session_id=self.session_id, fence=self.keeper.fence)
        except (RequestUnknownError, SessionExpiredError, FencedError, PermissionDeniedError):
            pass
        except _TRANSIENT:
            self._queue.append(self._ops.free_again(request_id))
        except KVCoordError as err:
            logger.error(
                "session %s could not free request %r, which may stay held until the session ends: %s",
                self.session_id, request_id, err,
            )  # fmt: skip

    def _free_again(self, items: Sequence[Item]) -> None:
        """The queued frees among ``items``, which may not have been applied."""
        for i in items:
            if i.run is None and i.op.WhichOneof("op") == "free":
                self._free_now(i.op.free.request_id)

    def _forget(self, request_ids: Sequence[str], err: KVCoordError) -> RequestsLostError:
        """These requests' server state is unknown: free them there (best effort) and here."""
        lost = self.tracker.forget(request_ids, lost=True)
        self.clear_hints()
        for rid in lost:
            self.hints.forget(rid)  # what the server caches for them is unknown
        if self._ledger is not None:
            for rid in lost:
                self._ledger.release(rid)  # freed on the server below (or already gone)
            self._ledger_off("requests were forgotten")
        for rid in request_ids:
            self.budget.forget(rid)
        self._free_estimate = None  # re-learned from the next answer
        for rid in lost:
            self._free_now(rid)  # unknown there already, or freed
        self.lost_requests += len(lost)
        return RequestsLostError(lost, err)
