"""The pool facade: vLLM's ``KVCacheManager`` plus the request table a remote pool needs.

:class:`KVCachePool` is the engine's one entry point. It composes three parts and
keeps the block operations (allocate, free, cache, evict, reset, stats, events,
snapshot, teardown) itself:

- :class:`~kvcoord.engine.request_table.RequestTable`: the fields vLLM's manager
  reads of each request, reported by the client with :meth:`KVCachePool.update_request`;
- :class:`~kvcoord.engine.hits.PrefixHits`: prefix-hit search, lookup statistics, and
  the checks on a hit handed back to :meth:`KVCachePool.allocate_slots`;
- the coordinator (:mod:`~kvcoord.engine.coordinators`) with its block pool and
  per-group managers.

Hot paths reach the parts through bound methods and the shared request dict taken
once in ``__init__``, so delegation costs no attribute lookup per block.

Every public method validates its input completely before changing anything, so a
raised :class:`~kvcoord.engine.errors.EngineError` leaves the pool as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence

from .config import KVCacheConfig, admission_cap_tokens
from .coordinators import get_kv_cache_coordinator
from .decode_run import DecodeColumns, decode_run, plain_values
from .errors import BlockNotRetainedError, FailedPreconditionError, InvalidArgumentError, RequestNotFoundError
from .events import KVCacheEvent
from .extra_keys import ExtraKeySources
from .hash_list import request_keys
from .hits import PrefixHits
from .managers import CrossAttentionManager, MambaManager, MambaManager033, SingleTypeKVCacheManager
from .managers.partial import CopyOnWrite, PartialMambaManager
from .profiles import rules_of
from .request import LoRA, Request
from .request_table import RequestTable, TokenIds, check_count
from .reservations import Reservation, Reservations
from .results import AllocationResult, BlockIds, CacheHit, PoolSnapshot, RequestCheckpoint
from .specs import FullAttentionSpec, MambaSpec
from .stats import LookupCounters, PrefixCacheStats

# The result types are re-exported: ``from kvcoord.engine.pool import CacheHit`` works.
__all__ = ["AllocationResult", "CacheHit", "KVCachePool", "PoolSnapshot", "RequestCheckpoint"]

#: Whether new pools answer a decode step inside its blocks without the general path
#: (:meth:`KVCachePool._decode_inside_blocks`); the tests turn it off to compare.
DECODE_FAST_PATH = True
#: The token sequences that fast path reads (anything else takes the general path).
_TOKEN_LISTS = (list, TokenIds, tuple)

_ALLOCATE_COUNT_NAMES = (
    "num_new_tokens",
    "num_new_computed_tokens",
    "num_lookahead_tokens",
    "num_external_computed_tokens",
    "num_encoder_tokens",
)


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
        #: the rules of the pool's semantics profile (vllm-0.16 or vllm-0.33)
        self.rules = rules_of(config.profile)
        self.coordinator = get_kv_cache_coordinator(config, materialize_blocks)
        self.block_pool = self.coordinator.block_pool
        self.managers = self.coordinator.managers
        self.enable_caching = config.enable_caching
        self.max_model_len = config.max_model_len
        self.hash_block_size = config.hash_block_size
        #: vllm-0.33 look-ahead hashes: the last this many tokens have no hash yet, so
        #: caching stops before them (vLLM 0.33 clamps caching at the hashed tokens)
        self._hash_lag = config.num_hash_lookahead_tokens
        #: what the caching calls hold back from the coordinator: the look-ahead tokens,
        #: unless the coordinator stops at the hashed tokens itself after rounding down
        #: (vllm-0.33 hybrids: clamping first would round a smaller count down)
        self._cache_lag = 0 if self.coordinator.caps_cache_at_hashes else self._hash_lag
        #: vLLM 0.33's re-prefillable tail (multi-module MTP, whose look-ahead L is the
        #: draft count): its coordinator caches only ``computed - (L - 1)`` tokens, the
        #: last L - 1 may be prefilled again (0 for L <= 1)
        self._reprefillable = max(0, self._hash_lag - 1)
        #: vllm-0.33's per-group admission caps (tokens), for the full-sequence gate
        self._admission_caps = admission_cap_tokens(config)
        self.request_table = RequestTable(config)
        self.hits = PrefixHits(config, self.coordinator, self.request_table)
        #: hits held against eviction for a router (none: exactly vLLM's manager)
        self.reservations = Reservations(self.block_pool, config.hash_block_size)
        #: The table's dict itself (never replaced), read directly by the hot paths.
        self.requests: dict[str, Request] = self.request_table.requests
        self.num_refusals = 0
        # The parts' methods, bound once: calling one costs what calling a method of
        # the pool's own did.
        self._get: Callable[[str], Request] = self.request_table.get
        self._update: Callable[[str, int | None, Sequence[int], Sequence[bytes]], None] = (
            self.request_table.update
        )
        self._lookup = self.hits.lookup
        self._search = self.hits.search
        self._record_lookup = self.hits.record_lookup
        self._resolve_hit = self.hits.resolve
        self._check_adoption = self.hits.check_adoption
        # Managers whose rules must be checked before any state changes (mamba align).
        self._prechecked_managers = [m for m in self.managers if isinstance(m, MambaManager) and m.align]
        # allocate_slots' fast path serves pools whose managers all allocate and cache by
        # the base rules (full, sliding window, chunked local).
        self._plain_managers = all(
            type(m).allocate_new_blocks is SingleTypeKVCacheManager.allocate_new_blocks
            and type(m).cache_blocks is SingleTypeKVCacheManager.cache_blocks
            and type(m).add_local_computed_blocks is SingleTypeKVCacheManager.add_local_computed_blocks
            and type(m).allocate_external_computed_blocks
            is SingleTypeKVCacheManager.allocate_external_computed_blocks
            and type(m).get_num_blocks_to_allocate is SingleTypeKVCacheManager.get_num_blocks_to_allocate
            for m in self.managers
        )
        if not self.coordinator.plain_caching or config.needs_kv_cache_zeroing:
            # vllm-0.33 hybrids and sliding windows cache through their coordinator
            # (round-down, retention masks); a zeroing pool records its new blocks
            self._plain_managers = False
        # Managers that may free blocks in remove_skipped_blocks (a skip rule).
        self._skipping_managers = [
            m
            for m in self.managers
            if type(m).get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens
            or type(m).remove_skipped_blocks is not SingleTypeKVCacheManager.remove_skipped_blocks
        ]
        self._no_new_blocks: BlockIds = tuple(() for _ in self.managers)
        #: update_and_allocate answers a decode step inside its blocks at once
        #: (:meth:`_decode_inside_blocks`); off only to test it against the general path
        self._decode_fast_path = (
            DECODE_FAST_PATH
            and self._plain_managers
            and all(
                type(m).remove_skipped_blocks is SingleTypeKVCacheManager.remove_skipped_blocks
                and type(m).skips_blocks is SingleTypeKVCacheManager.skips_blocks
                for m in self.managers
            )
        )
        #: vllm-0.33 mamba groups (per-step state, boundary-state hand-offs)
        self._mamba033 = [m for m in self.managers if isinstance(m, MambaManager033)]
        #: vllm-0.33 with mamba layers or needs_kv_cache_zeroing: the attention groups
        #: whose new block ids the worker zeroes (vLLM's ``take_new_block_ids``), and
        #: those ids per group
        self._zeroed_groups = (
            [i for i, spec in enumerate(config.groups) if not isinstance(spec, MambaSpec)]
            if self._mamba033 or config.needs_kv_cache_zeroing
            else []
        )
        self.pending_new_block_ids: list[list[int]] = [[] for _ in self.managers]
        #: vllm-0.33 fine-grained hits: the groups making copy-on-write pairs, and the
        #: ids of the copies' blocks taken but not released yet (each entry one reference)
        self._cow_managers: list[CopyOnWrite] = [m for m in self.managers if isinstance(m, CopyOnWrite)]
        self.retained: Counter[int] = Counter()
        #: evict_blocks was called: blocks may have lost their hash while shared
        self.evict_blocks_called = False
        # free/preempt fused over managers that free by the base rule (with whether their
        # lists can hold the null block); None when any manager has its own rule (its
        # own free, or per-request state to drop: its own pop_blocks_for_free).
        self._fused_free: list[tuple[SingleTypeKVCacheManager, bool]] | None = [
            (m, m.uses_null_blocks) for m in self.managers
        ]
        if any(
            type(m).free is not SingleTypeKVCacheManager.free
            or type(m).pop_blocks_for_free is not SingleTypeKVCacheManager.pop_blocks_for_free
            for m in self.managers
        ):
            self._fused_free = None

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
    ) -> None:
        """Report the scheduler's progress: computed tokens, then appended tokens.

        ``append_block_hashes`` are the hashes of blocks the appended tokens completed.
        Only the delta is checked, so a decode step costs O(1) whatever the request's
        length.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: counts, tokens or hashes that do not fit.
        """
        self._update(request_id, num_computed_tokens, append_token_ids, append_block_hashes)

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

    def lookup_hint(self, request_id: str, walk_limit: int = 4096) -> tuple[CacheHit, int]:
        """What :meth:`get_computed_blocks` would answer now, and the hit's eviction
        margin; records nothing.

        A client that is the pool's only user can keep answering the request's lookup
        with this hit while it can prove nothing changed it: no more than ``margin``
        blocks left the free queue (new blocks plus adopted hit blocks) and none of the
        request's hashes past the hit was cached since (see :meth:`check_lookup`).

        Args:
            walk_limit: the most free-queue positions to walk (the margin's cap).
        """
        return self.hits.hint(self._get(request_id), walk_limit)

    def check_lookup(
        self, request_id: str, answered: CacheHit | Sequence[Sequence[int]], num_tokens: int
    ) -> CacheHit:
        """:meth:`get_computed_blocks` for a lookup the client already answered with
        ``answered`` (``num_tokens`` long): the same search and statistics, but a
        different hit raises instead of being returned.

        Raises:
            HintMismatchError: the pool's hit differs; nothing is recorded.
        """
        req = self._get(request_id)
        hit = (
            answered if isinstance(answered, CacheHit) else CacheHit(tuple(map(tuple, answered)), num_tokens)
        )
        return self.hits.check_answered(req, hit)

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
        return self.hits.find_longest_cache_hit(block_hashes, num_tokens, cache_namespace)

    # -- reservations (routers) ---------------------------------------------------------
    def reserve(
        self, reservation_id: str, block_hashes: Sequence[bytes], num_tokens: int, cache_namespace: str = ""
    ) -> CacheHit:
        """:meth:`find_longest_cache_hit`, then hold the hit's blocks against eviction
        until a request of this prompt adopts them (:meth:`adopt_reservation`) or
        :meth:`release_reservation`. An empty hit holds nothing and is not kept.

        Raises:
            InvalidArgumentError: as :meth:`find_longest_cache_hit`, or the id is live.
        """
        if reservation_id in self.reservations.live:
            raise InvalidArgumentError(f"reservation {reservation_id!r} already exists")
        hit = self.hits.find_longest_cache_hit(block_hashes, num_tokens, cache_namespace)
        if hit.num_tokens:
            # a hit means the namespace has cached blocks, so it has its prefix already
            prefix = self.cache_namespaces[cache_namespace] if cache_namespace else b""
            held: Sequence[Sequence[int]] = hit.block_ids
            if self.config.use_eagle:
                keys = request_keys(block_hashes, prefix)
                held = self.hits.cached_under(keys, self.hits.eagle_reach(keys, num_tokens))
            self.reservations.hold(reservation_id, hit, held, prefix, block_hashes, num_tokens)
        return hit

    def release_reservation(self, reservation_id: str) -> bool:
        """End a reservation no request adopted; ``False`` when it is not live."""
        return self.reservations.expire(reservation_id)

    def adopt_reservation(self, request_id: str, got_tokens: int) -> Reservation | None:
        """The request made its first allocation with a hit of ``got_tokens``: release
        the oldest reservation made for its prompt (same namespace, hashes and token
        count; call after the allocation, so blocks it shares keep their place)."""
        req = self._get(request_id)
        return self.reservations.adopt(req.cache_prefix, req.block_hashes, req.num_tokens, got_tokens)

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
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
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
            full_sequence_must_fit: (vllm-0.33 only) refuse, changing nothing, unless
                the request's whole sequence fits (vLLM 0.33's admission gate).
            reserved_blocks: (vllm-0.33 only) free blocks the allocation must leave
                for other in-flight requests.
            num_in_flight_tokens: (vllm-0.33 only) the request's computed tokens still in
                flight (an asynchronous scheduler's or a batch queue's steps whose output
                is not applied yet): blocks leave a window on the processed-token basis,
                ``computed - in flight``, as vLLM 0.33 frees them.
            watermark_blocks: (vllm-0.33 only) vLLM 0.33's watermark: free blocks the
                allocation must leave besides ``reserved_blocks``, in the full-sequence
                gate too (the caller sends 0 unless vLLM 0.33 would apply it: a waiting
                or preempted request while another is already scheduled).
            skip_zeroing_group_ids: (vllm-0.33 only) groups whose blocks for
                ``num_external_computed_tokens`` an asynchronous load writes: they are
                not recorded for zeroing (:meth:`take_new_block_ids`), as vLLM 0.33's
                ``skip_zeroing_group_ids``.

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
        if new_computed_blocks is None and not skip_zeroing_group_ids and self._plain_call(
            req, num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
            delay_cache_blocks, num_encoder_tokens, full_sequence_must_fit, reserved_blocks, num_in_flight_tokens, watermark_blocks,
        ):  # fmt: skip
            return self._allocate_without_hit(req, num_new_tokens, num_lookahead_tokens)
        counts = (num_new_tokens, num_new_computed_tokens, num_lookahead_tokens, num_external_computed_tokens,
                  num_encoder_tokens)  # fmt: skip
        if not all(type(v) is int and v >= 0 for v in counts):  # fast path; the loop names the culprit
            for name, value in zip(_ALLOCATE_COUNT_NAMES, counts, strict=True):
                check_count(value, name)
        if not isinstance(delay_cache_blocks, bool):
            raise InvalidArgumentError("delay_cache_blocks must be a bool")
        if not isinstance(full_sequence_must_fit, bool):
            raise InvalidArgumentError("full_sequence_must_fit must be a bool")
        check_count(reserved_blocks, "reserved_blocks")
        check_count(num_in_flight_tokens, "num_in_flight_tokens")
        check_count(watermark_blocks, "watermark_blocks")
        if (
            full_sequence_must_fit or reserved_blocks or num_in_flight_tokens or watermark_blocks
        ) and not self.rules.full_sequence_admission:
            raise InvalidArgumentError(
                "full_sequence_must_fit, reserved_blocks, num_in_flight_tokens and watermark_blocks are "
                f"vLLM 0.33 inputs; "
                f"this pool's profile is {self.config.profile}"
            )
        skip_zeroing = self._check_skip_zeroing(skip_zeroing_group_ids)
        if num_new_tokens == 0 and num_external_computed_tokens == 0:
            # vLLM 0.31+ also lets a step adopt a local hit with no new token.
            if not (self.rules.full_sequence_admission and num_new_computed_tokens):
                raise InvalidArgumentError(
                    "num_new_tokens must be > 0 unless num_external_computed_tokens is > 0"
                )
        if num_external_computed_tokens and self._cow_managers:
            raise FailedPreconditionError(
                "external (KV connector) tokens in a pool with fine-grained (partial) prefix hits "
                "are not supported yet"
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
        # vLLM 0.33's prefill end (mamba prefill checkpoints): resumed requests replay outputs
        prefill_end = max(req.num_prompt_tokens, req.num_tokens - 1)
        for manager in self._prechecked_managers:
            reason = manager.check_allocation(request_id, main, total, prefill_end)
            if reason is not None:
                raise FailedPreconditionError(f"group {manager.group_id}: {reason}")

        coordinator = self.coordinator
        if full_sequence_must_fit:
            # vLLM 0.33's gate, before anything is released: the whole sequence must fit.
            full = min(req.num_tokens, self.max_model_len)
            k = coordinator.get_num_blocks_to_allocate(
                request_id,
                full,
                hit_blocks,
                num_encoder_tokens,
                local + num_external_computed_tokens,
                full,
                self._admission_caps,
                prefill_end,
            )
            if k + watermark_blocks > self.block_pool.get_num_free_blocks():
                self.num_refusals += 1
                return None
        # vLLM 0.33 frees on the processed-token basis (steps in flight still read the window)
        coordinator.remove_skipped_blocks(request_id, max(0, total - num_in_flight_tokens))
        k = coordinator.get_num_blocks_to_allocate(
            request_id,
            need,
            hit_blocks,
            num_encoder_tokens,
            local + num_external_computed_tokens,
            main,
            prefill_end=prefill_end,
        )
        if k + watermark_blocks > self.block_pool.get_num_free_blocks() - reserved_blocks:
            self.num_refusals += 1
            return None
        if any(hit_blocks) or num_external_computed_tokens > 0:
            first_adoption = (
                self._zeroed_groups
                and num_external_computed_tokens > 0
                and not any(coordinator.get_blocks(request_id))
            )
            coordinator.allocate_new_computed_blocks(
                request_id, hit_blocks, local, num_external_computed_tokens
            )
            if first_adoption:  # blocks for the external tokens are zeroed too (unless loaded)
                for gid in self._zeroed_groups:
                    if gid in skip_zeroing:
                        continue
                    m = self.managers[gid]
                    held = m.req_to_blocks.get(request_id, ())
                    self.pending_new_block_ids[gid].extend(
                        b.block_id for b in held[m.num_cached_block.get(request_id, 0) :]
                    )
        new = coordinator.allocate_new_blocks(request_id, need, main, num_encoder_tokens)
        for gid in self._zeroed_groups:
            self.pending_new_block_ids[gid].extend(b.block_id for b in new[gid])
        if self.enable_caching and not delay_cache_blocks:
            self._cache_finalized(req, min(total + num_new_tokens, req.num_tokens))
        return tuple([tuple([b.block_id for b in lst]) for lst in new])

    def _check_skip_zeroing(self, group_ids: Sequence[int]) -> frozenset[int]:
        """``allocate_slots``' ``skip_zeroing_group_ids``, checked: group ids of this
        pool, vllm-0.33 only."""
        if not group_ids:
            return frozenset()
        if not self.rules.full_sequence_admission:
            raise InvalidArgumentError(
                f"skip_zeroing_group_ids is a vLLM 0.33 input; this pool's profile is {self.config.profile}"
            )
        for gid in group_ids:
            if type(gid) is not int or not 0 <= gid < len(self.managers):
                raise InvalidArgumentError(
                    f"skip_zeroing_group_ids: {gid!r} is not a group of this pool (0..{len(self.managers) - 1})"
                )
        return frozenset(group_ids)

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
        for m in self._skipping_managers:
            m.remove_skipped_blocks(rid, total)
        if self._num_to_take(rid, need, total, main) > self.block_pool.free_block_queue.num_free_blocks:
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
            num_tokens = len(req.all_token_ids) - self._hash_lag
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
    ) -> BlockIds | None:
        """:meth:`update_request` then :meth:`allocate_slots` without a hit, in one call
        (a running request's step, above all a decode): the same checks and the same
        answer. A refused update changes nothing; an allocation that raises takes the
        update back with it. A ``None`` answer (too few free blocks) keeps the update,
        as the two calls would. ``num_computed_tokens`` ``None`` leaves the count as it is.
        A decode step inside the request's blocks is answered without either call
        (:meth:`_decode_inside_blocks`: the same state and answer).

        Raises:
            RequestNotFoundError, InvalidArgumentError, FailedPreconditionError: as the
                two calls raise them.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        if self._decode_fast_path and self._decode_inside_blocks(
            req,
            num_computed_tokens,
            append_token_ids,
            append_block_hashes,
            num_new_tokens,
            num_lookahead_tokens,
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
        caller's ``_decode_fast_path``): there the general path is
        :meth:`_allocate_without_hit`, whose every step this checks.
        """
        if type(append_token_ids) not in _TOKEN_LISTS or len(append_token_ids) != 1:
            return False
        token = append_token_ids[0]
        tokens = req.all_token_ids
        have = len(tokens)
        max_len = self.max_model_len
        computed = req.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        if have >= max_len or not plain_values(1, token, computed, num_new_tokens, num_lookahead_tokens):
            return False  # (at max_model_len: the token would pass it)
        main = computed + num_new_tokens
        if main > max_len:
            return False
        need = main + num_lookahead_tokens
        if need > max_len:
            need = max_len
        rid = req.request_id
        caching = self.enable_caching
        if caching:
            hashed = have + 1 - self._hash_lag
            if append_block_hashes or (hashed if hashed > 0 else 0) // self.hash_block_size != len(
                req.block_hashes
            ):
                return False  # a block hash due (or one too many): the general path checks it
            cached = main if main < hashed else hashed
        else:
            cached = 0
        if not self._changes_nothing(rid, computed, need, cached):
            return False
        req.num_computed_tokens = computed
        tokens.append(token)
        return True

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
        bp = self.block_pool
        if self._num_to_take(rid, need, total, main) > bp.free_block_queue.num_free_blocks:
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
            num_tokens = len(req.all_token_ids) - self._hash_lag
            self._cache_full_blocks(req, main if main < num_tokens else num_tokens)
        return result

    def _cache_full_blocks(self, req: Request, cached: int) -> None:
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

    def _num_to_take(self, rid: str, need: int, total: int, main: int) -> int:
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
        hashed = num_tokens - self._hash_lag
        cached = main if main < hashed else hashed
        return self._changes_nothing(request_id, num_computed_tokens, need, cached)

    def _changes_nothing(self, request_id: str, num_computed_tokens: int, need: int, cached: int) -> bool:
        """Whether an allocation of a request with ``num_computed_tokens`` computed that
        needs slots for ``need`` tokens and caching up to ``cached`` tokens (used only
        when caching is on) leaves every group as it is: no block leaving a window, every
        group's blocks covering ``need``, every full block up to ``cached`` cached."""
        for m in self._skipping_managers:
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

    def allocate_slots_with_lookup(
        self,
        request_id: str,
        max_num_new_tokens: int,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        num_in_flight_tokens: int = 0,
        watermark_blocks: int = 0,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> AllocationResult:
        """Look up the prefix and allocate in one step, so the hit cannot go stale.

        Does what vLLM's scheduler does for a waiting request:
        ``num_new_tokens = min(num_tokens - hit - external, max_num_new_tokens)``.
        In a vllm-0.33 pool the lookup is counted in the statistics only when the
        allocation succeeds (vLLM 0.33 counts admissions).

        Raises:
            FailedPreconditionError: the request already holds blocks or has
                computed tokens (only a waiting request looks up its prefix).
            InvalidArgumentError: see :meth:`allocate_slots`.
        """
        req = self._get(request_id)
        check_count(max_num_new_tokens, "max_num_new_tokens")
        check_count(num_external_computed_tokens, "num_external_computed_tokens")
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
            req.shared_prefix_boundary = 0
        else:
            hit, lists = self._search(
                request_keys(req.block_hashes, req.cache_prefix), len(req.all_token_ids)
            )
            self.hits.note_junction(req, hit.num_tokens)
        num_new = min(req.num_tokens - hit.num_tokens - num_external_computed_tokens, max_num_new_tokens)
        if num_new < 0:
            num_new = 0
        # vllm-0.33, a "full" report-mode request: its lookup's events come before the
        # allocation's, and only once the allocation did not raise (refused: kept)
        hit_events = self.hits.hit_events(req, hit) if lists is not None else []
        queued = len(self.block_pool.kv_event_queue)
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
                full_sequence_must_fit,
                reserved_blocks,
                num_in_flight_tokens,
                watermark_blocks,
                skip_zeroing_group_ids,
            )
        except Exception:
            req.last_hit = last_hit
            raise
        if hit_events:
            self.block_pool.kv_event_queue[queued:queued] = hit_events
        if lists is not None:
            self._record_lookup(req, hit, lists)
            req.last_hit = fresh
            if new is not None and self.rules.stats_at_admission:
                self.hits.record_admission(req, hit.num_tokens)
        return AllocationResult(hit, num_new, new)

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        """vLLM 0.33's ``record_prefix_cache_stats``: count an admitted request's lookup
        (``num_hits`` tokens found) in the prefix-cache statistics. Nothing for a request
        that skips reading the cache, with caching off, or without statistics.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: a bad count.
            FailedPreconditionError: the pool's profile counts at lookup (vllm-0.16).
        """
        req = self._get(request_id)
        check_count(num_hits, "num_hits")
        if not self.rules.stats_at_admission:
            raise FailedPreconditionError(
                f"this pool's profile ({self.config.profile}) records statistics at each lookup; "
                "record_prefix_cache_stats is a vllm-0.33 call"
            )
        if self.enable_caching and not req.skip_reading_prefix_cache:
            self.hits.record_admission(req, num_hits)

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        num_encoder_tokens: int = 0,
    ) -> int:
        """vLLM 0.33's ``coordinator.get_num_blocks_to_allocate`` with no new hit: the
        free blocks the request would still take to hold ``num_tokens`` (its scheduler
        sums them into ``reserved_blocks``). Changes nothing, except as vLLM 0.33 does
        without ``apply_admission_cap``: a mamba group plans its prefill checkpoint.

        Raises:
            RequestNotFoundError: unknown request.
            InvalidArgumentError: bad counts.
            FailedPreconditionError: a vllm-0.16 pool (vLLM 0.16 has no such call).
        """
        req = self._get(request_id)
        for name, value in (("num_tokens", num_tokens), ("total_computed_tokens", total_computed_tokens),
                            ("num_tokens_main_model", num_tokens_main_model),
                            ("num_encoder_tokens", num_encoder_tokens)):  # fmt: skip
            check_count(value, name)
        if not self.rules.full_sequence_admission:
            raise FailedPreconditionError(
                f"get_num_blocks_to_allocate is a vllm-0.33 call; this pool's profile is {self.config.profile}"
            )
        return self.coordinator.get_num_blocks_to_allocate(
            request_id,
            num_tokens,
            [[] for _ in self.managers],
            num_encoder_tokens,
            total_computed_tokens,
            num_tokens_main_model,
            self._admission_caps if apply_admission_cap else None,
            max(req.num_prompt_tokens, req.num_tokens - 1),
        )

    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> BlockIds:
        """vLLM 0.33's ``get_block_ids_for_computed_tokens``: the request's table with
        each attention group cut to the blocks covering ``num_computed_tokens``
        (cross-attention groups whole)."""
        table = self.get_block_ids(request_id)
        check_count(num_computed_tokens, "num_computed_tokens")
        return tuple(
            ids if isinstance(m, CrossAttentionManager) else ids[: -(-num_computed_tokens // m.block_size)]
            for m, ids in zip(self.managers, table, strict=True)
        )

    def shared_prefix_boundary(self, request_id: str) -> int:
        """vLLM 0.33's third ``get_computed_blocks`` result, kept on the request by its
        last lookup: where a shared prefix ends that a sparse (sliding-window) group has
        not cached, or 0. Always 0 outside vllm-0.33 hybrid pools."""
        return self._get(request_id).shared_prefix_boundary

    def new_step_starts(self) -> None:
        """vLLM 0.33's ``new_step_starts`` (the scheduler calls it at every step): a
        mamba group's hits on blocks cached during the step that ends become usable.
        Nothing changes in pools without mamba groups."""
        for m in self._mamba033:
            m.new_step_starts()

    def _require_033(self, call: str) -> None:
        if not self.rules.full_sequence_admission:
            raise FailedPreconditionError(
                f"{call} is a vllm-0.33 call; this pool's profile is {self.config.profile}"
            )

    def take_new_block_ids(self) -> list[int]:
        """vLLM 0.33's ``take_new_block_ids``: the ids of blocks attention groups took
        since the last call, for the worker to zero (group order, then allocation
        order). Only pools with mamba groups or ``needs_kv_cache_zeroing`` record them
        (vLLM zeroes for mamba models and mixed-precision KV caches); the others answer
        an empty list.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_new_block_ids")
        out: list[int] = []
        for gid in self._zeroed_groups:
            out.extend(self.pending_new_block_ids[gid])
            self.pending_new_block_ids[gid] = []
        return out

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """vLLM 0.33's ``take_boundary_state_offloads``: per request, the mamba state
        blocks hashed since the last call, as ``(group, block id, boundary tokens)``
        (a KV connector offloads them); requests freed since are left out.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_boundary_state_offloads")
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self._mamba033:
            for rid, gid, block, tokens in m.take_boundary_state_offloads():
                out.setdefault(rid, []).append((gid, block.block_id, tokens))
        return out

    def drop_boundary_state_offloads(self, request_id: str) -> None:
        """The part of vLLM 0.33's ``pop_blocks_for_free`` (a KV-consumer connector with
        overlapping steps: the free is deferred) that cannot wait for the deferred
        :meth:`free`: the request's boundary-state hand-offs not taken yet are dropped
        now (vLLM's scheduler drains them every step). Its blocks stay held.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
        """
        self._require_033("drop_boundary_state_offloads")
        self._get(request_id)
        for m in self._mamba033:
            m.drop_boundary_state_offloads(request_id)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM 0.33's ``record_blocks_for_zeroing`` (its scheduler calls it in a pool
        that zeroes new blocks when an asynchronous KV load failed but left valid
        computed tokens): the request's blocks from the one starting at ``start_token``
        on, in every group that records new block ids, are recorded again for
        :meth:`take_new_block_ids` (the failed load left them unwritten), as vLLM
        records them: every block the request holds there, a window's null blocks
        (id 0) included. A pool that records nothing records nothing here.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
            InvalidArgumentError: ``start_token`` not a count, or not a multiple of a
                recording group's block size (vLLM asserts it: zeroing a block would
                wipe its valid prefix); nothing is recorded then.
        """
        self._require_033("record_blocks_for_zeroing")
        self._get(request_id)
        check_count(start_token, "start_token")
        for gid in self._zeroed_groups:
            if start_token % self.managers[gid].block_size:
                raise InvalidArgumentError(
                    f"record_blocks_for_zeroing: start_token {start_token} is not a multiple of "
                    f"group {gid}'s block size {self.managers[gid].block_size}"
                )
        for gid in self._zeroed_groups:
            m = self.managers[gid]
            held = m.req_to_blocks.get(request_id, ())
            self.pending_new_block_ids[gid].extend(b.block_id for b in held[start_token // m.block_size :])

    def take_kv_cache_block_copies(self) -> tuple[list[tuple[int, int]], list[int]]:
        """vLLM 0.33's ``take_kv_cache_block_copies``: the copy-on-write pairs
        ``(source, destination)`` made since the last call (group order, then the order
        they were made) and the ids of their blocks, each pair's source then its
        destination. The worker runs the copies in the step they are handed to; each id
        listed holds one reference (*retained*) until :meth:`release_retained_blocks`
        returns it. Only pools with fine-grained (partial) hits make copies (see
        :attr:`KVCacheConfig.partial_hash_hits`); the others answer empty lists.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
        """
        self._require_033("take_kv_cache_block_copies")
        copies: list[tuple[int, int]] = []
        retained: list[int] = []
        for m in self._cow_managers:
            for source, target in m.take_pending_cow_copies():
                copies.append((source.block_id, target.block_id))
                retained += (source.block_id, target.block_id)
        self.retained.update(retained)
        return copies, retained

    def release_retained_blocks(self, block_ids: Sequence[int]) -> None:
        """vLLM 0.33's ``block_pool.free_blocks(retained)`` once the copies ran: drop
        one retained reference per listed id, in order (a block reaching no reference
        goes to the free queue as any freed block). The ids must be ones
        :meth:`take_kv_cache_block_copies` handed out and not released yet (an id as
        many times as it is retained at most); otherwise nothing changes.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            InvalidArgumentError: an id is not an integer.
            BlockNotRetainedError: an id is not retained (that many times).
        """
        self._require_033("release_retained_blocks")
        ids = list(block_ids)
        for bid in ids:
            check_count(bid, "block id")
        wanted = Counter(ids)
        for bid, n in wanted.items():
            if self.retained[bid] < n:
                held = self.retained[bid]
                raise BlockNotRetainedError(
                    f"block {bid} is released {n} time(s) but retained {held} time(s): only ids "
                    "from take_kv_cache_block_copies not released yet can be released"
                )
        self.retained.subtract(wanted)
        self.retained += Counter()  # drop the ids at zero
        blocks = self.block_pool.blocks
        self.block_pool.free_blocks([blocks[bid] for bid in ids])

    def drop_block_copies(self) -> int:
        """The copy-on-write pairs' references end with the session that made them (its
        scheduler will never run the copies nor release the blocks): drop the pairs not
        taken yet and every retention, each reference returned as
        :meth:`release_retained_blocks` returns it, in ascending block id order (so a
        pool restored from its exported state drops them alike). Pools without
        fine-grained hits hold none: nothing changes.

        Returns:
            the number of references dropped.
        """
        for m in self._cow_managers:
            for source, target in m.take_pending_cow_copies():
                self.retained.update((source.block_id, target.block_id))
        if not self.retained:
            return 0
        blocks = self.block_pool.blocks
        ids = sorted(self.retained.elements())
        self.retained.clear()
        self.block_pool.free_blocks([blocks[bid] for bid in ids])
        return len(ids)

    def finalize_partial_tail_offloads(
        self, request_id: str, num_computed_tokens: int, num_in_flight_tokens: int = 0
    ) -> list[tuple[int, int, int]]:
        """vLLM 0.33's ``finalize_partial_tail_offloads`` (a KV producer's request
        finishing): per mamba group that made the request a producer of a partial tail
        and saw it stop exactly at that boundary with nothing in flight, ``(group,
        block id, boundary tokens)``; the producer records are consumed. Call it before
        :meth:`free`.

        Raises:
            FailedPreconditionError: a vllm-0.16 pool.
            RequestNotFoundError: unknown request.
        """
        self._require_033("finalize_partial_tail_offloads")
        self._get(request_id)
        out: list[tuple[int, int, int]] = []
        for m in self.managers:
            if isinstance(m, PartialMambaManager):
                got = m.finalize_partial_tail_offload(request_id, num_computed_tokens, num_in_flight_tokens)
                if got is not None:
                    out.append((got[0], got[1].block_id, got[2]))
        return out

    def estimate_cached_tokens(self, request_id: str) -> int:
        """vLLM 0.33's ``estimate_cached_tokens``: per prefix-cacheable group, the end of
        the request's furthest block that holds a hash; the smallest over the groups
        (0 when caching is off or no group counts)."""
        self._get(request_id)
        if not self.enable_caching:
            return 0
        out: int | None = None
        for m in self.managers:
            if isinstance(m, CrossAttentionManager):
                continue
            blocks = m.req_to_blocks.get(request_id) or ()
            partial = self.block_pool.partial_tokens
            end = 0
            for i in range(len(blocks) - 1, -1, -1):
                if blocks[i].cached_hash is not None and not blocks[i].is_null:
                    end = partial.get(blocks[i].block_id, (i + 1) * m.block_size)
                    break
            out = end if out is None else min(out, end)
        return out or 0

    def free(self, request_id: str, all_groups_reversed: bool = False) -> None:
        """Release the request's blocks (tail first, group order) and forget it.

        ``all_groups_reversed`` (vllm-0.33 only): the order of vLLM 0.33's deferred
        free (``pop_blocks_for_free`` then ``block_pool.free_blocks(reversed(...))``, a
        KV-consumer connector with overlapping steps): all groups' blocks concatenated
        in group order (each group's leading nulls left out), released in one reversed
        pass. The same as the plain order for one group. A mamba group drops its
        per-request state as its plain free does; its pending boundary-state hand-offs
        were dropped when vLLM took the blocks (:meth:`drop_boundary_state_offloads`).

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
        if all_groups_reversed and len(self.managers) > 1:
            self.coordinator.free_all_groups_reversed(request_id)
            return
        self._release(request_id)

    def preempt(self, request_id: str) -> None:
        """Release the request's blocks but keep it: computed tokens go back to 0 and its
        later lookups count as preempted."""
        req = self._get(request_id)
        self._release(request_id)
        req.num_computed_tokens = 0
        req.num_preemptions += 1

    def cache_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Make the request's full blocks up to ``num_computed_tokens`` hittable
        (after a delayed external load)."""
        req = self._get(request_id)
        check_count(num_computed_tokens, "num_computed_tokens")
        if num_computed_tokens > req.num_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens {num_computed_tokens} exceeds the request's {req.num_tokens} tokens"
            )
        if not self.enable_caching:
            return
        hashed = min(max(0, num_computed_tokens - self._reprefillable), req.num_tokens - self._hash_lag)
        for m in self.managers:
            full = hashed // m.block_size
            held = len(m.req_to_blocks.get(request_id, ()))
            if full > m.num_cached_block.get(request_id, 0) and full > held:
                raise FailedPreconditionError(
                    f"group {m.group_id}: caching {full} blocks but request {request_id!r} holds only {held}"
                )
        self._cache_finalized(req, num_computed_tokens)

    def _cache_finalized(self, req: Request, num_tokens: int) -> None:
        """The coordinator caches the request's blocks up to ``num_tokens`` less the
        re-prefillable tail, and short of the tokens not hashed yet."""
        self.coordinator.cache_blocks(
            req, min(max(0, num_tokens - self._reprefillable), req.num_tokens - self._cache_lag)
        )

    def remove_skipped_blocks(self, request_id: str, total_computed_tokens: int) -> None:
        """Free blocks that attention no longer reads after ``total_computed_tokens``."""
        self._get(request_id)
        check_count(total_computed_tokens, "total_computed_tokens")
        if total_computed_tokens > self.max_model_len:
            raise InvalidArgumentError(
                f"total_computed_tokens {total_computed_tokens} exceeds max_model_len {self.max_model_len}"
            )
        self.coordinator.remove_skipped_blocks(request_id, total_computed_tokens)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cached hash of each block (KV connector load failures)."""
        ids = list(block_ids)
        for bid in ids:
            check_count(bid, "block id")
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

    def teardown(self, chunk: int = 16_384) -> Iterator[None]:
        """Release the pool's objects a slice at a time, yielding after each slice.

        A caller on an event loop steps through it between other work, so deleting a
        pool whose millions of blocks were used never stalls anything for long (each
        slice frees at most ``chunk`` objects, or one request: its block hashes). The
        pool is unusable afterwards.
        """
        for m in self.managers:
            tables = m.req_to_blocks
            while tables:
                tables.popitem()[1].clear()
                yield
        requests = self.requests
        while requests:
            requests.popitem()
            yield
        yield from self.block_pool.teardown(chunk)

    def take_events(self) -> list[KVCacheEvent]:
        """KV events queued since the last call, oldest first."""
        return self.block_pool.take_events()

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics lookups record into now (``None`` unless the config logs
        stats). Settable: the service swaps in a session's own object for a step."""
        return self.hits.prefix_cache_stats

    @prefix_cache_stats.setter
    def prefix_cache_stats(self, stats: PrefixCacheStats | None) -> None:
        self.hits.prefix_cache_stats = stats

    @property
    def lookup_counters(self) -> LookupCounters:
        """Lifetime lookup counters (never reset)."""
        return self.hits.lookup_counters

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The statistics since the last call; counting starts again from zero."""
        hits = self.hits
        if hits.prefix_cache_stats is None:
            return None
        stats, hits.prefix_cache_stats = hits.prefix_cache_stats, PrefixCacheStats()
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
        if self.rules.common_prefix_zeros:
            return (0,) * len(self.managers)
        return tuple(self.coordinator.get_num_common_prefix_blocks(request_id))

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def free_and_usage(self) -> tuple[int, float]:
        """:attr:`num_free_blocks` and :attr:`usage` in one read (a router's score)."""
        return self.block_pool.free_and_usage()

    def cached_block_ids(self) -> list[int]:
        """Ids of the blocks that currently hold a prefix-cache hash, ascending."""
        return self.block_pool.cached_block_ids()

    def free_queue_head(self, limit: int | None = None) -> list[int]:
        """Free block ids from the next to be reused, at most ``limit``."""
        return self.block_pool.free_block_queue.head_ids(limit)

    def replica_state(self) -> tuple[int, list[int], list[tuple[bytes, int]]] | str:
        """What a client replica of this pool starts from: the first never-used block,
        the used free blocks (head first) and the prefix-cache map as ``(hash, block)``
        pairs in its order (keys in insertion order, then each key's blocks); or, when
        a replica cannot be exact, why.

        A replica is exact for a pool of one full-attention group (no sink) whose block
        size is the hash block size, that holds no request and caches under no
        namespace: every cached block's key is then its hash.
        """
        specs = self.config.groups
        spec = specs[0] if len(specs) == 1 else None
        if not isinstance(spec, FullAttentionSpec) or spec.sink_len:
            return "the pool is not one group of full attention without a sink"
        if spec.block_size != self.config.hash_block_size:
            return "the pool's block size is not its hash block size"
        if self.config.use_eagle:
            return "the pool uses EAGLE drafts (a hit drops its last block)"
        if self.config.profile != "vllm-0.16":
            return f"the pool's profile is {self.config.profile} (replicas follow vllm-0.16 only)"
        if self.requests:
            return "the pool holds requests"
        if self.reservations.live:
            return "the pool holds reservations"
        if self.cache_namespaces:
            return "the pool caches under tenants' namespaces"
        queue = self.block_pool.free_block_queue
        fresh = queue.next_fresh
        used = queue.head_ids()[self.config.num_blocks - fresh :]
        cache = self.block_pool.cached_block_hash_to_block
        first, more = cache.first[0], cache._more[0]
        pairs: list[tuple[bytes, int]] = []
        for block_hash, block_id in first.items():
            later = more.get(block_hash)
            pairs.extend((block_hash, b) for b in (later if later is not None else (block_id,)))
        return fresh, used, pairs

    def snapshot(self) -> PoolSnapshot:
        """A complete, comparable copy of the pool's observable state."""
        bp = self.block_pool
        managers = []
        for m in self.managers:
            extra: tuple[object, ...] = ()
            if isinstance(m, MambaManager):
                extra = (sorted(m.allocated_block_reqs), sorted(m.last_state_block_idx.items()))
            if isinstance(m, MambaManager033):
                extra += (
                    sorted(m.num_retired_blocks.items()),
                    sorted(m.cached_this_step),
                    tuple((r, g, b.block_id, t) for r, g, b, t in m.pending_offloads),
                    tuple(sorted(m.checkpoints.items())),
                )
            if isinstance(m, CopyOnWrite):
                extra += (
                    tuple(sorted((r, i, b.block_id) for r, (i, b) in m.partial_hit_reqs.items())),
                    tuple((a.block_id, b.block_id) for a, b in m.pending_cow),
                )
            if isinstance(m, PartialMambaManager):
                extra += (tuple(sorted((r, b.block_id, t) for r, (b, t) in m.producer_tails.items())),)
            if self._zeroed_groups:
                extra += (tuple(self.pending_new_block_ids[m.group_id]),)
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
            requests=self.request_table.snapshot(),
            managers=tuple(managers)
            + ((tuple(sorted(self.retained.items())),) if self._cow_managers else ()),
            pending_events=tuple(bp.kv_event_queue),
            stats=self.peek_prefix_cache_stats(),
        )

    # -- internals --------------------------------------------------------------------
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
