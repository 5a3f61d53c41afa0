"""The pool facade: vLLM's ``KVCacheManager`` plus the request table a remote pool needs.

In vLLM the scheduler owns ``Request`` objects and hands them to the manager. A
remote pool cannot see the scheduler's objects, so it keeps the fields the manager
reads (token ids, block hashes, computed-token count, LoRA, flags) per request id;
the client reports changes with :meth:`KVCachePool.update_request`.

Every public method validates its input completely before changing anything, so a
raised :class:`~kvcoord.engine.errors.EngineError` leaves the pool as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

from .blocks import KVCacheBlock
from .config import KVCacheConfig
from .coordinators import get_kv_cache_coordinator
from .errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    RequestExistsError,
    RequestNotFoundError,
    StaleCacheHitError,
)
from .events import KVCacheEvent
from .hash_list import hashes_at_block_size, request_keys
from .managers import CrossAttentionManager, MambaManager, SingleTypeKVCacheManager
from .request import LoRA, Request
from .stats import LookupCounters, PrefixCacheStats
from .types import RequestId

__all__ = ["AllocationResult", "CacheHit", "KVCachePool", "PoolSnapshot", "RequestCheckpoint"]

BlockIds = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True, slots=True)
class CacheHit:
    """A prefix-cache hit: one block-id list per group (0 = null block) and its length.

    A hit is a hint: it is valid until the pool's next mutation.
    """

    block_ids: BlockIds
    num_tokens: int

    @property
    def is_empty(self) -> bool:
        """True when every group's list is empty (null blocks count as entries)."""
        return not any(self.block_ids)


@dataclasses.dataclass(frozen=True, slots=True)
class AllocationResult:
    """The outcome of :meth:`KVCachePool.allocate_slots_with_lookup`.

    ``new_block_ids`` is ``None`` when the pool had too few free blocks; then only
    skipped-block removal (and the lookup's statistics) changed the pool.
    """

    hit: CacheHit
    num_new_tokens: int
    new_block_ids: BlockIds | None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestCheckpoint:
    """A request's sizes before an update, to undo it (see ``restore_request``)."""

    num_tokens: int
    num_block_hashes: int
    num_computed_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """Everything observable about a pool, for equality checks in tests and tools."""

    free_queue: tuple[int, ...]
    ref_cnts: tuple[int, ...]
    block_hashes: tuple[bytes | None, ...]
    hash_map: tuple[tuple[bytes, tuple[int, ...]], ...]
    requests: tuple[tuple[object, ...], ...]
    managers: tuple[tuple[object, ...], ...]
    pending_events: tuple[KVCacheEvent, ...]
    stats: PrefixCacheStats | None


#: the namespace prefix never assigned (assignment starts at 1)
_UNUSED_PREFIX = bytes(4)

_ALLOCATE_COUNT_NAMES = (
    "num_new_tokens",
    "num_new_computed_tokens",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "num_encoder_tokens",
)


def _check_count(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    return value


class KVCachePool:
    """One pool of KV blocks shared by all groups, with vLLM's manager semantics.

    Creating a pool costs O(1) in ``num_blocks``: block objects are created on first
    use (see :class:`~kvcoord.engine.block_pool.BlockPool`), and a dropped pool is
    reclaimed by reference counting (blocks hold no links to each other).

    Args:
        config: the validated layout; see :class:`KVCacheConfig`.
        materialize_blocks: create every block object up front instead (identical
            answers; the reference the lazy pool is tested against).
    """

    def __init__(self, config: KVCacheConfig, *, materialize_blocks: bool = False) -> None:
        self.config = config
        self.coordinator = get_kv_cache_coordinator(config, materialize_blocks)
        self.block_pool = self.coordinator.block_pool
        self.managers = self.coordinator.managers
        self.enable_caching = config.enable_caching
        self.max_model_len = config.max_model_len
        self.hash_block_size = config.hash_block_size
        self.requests: dict[str, Request] = {}
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if config.log_stats else None
        self.num_refusals = 0
        self.lookup_counters = LookupCounters(group_hit_tokens=[0] * len(config.groups))
        # Managers whose rules must be checked before any state changes (mamba align).
        self._prechecked_managers = [m for m in self.managers if isinstance(m, MambaManager) and m.align]
        self._alignment = self.coordinator.alignment_tokens
        self._num_sink_blocks = sum(len(getattr(m, "sink_blocks", ())) for m in self.managers)
        # allocate_slots' fast path serves pools whose managers all allocate and cache by
        # the base rules (full, sliding window, chunked local).
        self._plain_managers = all(
            type(m).allocate_new_blocks is SingleTypeKVCacheManager.allocate_new_blocks
            and type(m).cache_blocks is SingleTypeKVCacheManager.cache_blocks
            and type(m).allocate_new_computed_blocks is SingleTypeKVCacheManager.allocate_new_computed_blocks
            and type(m).get_num_blocks_to_allocate is SingleTypeKVCacheManager.get_num_blocks_to_allocate
            for m in self.managers
        )
        # Managers that may free blocks in remove_skipped_blocks (a skip rule).
        self._skipping_managers = [
            m
            for m in self.managers
            if type(m).get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens
            or type(m).remove_skipped_blocks is not SingleTypeKVCacheManager.remove_skipped_blocks
        ]
        self._no_new_blocks: BlockIds = tuple(() for _ in self.managers)
        self._group_block_sizes = [g.block_size for g in config.groups]
        #: cache namespace name -> its key prefix, assigned in order of first use
        self.cache_namespaces: dict[str, bytes] = {}
        #: evict_blocks was called: blocks may have lost their hash while shared
        self.evict_blocks_called = False

    def cache_namespace_prefix(self, name: str) -> bytes:
        """The key prefix of cache namespace ``name`` (``b""`` for ``""``).

        Prefixes are 4 bytes, distinct per name and assigned in order of first use, so
        the same calls in the same order give the same prefixes (exact replay).

        Raises:
            InvalidArgumentError: a namespace on a caching pool without a fixed hash
                length (keys of two namespaces could then coincide).
        """
        if not name:
            return b""
        prefix = self.cache_namespaces.get(name)
        if prefix is None:
            if not isinstance(name, str):
                raise InvalidArgumentError("cache_namespace must be a string")
            if self.enable_caching and self.config.hash_length is None:
                raise InvalidArgumentError(
                    "cache namespaces need the pool's hash_length (every hash the same length)"
                )
            prefix = self.cache_namespaces[name] = (len(self.cache_namespaces) + 1).to_bytes(4, "big")
        return prefix

    # -- request table --------------------------------------------------------------
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
    ) -> None:
        """Register a request with its prompt and the prompt's block hashes.

        ``cache_namespace`` isolates prefix caching: the request hits only blocks cached
        by requests of the same namespace, whatever its hashes. ``""`` (the default) is
        vLLM's single cache, with vLLM's keys.

        Raises:
            RequestExistsError: the id is in use.
            InvalidArgumentError: bad id, tokens, hashes or LoRA, or an empty prompt
                (vLLM never schedules one: its lookup would search ``-1`` tokens).
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise RequestExistsError(f"request {request_id!r} already exists in this pool")
        tokens = self._check_tokens(prompt_token_ids, 0, "prompt_token_ids")
        if not tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: prompt_token_ids is empty; a request needs at least one token"
            )
        hashes = self._check_hashes(block_hashes, 0, len(tokens), f"request {request_id!r}")
        if lora is not None and (
            not isinstance(lora, LoRA) or _check_count(lora.adapter_id, "lora.adapter_id") < 0
        ):
            raise InvalidArgumentError("lora must be a LoRA(adapter_id, name)")
        if not isinstance(skip_reading_prefix_cache, bool):
            raise InvalidArgumentError("skip_reading_prefix_cache must be a bool")
        _check_count(num_preemptions, "num_preemptions")
        prefix = self.cache_namespace_prefix(cache_namespace)
        self.requests[request_id] = Request(
            RequestId(request_id),
            tokens,
            hashes,
            num_preemptions=num_preemptions,
            lora=lora,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            cache_prefix=prefix,
        )

    def update_request(
        self,
        request_id: str,
        *,
        num_computed_tokens: int | None = None,
        append_token_ids: Sequence[int] = (),
        append_block_hashes: Sequence[bytes] = (),
    ) -> None:
        """Report the scheduler's progress: computed tokens, then appended tokens.

        ``append_block_hashes`` are the hashes of blocks the appended tokens completed.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: counts, tokens or hashes that do not fit.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        # Only the delta is checked: what the request already holds was checked when it
        # arrived, so a decode step costs O(1) whatever the request's length.
        have = len(req.all_token_ids)
        new_tokens = self._check_tokens(append_token_ids, have, "append_token_ids")
        new_hashes = self._check_hashes(
            append_block_hashes, len(req.block_hashes), have + len(new_tokens), f"request {request_id!r}"
        )
        if num_computed_tokens is not None:
            if type(num_computed_tokens) is not int or num_computed_tokens < 0:
                _check_count(num_computed_tokens, "num_computed_tokens")
            # Under speculative decoding the scheduler counts scheduled drafts as computed
            # before their tokens are appended, so the count may pass num_tokens.
            if num_computed_tokens > self.max_model_len:
                raise InvalidArgumentError(
                    f"num_computed_tokens {num_computed_tokens} exceeds max_model_len {self.max_model_len}"
                )
            req.num_computed_tokens = num_computed_tokens
        if new_tokens:
            req.all_token_ids += new_tokens
            if new_hashes:
                req.block_hashes += new_hashes

    def checkpoint_request(self, request_id: str) -> RequestCheckpoint | None:
        """What :meth:`restore_request` needs to undo later request updates
        (``None`` for an unknown id, meaning "undo = forget it")."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return RequestCheckpoint(req.num_tokens, len(req.block_hashes), req.num_computed_tokens)

    def restore_request(self, request_id: str, checkpoint: RequestCheckpoint | None) -> None:
        """Undo :meth:`add_request` / :meth:`update_request` calls made since ``checkpoint``.

        Only valid while no pool operation has run for the request in between (the
        service uses it when the operation that followed a request update failed).
        """
        req = self.requests.get(request_id)
        if req is None:
            return
        if checkpoint is None:
            if any(self.coordinator.get_blocks(request_id)):
                raise FailedPreconditionError(f"request {request_id!r} holds blocks; cannot forget it")
            self.coordinator.free(request_id)
            del self.requests[request_id]
            return
        del req.all_token_ids[checkpoint.num_tokens :]
        del req.block_hashes[checkpoint.num_block_hashes :]
        req.num_computed_tokens = checkpoint.num_computed_tokens

    def has_request(self, request_id: str) -> bool:
        return request_id in self.requests

    def get_request(self, request_id: str) -> Request:
        """The request's state (read it, do not change it).

        Raises:
            RequestNotFoundError: unknown id.
        """
        return self._get(request_id)

    # -- KVCacheManager operations ------------------------------------------------------
    def get_computed_blocks(self, request_id: str) -> CacheHit:
        """The longest prefix hit of at most ``num_tokens - 1`` tokens (records stats).

        Returns an empty hit, without stats, when caching is off or the request skips
        reading the prefix cache.
        """
        req = self._get(request_id)
        return self._lookup(req)

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> CacheHit:
        """The hit :meth:`get_computed_blocks` would give a request of ``num_tokens``
        tokens with these block hashes, changing nothing.

        Same search (at most ``num_tokens - 1`` tokens, EAGLE's drop, the hybrid fixed
        point, LCM alignment), but no request is registered, no block is touched or
        moved in the free queue, and no statistic, counter or event is recorded. Like
        any hit, the answer is a hint valid until the pool's next mutation.

        Args:
            block_hashes: the request's hashes, one per full ``hash_block_size`` block of
                its tokens (ignored when caching is off).
            num_tokens: the request's token count, ``1 .. max_model_len``.
            cache_namespace: search this namespace's cached blocks only (see
                :meth:`add_request`).

        Returns:
            The hit; empty (one empty list per group) when caching is off.

        Raises:
            InvalidArgumentError: ``num_tokens`` is not an integer in
                ``1 .. max_model_len``, or the hashes are not exactly one per full block
                (count, type, length).
        """
        if type(num_tokens) is not int:
            raise InvalidArgumentError(f"num_tokens must be an integer, got {type(num_tokens).__name__}")
        if not 1 <= num_tokens <= self.max_model_len:
            raise InvalidArgumentError(
                f"num_tokens must be between 1 and max_model_len {self.max_model_len}, got {num_tokens}"
            )
        if isinstance(block_hashes, (bytes, str)):
            raise InvalidArgumentError("block_hashes must be a sequence of bytes, not a single value")
        hashes = self._check_hashes(block_hashes, 0, num_tokens, f"lookup of {num_tokens} tokens")
        if not self.enable_caching:
            return CacheHit(self._no_new_blocks, 0)
        # A namespace not seen yet has cached nothing: its keys take the prefix no
        # namespace is ever given (0), so the same search finds nothing, read-only.
        prefix = self.cache_namespaces.get(cache_namespace, _UNUSED_PREFIX) if cache_namespace else b""
        hit, _ = self._search(request_keys(hashes, prefix), num_tokens)
        return hit

    def _search(self, block_hashes: Sequence[bytes], num_tokens: int) -> tuple[CacheHit, list[list[int]]]:
        """The coordinator's search for a request of ``num_tokens >= 1`` tokens (caching on)."""
        lists, hit = self.coordinator.find_longest_cache_hit(block_hashes, num_tokens - 1)
        return CacheHit(tuple(map(tuple, lists)), hit), lists

    def _lookup(self, req: Request) -> CacheHit:
        if not self.enable_caching or req.skip_reading_prefix_cache:
            return CacheHit(self._no_new_blocks, 0)
        hit, lists = self._search(request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids))
        self._record_lookup(req, hit, lists)
        return hit

    def _record_lookup(self, req: Request, hit: CacheHit, lists: list[list[int]]) -> None:
        """Statistics and counters of one lookup; remembers the hit for adoption."""
        req.last_hit = (hit.block_ids, self.block_pool.hash_epoch)
        num_tokens = len(req.all_token_ids)
        hit_tokens = hit.num_tokens
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.record(num_tokens, hit_tokens, req.num_preemptions > 0)
        c = self.lookup_counters
        c.lookups += 1
        c.queries += num_tokens
        c.hits += hit_tokens
        if num_tokens - 1 < self._alignment:
            c.short_lookups += 1
        group_hits = c.group_hit_tokens
        for g, lst in enumerate(lists):
            if lst:
                group_hits[g] += len(lst) * self._group_block_sizes[g]

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: CacheHit | Sequence[Sequence[int]] | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> BlockIds | None:
        """vLLM's ``allocate_slots``: adopt a prefix hit, take new blocks, cache full ones.

        Args:
            request_id: a registered request.
            num_new_tokens: tokens to compute this step (drafts included).
            num_new_computed_tokens: tokens covered by ``new_computed_blocks``.
            new_computed_blocks: the hit from :meth:`get_computed_blocks`, adopted by the
                request's first allocation; checked to be still cached.
            num_lookahead_tokens: extra slots for speculative tokens.
            num_external_computed_tokens: tokens loaded by a KV connector.
            delay_cache_blocks: do not cache yet (asynchronous external load).
            num_encoder_tokens: encoder input length for cross-attention groups.

        Returns:
            The newly taken block ids per group, or ``None`` when too few blocks are
            free; ``None`` changes nothing except skipped-block removal.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: counts out of range or a malformed hit.
            StaleCacheHitError: a hit block is no longer cached for this prefix.
            FailedPreconditionError: the request already holds blocks and cannot adopt
                a hit, or the call breaks a manager rule (mamba align chunking).
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if (
            new_computed_blocks is None
            and self._plain_managers
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
            and req.num_computed_tokens + num_new_tokens <= self.max_model_len
        ):
            return self._allocate_without_hit(req, num_new_tokens, num_lookahead_tokens)
        counts = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
                  num_encoder_tokens)  # fmt: skip
        if not all(type(v) is int and v >= 0 for v in counts):  # fast path; the loop names the culprit
            for name, value in zip(_ALLOCATE_COUNT_NAMES, counts, strict=True):
                _check_count(value, name)
        if not isinstance(delay_cache_blocks, bool):
            raise InvalidArgumentError("delay_cache_blocks must be a bool")
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidArgumentError(
                "num_new_tokens must be > 0 unless num_external_computed_tokens is > 0"
            )
        hit_blocks = self._resolve_hit(req, new_computed_blocks, num_new_computed_tokens)
        local = req.num_computed_tokens + num_new_computed_tokens
        if local + num_external_computed_tokens + num_new_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"computed plus new tokens ({local + num_external_computed_tokens} + "
                f"{num_new_tokens}) exceed max_model_len {self.max_model_len}"
            )
        if any(hit_blocks) or num_external_computed_tokens > 0:
            self._check_adoption(request_id, hit_blocks)
        total = min(local + num_external_computed_tokens, self.max_model_len)
        main = total + num_new_tokens
        need = min(main + num_lookahead_tokens, self.max_model_len)
        for manager in self._prechecked_managers:
            reason = manager.check_allocation(request_id, main)
            if reason is not None:
                raise FailedPreconditionError(f"group {manager.group_id}: {reason}")

        coordinator = self.coordinator
        coordinator.remove_skipped_blocks(request_id, total)
        k = coordinator.get_num_blocks_to_allocate(
            request_id,
            need,
            hit_blocks,
            num_encoder_tokens,
            local + num_external_computed_tokens,
            main,
        )
        if k > self.block_pool.get_num_free_blocks():
            self.num_refusals += 1
            return None
        if any(hit_blocks) or num_external_computed_tokens > 0:
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, local, num_external_computed_tokens
            )
        new = coordinator.allocate_new_blocks(request_id, need, main, num_encoder_tokens)
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(req, min(total + num_new_tokens, req.num_tokens))
        return tuple([tuple([b.block_id for b in lst]) for lst in new])

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
        for m in self._skipping_managers:
            m.remove_skipped_blocks(rid, total)
        managers = self.managers
        k = 0
        for m in managers:
            if rid in m.num_cached_block:  # admitted: no hit possible, nothing skipped to add
                blocks = m.req_to_blocks.get(rid)
                n = -(-need // m.block_size) - (len(blocks) if blocks is not None else 0)
                if n > 0:
                    k += n
            else:
                k += m.get_num_blocks_to_allocate(rid, need, (), total, main)
        bp = self.block_pool
        if k > bp.free_block_queue.num_free_blocks:
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
            num_tokens = len(req.all_token_ids)
            cached = main if main < num_tokens else num_tokens
            for m in managers:
                num_full = cached // m.block_size
                num_cached = m.num_cached_block.get(rid, 0)
                if num_cached < num_full:
                    bp.cache_full_blocks(
                        req, m.req_to_blocks[rid], num_cached, num_full, m.block_size, m.group_id
                    )
                    m.num_cached_block[rid] = num_full
        return result

    def allocate_slots_with_lookup(
        self,
        request_id: str,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
    ) -> AllocationResult:
        """Look up the prefix and allocate in one step, so the hit cannot go stale.

        Does what vLLM's scheduler does for a waiting request:
        ``num_new_tokens = min(num_tokens - hit - external, max_num_new_tokens)``.

        Raises:
            FailedPreconditionError: the request already holds blocks or has
                computed tokens (only a waiting request looks up its prefix).
            InvalidArgumentError: see :meth:`allocate_slots`.
        """
        req = self._get(request_id)
        _check_count(max_num_new_tokens, "max_num_new_tokens")
        _check_count(num_external_computed_tokens, "num_external_computed_tokens")
        if req.num_computed_tokens or any(self.coordinator.get_blocks(request_id)):
            raise FailedPreconditionError(
                f"request {request_id!r} is already running (it has computed tokens or "
                "holds blocks); only a waiting request looks up its prefix"
            )
        if num_external_computed_tokens >= req.num_tokens:
            raise InvalidArgumentError(
                f"num_external_computed_tokens {num_external_computed_tokens} must be "
                f"smaller than the request's {req.num_tokens} tokens"
            )
        if max_num_new_tokens == 0 and num_external_computed_tokens == 0:
            raise InvalidArgumentError(
                "max_num_new_tokens must be > 0 unless num_external_computed_tokens is > 0"
            )
        # Search first, allocate, and record the lookup only once the allocation did
        # not raise: a failed call leaves statistics and counters untouched.
        if not self.enable_caching or req.skip_reading_prefix_cache:
            hit, lists = CacheHit(self._no_new_blocks, 0), None
        else:
            hit, lists = self._search(
                request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids)
            )
        num_new = min(req.num_tokens - hit.num_tokens - num_external_computed_tokens, max_num_new_tokens)
        if num_new < 0:
            num_new = 0
        last_hit = req.last_hit
        fresh = req.last_hit = (hit.block_ids, self.block_pool.hash_epoch)  # trusted by allocate_slots
        try:
            new = self.allocate_slots(
                request_id,
                num_new,
                hit.num_tokens,
                hit,
                num_lookahead_tokens,
                num_external_computed_tokens,
                delay_cache_blocks,
                num_encoder_tokens,
            )
        except Exception:
            req.last_hit = last_hit
            raise
        if lists is not None:
            self._record_lookup(req, hit, lists)
            req.last_hit = fresh
        return AllocationResult(hit, num_new, new)

    def free(self, request_id: str) -> None:
        """Release the request's blocks (tail first, group order) and forget it."""
        self._get(request_id)
        self.coordinator.free(request_id)
        del self.requests[request_id]

    def preempt(self, request_id: str) -> None:
        """Release the request's blocks but keep it: computed tokens go back to 0 and its
        later lookups count as preempted."""
        req = self._get(request_id)
        self.coordinator.free(request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def cache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to ``num_computed_tokens`` hittable
        (after a delayed external load)."""
        req = self._get(request_id)
        _check_count(num_computed_tokens, "num_computed_tokens")
        if num_computed_tokens > req.num_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} exceeds the request's {req.num_tokens} tokens"
            )
        if not self.enable_caching:
            return
        for m in self.managers:
            full = num_computed_tokens // m.block_size
            held = len(m.req_to_blocks.get(request_id, ()))
            if full > m.num_cached_block.get(request_id, 0) and full > held:
                raise FailedPreconditionError(
                    f"group {m.group_id}: caching {full} blocks but request {request_id!r} holds only {held}"
                )
        self.coordinator.cache_blocks(req, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free blocks that attention no longer reads after ``total_computed_tokens``."""
        self._get(request_id)
        _check_count(total_computed_tokens, "total_computed_tokens")
        if total_computed_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"total_computed_tokens {total_computed_tokens} exceeds max_model_len {self.max_model_len}"
            )
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each block (KV connector load failures)."""
        ids = list(block_ids)
        for bid in ids:
            _check_count(bid, "block id")
            if bid >= self.config.num_blocks:
                raise InvalidArgumentError(
                    f"block id {bid} is out of range (pool has {self.config.num_blocks} blocks)"
                )
        if ids:
            self.evict_blocks_called = True
        self.block_pool.evict_blocks(ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (``False``) while any request holds a block."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """KV events queued since the last call, oldest first."""
        return self.block_pool.take_events()

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call; counting starts again from zero."""
        if self.prefix_cache_stats is None:
            return None
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def peek_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """A copy of the current statistics, without resetting them."""
        return None if self.prefix_cache_stats is None else self.prefix_cache_stats.copy()

    def get_block_ids(self, request_id: str) -> BlockIds:
        """The request's block table per group (null blocks included)."""
        self._get(request_id)
        return tuple(tuple(b.block_id for b in lst) for lst in self.coordinator.get_blocks(request_id))

    def get_num_common_prefix_blocks(self, request_id: str) -> tuple[int, ...]:
        """Per group, the leading blocks of this request shared by every holder."""
        self._get(request_id)
        return tuple(self.coordinator.get_num_common_prefix_blocks(request_id))

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def cached_block_ids(self) -> list[int]:
        """Ids of the blocks that currently hold a prefix-cache hash, ascending."""
        return self.block_pool.cached_block_ids()

    def free_queue_head(self, limit: int | None = None) -> list[int]:
        """Free block ids from the next to be reused, at most ``limit``."""
        return self.block_pool.free_block_queue.head_ids(limit)

    def snapshot(self) -> PoolSnapshot:
        """A complete, comparable copy of the pool's observable state."""
        bp = self.block_pool
        managers = []
        for m in self.managers:
            extra: tuple[object, ...] = ()
            if isinstance(m, MambaManager):
                extra = (sorted(m.allocated_block_reqs), sorted(m.last_state_block_idx.items()))
            managers.append(
                (
                    tuple((r, tuple(b.block_id for b in bl)) for r, bl in sorted(m.req_to_blocks.items())),
                    tuple(sorted(m.num_cached_block.items())),
                    extra,
                )
            )
        return PoolSnapshot(
            free_queue=tuple(bp.free_block_queue.head_ids()),
            ref_cnts=bp.ref_cnts(),
            block_hashes=bp.block_hashes(),
            hash_map=tuple((k, tuple(v)) for k, v in bp.cached_block_hash_to_block.items()),
            requests=tuple(
                (
                    r.request_id,
                    tuple(r.all_token_ids),
                    tuple(r.block_hashes),
                    r.num_computed_tokens,
                    r.num_preemptions,
                    r.lora,
                    r.skip_reading_prefix_cache,
                    r.cache_prefix,
                )
                for r in sorted(self.requests.values(), key=lambda r: r.request_id)
            ),
            managers=tuple(managers),
            pending_events=tuple(bp.kv_event_queue),
            stats=self.peek_prefix_cache_stats(),
        )

    # -- internals --------------------------------------------------------------------
    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        return req

    def _check_tokens(self, tokens: Sequence[int], have: int, name: str) -> list[int]:
        """A copy of ``tokens`` once every one is a non-negative ``int`` (not bool) and
        ``have`` plus their count fits ``max_model_len``."""
        out = list(tokens)
        n = len(out)
        if n == 1:
            t = out[0]
            ok = type(t) is int and t >= 0
        else:
            # C-level passes: the set of element types, then the minimum.
            ok = not out or (set(map(type, out)) == {int} and min(out) >= 0)
        if not ok:
            bad = next(t for t in out if type(t) is not int or t < 0)
            raise InvalidArgumentError(f"{name} must hold non-negative integers, got {bad!r}")
        if have + n > self.max_model_len:
            raise InvalidArgumentError(
                f"the request would have {have + n} tokens, more than max_model_len {self.max_model_len}"
            )
        return out

    def _check_hashes(self, hashes: Sequence[bytes], have: int, num_tokens: int, label: str) -> list[bytes]:
        """A copy of ``hashes`` once they are exactly the new full blocks' hashes: one
        per full ``hash_block_size`` block past ``have``, non-empty ``bytes`` of the
        pool's hash length."""
        if not self.enable_caching:
            return []
        out = list(hashes)
        want = num_tokens // self.hash_block_size - have
        if len(out) != want:
            raise InvalidArgumentError(
                f"{label}: expected {want} new block hashes (one per full "
                f"block of {self.hash_block_size} tokens), got {len(out)}"
            )
        if not out:
            return out
        if set(map(type, out)) != {bytes}:
            raise InvalidArgumentError("block hashes must be non-empty bytes")
        lengths = set(map(len, out))
        length = self.config.hash_length
        if length is not None and lengths != {length}:
            bad = next(n for n in lengths if n != length)
            raise InvalidArgumentError(f"block hashes must be {length} bytes long, got one of {bad} bytes")
        if 0 in lengths:
            raise InvalidArgumentError("block hashes must be non-empty bytes")
        return out

    def _check_adoption(self, request_id: str, hit_blocks: list[list[KVCacheBlock]]) -> None:
        """A hit or external tokens are adopted only by a request holding no blocks yet
        (an admitted request, one with cached blocks, skips adoption and must bring no hit)."""
        for m, hit in zip(self.managers, hit_blocks, strict=False):
            if isinstance(m, CrossAttentionManager):
                continue  # adopts nothing: its blocks come from the encoder
            if request_id in m.num_cached_block:
                ok = not hit
            else:
                ok = not m.req_to_blocks.get(request_id)
            if not ok:
                raise FailedPreconditionError(
                    f"group {m.group_id}: request {request_id!r} already holds blocks; prefix "
                    "hits and external tokens are adopted only by a request's first allocation"
                )

    def _resolve_hit(
        self,
        req: Request,
        hit: CacheHit | Sequence[Sequence[int]] | None,
        num_new_computed_tokens: int,
    ) -> list[list[KVCacheBlock]]:
        """Turn a hit's block ids back into blocks, checking each is still cached."""
        n = len(self.managers)
        if hit is None:
            lists: Sequence[Sequence[int]] = [()] * n
        elif isinstance(hit, CacheHit):
            lists = hit.block_ids
        else:
            lists = hit
        if len(lists) != n:
            raise InvalidArgumentError(
                f"new_computed_blocks must have one list per KV cache group ({n}), got {len(lists)}"
            )
        if not any(lists):
            if num_new_computed_tokens:
                raise InvalidArgumentError(
                    "num_new_computed_tokens is > 0 but no prefix-hit blocks were given"
                )
            return [[] for _ in range(n)]
        if not self.enable_caching:
            raise InvalidArgumentError("prefix caching is off: new_computed_blocks must be empty")
        bp = self.block_pool
        blocks = bp.blocks
        # The request's own last lookup, and no cached hash dropped since: every block
        # still holds the key it was found under, so the per-block check can be skipped.
        last = req.last_hit
        trusted = (
            last is not None
            and last[1] == bp.hash_epoch
            and (lists is last[0] or tuple(map(tuple, lists)) == last[0])
        )
        out: list[list[KVCacheBlock]] = []
        for m, ids in zip(self.managers, lists, strict=False):
            if isinstance(m, CrossAttentionManager) and ids:
                raise InvalidArgumentError(f"group {m.group_id}: cross-attention has no prefix hits")
            if len(ids) * m.block_size < num_new_computed_tokens:
                raise InvalidArgumentError(
                    f"group {m.group_id}: {len(ids)} hit blocks cover fewer than "
                    f"num_new_computed_tokens={num_new_computed_tokens} tokens"
                )
            if len(ids) * m.block_size > req.num_tokens:
                raise InvalidArgumentError(
                    f"group {m.group_id}: {len(ids)} hit blocks but the request has only "
                    f"{req.num_tokens // m.block_size} full blocks"
                )
            if trusted:
                out.append([blocks[bid] for bid in ids])
                continue
            hashes = hashes_at_block_size(
                request_keys(req.block_hashes, req.cache_prefix), self.hash_block_size, m.block_size
            )
            resolved = []
            gid = m.group_id
            for pos, bid in enumerate(ids):
                if isinstance(bid, bool) or not isinstance(bid, int) or not 0 <= bid < bp.num_blocks:
                    raise InvalidArgumentError(f"group {gid}: invalid block id {bid!r}")
                if bid == 0:
                    if not m.uses_null_blocks:
                        raise InvalidArgumentError(
                            f"group {gid}: the null block cannot be part of a full-attention hit"
                        )
                    resolved.append(bp.null_block)
                    continue
                block = bp.get_block(bid)
                if block is None or block.cached_hash != hashes[pos] or block.cached_group != gid:
                    raise StaleCacheHitError(
                        f"group {gid}: block {bid} at position {pos} is no longer "
                        "cached for this request's prefix; look up again (or allocate "
                        "with an atomic lookup)"
                    )
                resolved.append(block)
            out.append(resolved)
        return out
