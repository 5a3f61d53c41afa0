"""``RemoteKVCacheManager``: vLLM's KVCacheManager interface, served by a kvcoord pool.

A scheduler that calls ``get_computed_blocks`` / ``allocate_slots`` / ``free`` on vLLM's
in-process manager can call the same methods here. Requests are any objects with the
attributes vLLM's ``Request`` has (``request_id``, ``all_token_ids``,
``num_computed_tokens``; optionally ``block_hashes``, ``lora_request``, ``cache_salt``,
``skip_reading_prefix_cache``, ``num_preemptions``, ``mm_items``). Block hashes are taken
from ``request.block_hashes`` when present, else computed here with the pool's hash
settings. Only what changed since the last call is sent.

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

import dataclasses
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from . import _requests as rq
from .client import KVCoordClient
from .errors import (
    AnswerEvictedError,
    FencedError,
    KVCoordError,
    LeaseExpiredError,
    OutcomeUnknownError,
    RequestsLostError,
    RequestUnknownError,
    SessionExpiredError,
    SyncMismatchError,
    error_from_code,
    status_code,
)
from .hashing import BlockHasher, MultiModalItem, RandomSeedError, none_hash
from .session import SessionKeeper

__all__ = ["KVCacheBlockIds", "Pending", "RemoteKVCacheManager", "StepBatcher"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True, slots=True)
class KVCacheBlockIds:
    """Block ids per KV cache group (0 = null block), like vLLM's ``KVCacheBlocks``."""

    block_ids: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.block_ids

    def is_empty(self) -> bool:
        return not any(self.block_ids)


def _ids(groups: Iterable[pb.BlockIds]) -> KVCacheBlockIds:
    return KVCacheBlockIds(tuple(list(g.block_ids) for g in groups))


@dataclasses.dataclass(slots=True)
class _Tracked:
    """What the server has of one request (committed) and what queued ops will add.

    ``sent_tokens`` / ``sent_hashes`` are the position the next sync applies at.
    """

    hasher: BlockHasher | None
    sent_tokens: int = 0
    sent_hashes: int = 0
    sent_computed: int = -1
    registered: bool = False
    committed: tuple[int, int, int, bool] = (0, 0, -1, False)

    def commit(self) -> None:
        self.committed = (self.sent_tokens, self.sent_hashes, self.sent_computed, self.registered)

    def rollback(self) -> None:
        self.sent_tokens, self.sent_hashes, self.sent_computed, self.registered = self.committed


class Pending(Generic[T]):
    """The result of a batched call, available after the batch is flushed."""

    def __init__(self) -> None:
        self._value: T | None = None
        self._error: KVCoordError | None = None
        self._done = False

    def _set(self, value: T) -> None:
        self._value, self._done = value, True

    def _fail(self, error: KVCoordError) -> None:
        self._error, self._done = error, True

    def result(self) -> T:
        """The value; raises the call's error, or RuntimeError before the flush."""
        if not self._done:
            raise RuntimeError("the batch has not been flushed yet")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


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

    Raises:
        RandomSeedError: caching is on and no seed is known.
        HashMismatchError: the pool hashes differently.
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
    ) -> None:
        self.client = client
        self.pool = pool
        info = client.get_pool(pool).pool
        self.config = info.config
        self.enable_caching = info.config.enable_caching
        seed = hash_seed if hash_seed is not None else os.environ.get("PYTHONHASHSEED")
        self._none = b""
        if self.enable_caching:
            if seed is None:
                raise RandomSeedError(
                    "no hash seed: set PYTHONHASHSEED (or pass hash_seed) to the value the vLLM workers use"
                )
            self._none = none_hash(info.config.hash_algo, seed)
        cfg = info.config
        self.keeper = SessionKeeper(
            client,
            lambda: client.attach(
                pool, cfg.hash_algo, cfg.hash_block_size, seed or "", client_name, lease_seconds
            ),
            renew=renew,
        )
        self.num_groups = len(info.config.groups)
        self._tracked: dict[str, _Tracked] = {}
        self._usage: float | None = None
        self._reattach = False
        #: allocate_slots calls answered None because the hit had gone stale (another
        #: worker reused its blocks after the lookup); the scheduler looks up again.
        self.stale_hits = 0
        #: requests reported lost (RequestsLostError) since the manager was created
        self.lost_requests = 0

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    # -- request sync ---------------------------------------------------------------
    def _sync(self, request: Any) -> pb.RequestSync:
        rid = request.request_id
        t = self._tracked.get(rid)
        if t is None:
            t = _Tracked(self._hasher(request))
            self._tracked[rid] = t
        tokens = request.all_token_ids
        sync = pb.RequestSync(request_id=rid)
        if t.registered:
            sync.base_num_tokens = t.sent_tokens
            sync.base_num_hashes = t.sent_hashes
        else:
            sync.new_request = True
        if len(tokens) > t.sent_tokens:
            sync.append_token_ids.extend(tokens[t.sent_tokens :])
        if self.enable_caching:
            hashes = self._hashes(request, t)
            if len(hashes) > t.sent_hashes:
                sync.append_block_hashes.extend(hashes[t.sent_hashes :])
            t.sent_hashes = len(hashes)
        t.sent_tokens = len(tokens)
        computed = int(request.num_computed_tokens)
        if computed != t.sent_computed:
            sync.num_computed_tokens = computed
            t.sent_computed = computed
        if not t.registered:
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                sync.lora.adapter_id = int(getattr(lora, "lora_int_id", getattr(lora, "adapter_id", 0)))
                sync.lora.name = str(getattr(lora, "lora_name", getattr(lora, "name", "")))
            sync.skip_reading_prefix_cache = bool(getattr(request, "skip_reading_prefix_cache", False))
            sync.num_preemptions = int(getattr(request, "num_preemptions", 0))
            t.registered = True
        return sync

    def _hasher(self, request: Any) -> BlockHasher | None:
        if not self.enable_caching or getattr(request, "block_hashes", None):
            return None
        lora = getattr(request, "lora_request", None)
        items: Sequence[MultiModalItem] = getattr(request, "mm_items", ()) or ()
        return BlockHasher(
            self.config.hash_algo,
            self.config.hash_block_size,
            self._none,
            lora_name=getattr(lora, "lora_name", getattr(lora, "name", None)) if lora else None,
            cache_salt=getattr(request, "cache_salt", None),
            mm_items=items,
        )

    @staticmethod
    def _hashes(request: Any, t: _Tracked) -> list[bytes]:
        given = getattr(request, "block_hashes", None)
        if given:
            return [bytes(h) for h in given]
        assert t.hasher is not None
        tokens = request.all_token_ids
        if len(tokens) > len(t.hasher.token_ids):
            t.hasher.extend(tokens[len(t.hasher.token_ids) :])
        return t.hasher.block_hashes

    # -- running operations ---------------------------------------------------------------
    def _run(self, op: pb.Operation, decode: Callable[[pb.OperationResult], T], touched: Sequence[str]) -> T:
        batch = StepBatcher(self)
        pending = batch._add(op, decode, touched)
        batch.flush()
        return pending.result()

    def batch(self) -> StepBatcher:
        """Collect calls into one Step RPC: ``with manager.batch() as b: b.free(r) ...``."""
        return StepBatcher(self)

    def _ops(self) -> _Ops:
        return _Ops(self)

    # -- KVCacheManager interface ------------------------------------------------------------
    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlockIds, int]:
        """The longest prefix hit (a hint until adopted by allocate_slots)."""
        hit: tuple[KVCacheBlockIds, int] = self._run(*self._ops().get_computed_blocks(request))
        return hit

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> KVCacheBlockIds | None:  # fmt: skip
        """New block ids per group, or ``None`` when the pool has too few free blocks."""
        new: KVCacheBlockIds | None = self._run(*self._ops().allocate_slots(
            request, num_new_tokens, num_new_computed_tokens, new_computed_blocks, num_lookahead_tokens,
            num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens))  # fmt: skip
        return new

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
        a = rq.allocate_op(
            self._sync(request),
            max_num_new_tokens,
            num_lookahead_tokens=num_lookahead_tokens,
            num_external_computed_tokens=num_external_computed_tokens,
            delay_cache_blocks=delay_cache_blocks,
            num_encoder_tokens=num_encoder_tokens,
            lookup=True,
        )

        def decode(r: pb.OperationResult) -> tuple[KVCacheBlockIds, int, int, KVCacheBlockIds | None]:
            res = r.allocate
            new = None if res.refused else _ids(res.new_block_ids)
            return _ids(res.hit.groups), res.hit.num_tokens, res.num_new_tokens, new

        return self._run(pb.Operation(allocate=a), decode, [request.request_id])

    def free(self, request: Any) -> None:
        spec = self._ops().free(request)
        if spec is not None:
            self._run(*spec)

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        self._run(*self._ops().cache_blocks(request, num_computed_tokens))

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        self._run(*self._ops().remove_skipped_blocks(request_id, total_computed_tokens))

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        self._run(*self._ops().evict_blocks(block_ids))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self._run(*self._ops().get_block_ids(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> list[int]:
        return self._run(*self._ops().get_num_common_prefix_blocks(request_id))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(*self._ops().reset_prefix_cache()))

    def take_events(self) -> list[pb.KVEvent]:
        return self._run(*self._ops().take_events())

    def make_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        stats: pb.PrefixCacheStats | None = self._run(*self._ops().make_prefix_cache_stats())
        return stats

    @property
    def usage(self) -> float:
        """The pool's usage as of the latest answer (asked for only before the first)."""
        if self._usage is None:
            self._usage = float(self.client.get_stats(self.pool).usage)
        return self._usage

    def close(self) -> None:
        """End the session (the server frees requests it still owns)."""
        self.keeper.close()
        try:
            self.client.detach(self.session_id, self.keeper.fence)
        except (SessionExpiredError, FencedError):
            pass  # already gone: its requests were freed

    # -- loss handling ------------------------------------------------------------------
    def _session_lost(self, err: KVCoordError) -> RequestsLostError:
        """Every tracked request is gone with the session: forget them and re-attach."""
        lost = list(self._tracked)
        self._tracked.clear()
        self.lost_requests += len(lost)
        try:
            self.keeper.attach()
        except KVCoordError:  # e.g. the server's grace period: attached on the next call
            self._reattach = True
        return RequestsLostError(lost, err)

    def _forget(self, request_ids: Sequence[str], err: KVCoordError) -> RequestsLostError:
        """These requests' server state is unknown: free them there (best effort) and here."""
        lost = [rid for rid in dict.fromkeys(request_ids) if rid in self._tracked]
        for rid in lost:
            del self._tracked[rid]
            try:
                self.client.free(self.pool, [rid], session_id=self.session_id, fence=self.keeper.fence)
            except KVCoordError:
                pass  # unknown there already, or the session is gone (then it is freed anyway)
        self.lost_requests += len(lost)
        return RequestsLostError(lost, err)


OpSpec = tuple[pb.Operation, Callable[[pb.OperationResult], Any], Sequence[str]]


class _Ops:
    """Builds (operation, result decoder, touched request ids) for each manager call."""

    def __init__(self, m: RemoteKVCacheManager) -> None:
        self.m = m

    def get_computed_blocks(self, request: Any) -> OpSpec:
        op = pb.Operation(lookup=pb.LookupOp(request=self.m._sync(request)))
        return op, lambda r: (_ids(r.lookup.hit.groups), r.lookup.hit.num_tokens), [request.request_id]

    def allocate_slots(self, request: Any, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlockIds | None = None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0) -> OpSpec:  # fmt: skip
        hit = new_computed_blocks.block_ids if new_computed_blocks is not None else None
        a = rq.allocate_op(self.m._sync(request), num_new_tokens, num_new_computed_tokens, hit,
                           num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks,
                           num_encoder_tokens)  # fmt: skip
        manager = self.m

        def decode(r: pb.OperationResult) -> KVCacheBlockIds | None:
            if r.allocate.stale_hit:
                manager.stale_hits += 1
                return None
            return None if r.allocate.refused else _ids(r.allocate.new_block_ids)

        return pb.Operation(allocate=a), decode, [request.request_id]

    def free(self, request: Any) -> OpSpec | None:
        rid = request.request_id if not isinstance(request, str) else request
        tracked = self.m._tracked
        if rid not in tracked:
            return None  # never sent to the server (e.g. aborted while waiting): nothing to free

        def decode(r: pb.OperationResult) -> None:
            tracked.pop(rid, None)

        return pb.Operation(free=pb.FreeOp(request_id=rid)), decode, [rid]

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> OpSpec:
        op = pb.Operation(
            cache_blocks=pb.CacheBlocksOp(
                request=self.m._sync(request), num_computed_tokens=num_computed_tokens
            )
        )
        return op, lambda r: None, [request.request_id]

    def remove_skipped_blocks(self, request_id: str, total: int) -> OpSpec:
        sync = pb.RequestSync(request_id=request_id)
        t = self.m._tracked.get(request_id)
        if t is not None:
            sync.base_num_tokens, sync.base_num_hashes = t.sent_tokens, t.sent_hashes
        op = pb.Operation(
            remove_skipped_blocks=pb.RemoveSkippedBlocksOp(request=sync, total_computed_tokens=total)
        )
        return op, lambda r: None, [request_id]

    def evict_blocks(self, block_ids: Iterable[int]) -> OpSpec:
        return pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=sorted(block_ids))), lambda r: None, []

    def get_block_ids(self, request_id: str) -> OpSpec:
        op = pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id=request_id))
        return op, lambda r: tuple(list(g.block_ids) for g in r.get_block_ids.groups), []

    def get_num_common_prefix_blocks(self, request_id: str) -> OpSpec:
        op = pb.Operation(common_prefix=pb.CommonPrefixOp(request_id=request_id))
        return op, lambda r: list(r.common_prefix.num_blocks), []

    def reset_prefix_cache(self) -> OpSpec:
        return (
            pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp()),
            lambda r: r.reset_prefix_cache.result,
            [],
        )

    def take_events(self) -> OpSpec:
        return pb.Operation(take_events=pb.TakeEventsOp()), lambda r: list(r.take_events.events), []

    def make_prefix_cache_stats(self) -> OpSpec:
        def decode(r: pb.OperationResult) -> pb.PrefixCacheStats | None:
            return r.prefix_cache_stats.stats if r.prefix_cache_stats.HasField("stats") else None

        return pb.Operation(make_prefix_cache_stats=pb.MakePrefixCacheStatsOp()), decode, []


class StepBatcher:
    """One scheduler step's manager calls, sent as one Step RPC on :meth:`flush`.

    Each call returns a :class:`Pending`; operations apply in order, and after a failed
    one the rest are not applied (their Pending raises AbortedError). Use it as a
    context manager to flush on exit.
    """

    def __init__(self, manager: RemoteKVCacheManager) -> None:
        self.m = manager
        self._items: list[
            tuple[pb.Operation, Callable[[pb.OperationResult], Any], Sequence[str], Pending[Any]]
        ] = []

    def __enter__(self) -> StepBatcher:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is None:
            self.flush()
        else:
            self._rollback()

    def _add(
        self, op: pb.Operation, decode: Callable[[pb.OperationResult], T], touched: Sequence[str]
    ) -> Pending[T]:
        p: Pending[T] = Pending()
        self._items.append((op, decode, touched, p))
        return p

    def __getattr__(self, name: str) -> Callable[..., Pending[Any]]:
        builder = getattr(_Ops, name, None)
        if builder is None:
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Pending[Any]:
            spec = builder(_Ops(self.m), *args, **kwargs)
            if spec is None:
                done: Pending[Any] = Pending()
                done._set(None)
                return done
            return self._add(*spec)

        return call

    def _rollback(self) -> None:
        for t in self.m._tracked.values():
            t.rollback()
        self._items.clear()

    def flush(self) -> None:
        """Send the collected operations (nothing to do when empty)."""
        items, self._items = self._items, []
        if not items:
            return
        m = self.m
        keeper = m.keeper
        try:
            if m._reattach:  # the session was lost and re-attaching failed last time
                keeper.attach()
                m._reattach = False
            keeper.vouch()
            sent = keeper.clock()
            resp = m.client.step(m.pool, [op for op, _, _, _ in items], keeper.session_id, keeper.fence)
            if keeper.clock() >= sent + keeper.lease:
                raise LeaseExpiredError("the answer came after the session's lease could have ended")
        except (SessionExpiredError, FencedError, LeaseExpiredError) as err:
            lost = m._session_lost(err)
            for _, _, _, p in items:
                p._fail(lost)
            return
        except (OutcomeUnknownError, AnswerEvictedError) as err:
            lost = m._forget([rid for _, _, touched, _ in items for rid in touched], err)
            for _, _, _, p in items:
                p._fail(lost)
            return
        except KVCoordError as err:
            for t in m._tracked.values():
                t.rollback()
            for _, _, _, p in items:
                p._fail(err)
            return
        keeper.renewed(sent)
        keeper.adopt(resp.fence)
        m._usage = resp.usage
        failed = False
        for (_, decode, touched, p), result in zip(items, resp.results, strict=True):
            if result.status_code == 0:
                for rid in touched:
                    tracked = m._tracked.get(rid)
                    if tracked is not None:
                        tracked.commit()
                p._set(decode(result))
                continue
            failed = True
            reason = pb.ErrorReason.Name(result.reason) if result.reason else ""
            err = error_from_code(status_code(result.status_code), result.status_message, "Step", reason)
            if isinstance(err, (SyncMismatchError, RequestUnknownError)) and touched:
                # The server holds another state than this client believed: the
                # request cannot be trusted any more.
                p._fail(m._forget(touched, err))
            else:
                p._fail(err)
        if failed:
            for t in m._tracked.values():
                t.rollback()
