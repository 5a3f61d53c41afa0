"""``KVCoordKVCacheManager``: vLLM's ``KVCacheManager`` interface over a kvcoord
session (a :class:`PredictingKVCacheManager` or a :class:`RemoteKVCacheManager`): every
method and attribute vLLM's scheduler, async scheduler and KV connectors use (the list,
with vLLM source lines, is in docs/vllm-integration.md), with vLLM's types from
:mod:`kvcoord.client.vllm_types`, and the outage errors the scheduler waits out."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

from kvcoord.engine import PrefixCacheStats
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import group_kinds

from .client import KVCoordClient
from .errors import (
    KVCoordError,
    RequestsLostError,
)
from .manager import KVCacheBlockIds, RemoteKVCacheManager
from .predicting import NOT_TAKEN, PredictingKVCacheManager
from .vllm_losses import OUTAGE_ERRORS, REFUSALS, AdapterLosses, absorbing, is_outage
from .vllm_types import (
    KVCacheBlock,
    KVCacheBlocks,
    convert_events,
    convert_stats,
    event_converter,
    zero_stats,
)

__all__ = ["OUTAGE_ERRORS", "REFUSALS", "KVCoordKVCacheManager", "absorbing", "is_outage"]

logger = logging.getLogger(__name__)

# -- the manager -----------------------------------------------------------------------


#: (table position of the first block, positions below which blocks are hashed, the
#: hashes from the first block's on, hashes per block, the group id suffix, evicted
#: blocks among them or None)
_HashView = tuple[int, int, Sequence[bytes], int, bytes, "set[int] | None"]


def _hashed_blocks(block_ids: Sequence[int], view: _HashView | None) -> list[KVCacheBlock]:
    """The blocks ``block_ids`` with the hashes ``view`` took for them."""
    if view is None:
        return [KVCacheBlock(b) for b in block_ids]
    start, limit, hashes, scale, suffix, evicted = view
    out = []
    for j, b in enumerate(block_ids, start):
        if j >= limit or b == 0 or (evicted and b in evicted):
            out.append(KVCacheBlock(b))
        elif scale == 1:
            out.append(KVCacheBlock(b, hashes[j - start] + suffix))
        else:
            k = (j - start) * scale
            out.append(KVCacheBlock(b, b"".join(hashes[k : k + scale]) + suffix))
    return out


@dataclasses.dataclass(slots=True)
class _Held:
    """What the adapter knows of a request holding blocks: for ``block_hash``."""

    request: Any
    hashed_tokens: int = 0


class KVCoordKVCacheManager(AdapterLosses):
    """vLLM 0.16.0's ``KVCacheManager`` interface over a kvcoord pool.

    Every call is one call of the wrapped :class:`RemoteKVCacheManager` (one round trip),
    except those answered locally: ``empty_kv_cache_blocks``, ``create_kv_cache_blocks``,
    ``take_events`` with events off and ``make_prefix_cache_stats`` with stats off.

    ``block_hash`` of a returned block is derived here, not read from the server: a
    request's blocks are hashed up to the tokens cached for it (by ``allocate_slots``,
    or ``cache_blocks`` when caching was delayed), exactly as vLLM's manager caches them,
    with the hash values of ``request.block_hashes``.

    Args:
        remote: an attached manager (see :func:`connect`).
        kv_cache_config: the engine's ``KVCacheConfig`` (kept as ``kv_cache_config``).
    """

    #: the KV events carry the fields vLLM 0.33 added (its adapter's)
    fields_033 = False

    def __init__(
        self, remote: RemoteKVCacheManager | PredictingKVCacheManager, kv_cache_config: Any = None
    ) -> None:
        cfg = remote.config
        self.remote = remote
        self.kv_cache_config = kv_cache_config
        self.enable_caching = bool(cfg.enable_caching)
        self.use_eagle = bool(cfg.use_eagle)
        self.log_stats = not cfg.HasField("log_stats") or cfg.log_stats
        self.enable_kv_cache_events = bool(cfg.enable_kv_cache_events)
        self.max_model_len = int(cfg.max_model_len)
        self.hash_block_size = int(cfg.hash_block_size)
        self.num_kv_cache_groups = len(cfg.groups)
        kinds = group_kinds(cfg.groups)
        self.block_sizes = [int(getattr(g, k).block_size) for g, k in zip(cfg.groups, kinds, strict=True)]
        # attention tables hold one block per block_size tokens from position 0, so a
        # block's position says which hash it holds; mamba and cross-attention tables
        # do not, and their blocks report no hash
        self._positional = [k in ("full", "sliding_window", "chunked_local") for k in kinds]
        self.metrics_collector = None
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._held: dict[str, _Held] = {}
        #: whole tables that came with a request's first allocation, until it changes
        self._tables: dict[str, KVCacheBlockIds] = {}
        #: blocks whose hash evict_blocks dropped: they report none until allocated anew
        #: (a request holding one never caches it again)
        self._evicted: set[int] = set()
        #: closed by close() (set by connect when it opened the client)
        self.owned_client: KVCoordClient | None = None
        #: the pool's name and configuration, to create it again on a server that lost
        #: it (set by connect with KVCOORD_CREATE_POOL=1)
        self.pool_to_create: tuple[str, pb.PoolConfig] | None = None
        #: the requests allocate_slots was called for since the scheduler last cleared
        #: it (what a schedule() call that failed half-way may have allocated), each with
        #: the tokens whose KV existed at its first such call since then (its computed
        #: tokens and its local prefix-cache hit, not tokens a KV connector is to load:
        #: an undone call's free drops the hashes the call cached past them), and the
        #: scheduling fields of each waiting request looked up or allocated for, as they
        #: were at its first such call since then (what that call may have changed after)
        self.allocated: dict[str, int] = {}
        self.seen: dict[str, tuple[Any, ...]] = {}
        #: set by the scheduler while it undoes a schedule() call cut short: a request
        #: in ``allocated`` it frees (or preempts) is freed with ``uncomputed_from``
        #: (see ``free``)
        self.undoing = False
        #: while True (vLLM's update_from_output, whose outputs must not be lost), a
        #: lost session or an outage does not raise: the requests reported lost go to
        #: ``lost`` for the scheduler to preempt before its next allocation, and the
        #: call answers as if it had nothing to say (no events, no statistics, no
        #: blocks, the last usage known)
        self.absorbing = False
        self.lost: set[str] = set()
        #: losses and outages met while absorbing
        self.absorbed = 0
        #: losses met between steps, surfaced before a step (vLLM 0.33: a predicted
        #: session's background Step met it; see surface_losses)
        self.surfaced = 0
        self._last_usage = 0.0
        #: a predicted session's allocation of a running request (see ``allocate_slots``);
        #: set, its lookups read the engine's hit in place (``get_computed_blocks``)
        self._allocate_running = (
            remote.allocate_running if isinstance(remote, PredictingKVCacheManager) else None
        )
        if isinstance(remote, PredictingKVCacheManager) and self.enable_kv_cache_events:
            # as the engine makes them, as vLLM does
            remote.convert_events_with(event_converter(fields_033=self.fields_033))

    # -- blocks -------------------------------------------------------------------------
    def create_kv_cache_blocks(self, blocks: tuple[Sequence[Any], ...]) -> KVCacheBlocks:
        """``KVCacheBlocks`` of ``blocks`` (the shared empty one when all groups are empty)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def _blocks(
        self, ids: Sequence[Sequence[int]], held: _Held | None, starts: Sequence[int]
    ) -> KVCacheBlocks:
        """Blocks for ``ids``; ``starts[g]`` is the table position of group ``g``'s first.
        Built when first read (their ids answer at once), from what they hash to now:
        vLLM may append to the request or evict blocks before then."""
        if not any(ids):
            return self.empty_kv_cache_blocks
        views = None
        if held is not None and self.enable_caching:
            views = [self._hash_view(held, g, starts[g], group) for g, group in enumerate(ids)]
            if views.count(None) == len(views):
                views = None  # (no block hashed yet: a decode step's new block) the ids alone, kept
        if views is None:
            return KVCacheBlocks(ids=ids)
        return KVCacheBlocks(
            make=lambda: tuple(_hashed_blocks(group, v) for group, v in zip(ids, views, strict=True)), ids=ids
        )

    def _hash_view(self, held: _Held, group: int, start: int, block_ids: Sequence[int]) -> _HashView | None:
        """What the blocks ``block_ids`` of group ``group`` (the first at table position
        ``start``) hash to, taken now: a positional group's block within the request's
        hashed tokens holds its hash followed by the group id, unless it is the null
        block, its hash was dropped while held (``evict_blocks``, as vLLM's block) or
        the request has not that many hashes. ``None``: no block holds one."""
        size = self.block_sizes[group]
        if not self._positional[group]:
            return None
        limit = held.hashed_tokens // size  # positions below it are hashed
        hashes = getattr(held.request, "block_hashes", None) or ()
        scale = size // self.hash_block_size
        have = len(hashes) // scale  # positions whose every hash exists
        if limit > have:
            limit = have
        if limit <= start:
            return None
        taken = hashes[start * scale : min(limit, start + len(block_ids)) * scale]
        if list(map(type, taken)).count(bytes) != len(taken):
            taken = [bytes(h) for h in taken]
        evicted = self._evicted
        gone = {b for b in block_ids if b in evicted} if evicted else None
        return start, limit, taken, scale, group.to_bytes(4, "big"), gone

    # -- KVCacheManager -----------------------------------------------------------------
    @property
    def usage(self) -> float:
        # (``absorbing``'s rule written out, the last usage known as its answer: read at
        # every step's end, where the decorator's call costs more than the read)
        try:
            self._last_usage = usage = self.remote.usage
        except KVCoordError as err:
            self._absorb(err)
            return self._last_usage
        return usage

    @property
    def prefix_cache_stats(self) -> Any:
        """The statistics gathered since the last ``make_prefix_cache_stats`` (not reset)."""
        if not self.log_stats:
            return None
        remote = self.remote
        if isinstance(remote, PredictingKVCacheManager):
            return convert_stats(remote.peek_engine_stats() or PrefixCacheStats())  # no message made and read
        return convert_stats(remote.peek_prefix_cache_stats() or pb.PrefixCacheStats())

    def make_prefix_cache_stats(self) -> Any:
        """Get (and reset) the prefix cache stats; ``None`` with stats off."""
        if not self.log_stats:
            return None
        remote = self.remote
        try:  # (``absorbing``'s rule written out, a zero answer: every step's call)
            if isinstance(remote, PredictingKVCacheManager):
                # the engine's value, no message made and read; none recorded (most
                # steps) makes only vLLM's zero
                changed = remote.take_changed_stats()
                return zero_stats() if changed is None else convert_stats(changed)
            stats = remote.make_prefix_cache_stats()
        except KVCoordError as err:
            self._absorb(err)
            stats = None
        return convert_stats(stats if stats is not None else pb.PrefixCacheStats())

    def _seen(self, request: Any) -> None:
        if request.request_id not in self.seen:
            self.seen[request.request_id] = (
                getattr(request, "status", None), request.num_computed_tokens,
                getattr(request, "num_cached_tokens", -1), getattr(request, "num_external_computed_tokens", 0),
            )  # fmt: skip

    def get_computed_blocks(self, request: Any) -> tuple[KVCacheBlocks, int]:
        self._seen(request)
        if not self.enable_caching or getattr(request, "skip_reading_prefix_cache", False):
            return self.empty_kv_cache_blocks, 0
        ids: Sequence[Sequence[int]]
        remote = self.remote
        if self._allocate_running is not None and isinstance(remote, PredictingKVCacheManager):
            ids, num_tokens = remote.lookup_ids(request)  # a predicted session's hit: the engine's tuples
        else:
            hit, num_tokens = remote.get_computed_blocks(request)
            ids = hit.get_block_ids()
        if not any(ids):
            return self.empty_kv_cache_blocks, num_tokens
        # hit blocks are cached blocks: each one holds its hash
        return self._blocks(ids, _Held(request, num_tokens), [0] * len(ids)), num_tokens

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> KVCacheBlocks | None:
        rid = request.request_id
        allocated = self.allocated
        if rid not in allocated:
            allocated[rid] = request.num_computed_tokens + num_new_computed_tokens
        held = self._held.get(rid)
        running = self._allocate_running
        new: Any = NOT_TAKEN
        if (
            held is not None
            and running is not None
            and new_computed_blocks is None
            and not (
                num_new_computed_tokens
                or num_external_computed_tokens
                or delay_cache_blocks
                or num_encoder_tokens
            )
        ):  # a running request's step (vLLM passes no hit): one call to the engine's decode path
            new = running(request, num_new_tokens, num_lookahead_tokens)
        tables = self._tables
        if new is NOT_TAKEN:
            if new_computed_blocks is not None:  # vLLM's waiting loop (a running request's passes none)
                self._seen(request)
            got = self.remote.allocate_slots(
                request, num_new_tokens, num_new_computed_tokens,
                new_computed_blocks.to_block_ids() if new_computed_blocks is not None else None,
                num_lookahead_tokens, num_external_computed_tokens, delay_cache_blocks, num_encoder_tokens,
                return_table=held is None,  # vLLM will ask for its whole table (get_blocks)
            )  # fmt: skip
            if tables:
                tables.pop(rid, None)
            if got is None:
                return None
            new = got.get_block_ids()
            if held is None:
                tables[rid] = got
            num_tokens = -1  # (read below if needed: vLLM's num_tokens, a property)
        else:
            if tables:
                tables.pop(rid, None)
            if new is None:
                return None
            # the request's token count, which the call read (its tracker list's length)
            num_tokens = self.remote.running_tokens  # type: ignore[union-attr]
        if held is None:
            held = self._held[rid] = _Held(request)
        else:
            held.request = request
        # vLLM's accounting: what is computed (clamped to max_model_len), what gets cached
        # (the one place of it: a decode step inside its blocks, most calls, comes here too)
        total = request.num_computed_tokens
        if type(total) is not int:
            total = int(total)
        if num_new_computed_tokens or num_external_computed_tokens:
            total += num_new_computed_tokens + num_external_computed_tokens
        limit = self.max_model_len
        if limit and total > limit:
            total = limit
        if self.enable_caching:
            if delay_cache_blocks:
                cached = int(request.num_computed_tokens) + num_new_computed_tokens
            else:
                cached = total + num_new_tokens
                if num_tokens < 0:
                    num_tokens = int(request.num_tokens)
                if cached > num_tokens:
                    cached = num_tokens
            if cached > held.hashed_tokens:
                held.hashed_tokens = cached
        if not any(new):
            return self.empty_kv_cache_blocks  # a decode step inside its blocks, as vLLM answers it
        self._allocated_anew(new)
        # tables only grow: new blocks end the table, which now covers `need` tokens
        need = total + num_new_tokens + num_lookahead_tokens
        if limit and need > limit:
            need = limit
        starts = [-(-need // size) - len(group) for size, group in zip(self.block_sizes, new, strict=True)]
        return self._blocks(new, held, starts)

    def _allocated_anew(self, ids: Sequence[Sequence[int]]) -> None:
        """Blocks just allocated report their new holder's hashes again."""
        if self._evicted:
            for group in ids:
                self._evicted.difference_update(group)

    def free(self, request: Any) -> None:
        """vLLM's free. While the scheduler undoes a schedule() call (``undoing``), a
        request the call allocated for is freed with ``uncomputed_from`` the tokens
        whose KV existed before the call (``allocated``): the call's allocation cached
        the hashes of the full blocks its step was to compute, and the worker never
        wrote their KV. After an outage the client cannot know whether the server
        applied the allocation, so it cannot name the blocks: the pool drops the cache
        entries of the request's blocks past those tokens, whichever they are."""
        # (``absorbing``'s rule written out: every finished request's call)
        rid = request.request_id
        self._held.pop(rid, None)
        tables = self._tables
        if tables:
            tables.pop(rid, None)
        uncomputed_from = self.allocated.get(rid) if self.undoing else None
        try:
            if uncomputed_from is None:
                self.remote.free(request)
            else:
                self.remote.free(request, int(uncomputed_from))
        except KVCoordError as err:
            self._absorb(err)

    @absorbing(lambda *_: None)
    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        if request_id not in self._held:
            return  # vLLM's scheduler asks for any finished request (a connector's): no table, nothing to skip
        self._tables.pop(request_id, None)
        self.remote.remove_skipped_blocks(request_id, total_computed_tokens)

    @absorbing(lambda *_: None)
    def evict_blocks(self, block_ids: set[int]) -> None:
        self.remote.evict_blocks(block_ids)
        self._evicted.update(block_ids)

    def reset_prefix_cache(self) -> bool:
        try:
            return self.remote.reset_prefix_cache()
        except RequestsLostError as err:
            # the session was lost (the manager is attached again): the scheduler
            # preempts the requests before its next allocation; the reset is tried anew
            self.lost.update(err.request_ids)
            return self.remote.reset_prefix_cache()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        return self.remote.get_num_common_prefix_blocks(running_request_id)

    def scheduled(self) -> None:
        """vLLM's schedule() returned and the model runs: a predicted session sends the
        Step the last step's end cut now (``StepSender.release``)."""
        remote = self.remote
        if isinstance(remote, PredictingKVCacheManager):
            try:  # (``absorbing``'s rule written out: every step's call)
                remote.sender.release()
            except KVCoordError as err:
                self._absorb(err)

    def take_events(self) -> list[Any]:
        """The step's end, in update_from_output (as vLLM 0.33's adapter)."""
        if not self.enable_kv_cache_events:
            return []
        remote = self.remote
        try:  # (``absorbing``'s rule written out, no events as its answer: every step's call)
            if isinstance(remote, PredictingKVCacheManager):
                return remote.take_engine_events()  # converted as they were made
            return convert_events(remote.take_events(), fields_033=self.fields_033)
        except KVCoordError as err:
            self._absorb(err)
            return []

    @absorbing(lambda self, *_: self.empty_kv_cache_blocks)
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        held = self._held.get(request_id)
        if held is None or request_id in self.remote.tracker.lost:
            # never allocated here, freed, or lost with its session: no table, as vLLM answers
            return self.empty_kv_cache_blocks
        fresh = self._tables.get(request_id)
        if fresh is not None:
            # the table came with the request's first allocation (nothing changed it since)
            def make() -> tuple[Sequence[KVCacheBlock], ...]:
                table = fresh.table
                assert table is not None
                return self._blocks(table, held, [0] * len(table)).blocks

            # the ids answer without a block made (vLLM's scheduler reads only them)
            return KVCacheBlocks(make=make, ids=fresh.table)
        ids = self.remote.get_block_ids(request_id)
        return self._blocks(ids, held, [0] * len(ids))

    @absorbing(lambda self, *_: tuple([] for _ in range(self.num_kv_cache_groups)))
    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        if request_id not in self._held or request_id in self.remote.tracker.lost:
            # never allocated here, freed, or lost with its session (vLLM's scheduler asks
            # when a connector's request finishes, scheduled or not): no table, as vLLM answers
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self.remote.get_block_ids(request_id)

    @absorbing(lambda *_: None)
    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        if not self.enable_caching:
            return
        self.remote.cache_blocks(request, num_computed_tokens)
        held = self._held.get(request.request_id)
        if held is not None:
            held.hashed_tokens = max(held.hashed_tokens, num_computed_tokens)

    def close(self) -> None:
        """End the session (the server frees what it still holds) and close an owned client."""
        remote = self.remote
        try:
            remote.close()
        finally:
            try:
                if self.remote is not remote:  # a waiting session took over as it closed
                    self.remote.close()
            finally:
                if self.owned_client is not None:
                    self.owned_client.close()
