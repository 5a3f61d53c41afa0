"""The pool's parts, built once: what every role of :class:`~kvcoord.engine.pool.KVCachePool` reads.

:class:`PoolParts` composes the request table
(:class:`~kvcoord.engine.request_table.RequestTable`), the prefix-hit search
(:class:`~kvcoord.engine.hits.PrefixHits`), the coordinator
(:mod:`~kvcoord.engine.coordinators`) with its block pool and per-group managers, and
the reservations; and derives, once, what the hot paths test per call (which fused
paths the pool's managers allow, the vllm-0.33 groups). Each role of the pool is a
class of its own module built on it (see :mod:`kvcoord.engine.pool`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from .config import KVCacheConfig, admission_cap_tokens
from .coordinators import get_kv_cache_coordinator
from .errors import FailedPreconditionError
from .hits import PrefixHits
from .managers import MambaManager, MambaManager033, SingleTypeKVCacheManager
from .managers.partial import CopyOnWrite
from .profiles import rules_of
from .request import Request
from .request_table import RequestTable
from .reservations import Reservations
from .results import BlockIds
from .specs import MambaSpec

#: Whether new pools answer a decode step inside its blocks without the general path
#: (:meth:`~kvcoord.engine.pool.KVCachePool._decode_inside_blocks`); the tests turn it
#: off to compare.
DECODE_FAST_PATH = True


class PoolParts:
    """The parts of one pool and the facts derived from them (see the module)."""

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
        self.hash_lag = config.num_hash_lookahead_tokens
        #: what the caching calls hold back from the coordinator: the look-ahead tokens,
        #: unless the coordinator stops at the hashed tokens itself after rounding down
        #: (vllm-0.33 hybrids: clamping first would round a smaller count down)
        self._cache_lag = 0 if self.coordinator.caps_cache_at_hashes else self.hash_lag
        #: vLLM 0.33's re-prefillable tail (multi-module MTP, whose look-ahead L is the
        #: draft count): its coordinator caches only ``computed - (L - 1)`` tokens, the
        #: last L - 1 may be prefilled again (0 for L <= 1)
        self._reprefillable = max(0, self.hash_lag - 1)
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
        if not self.coordinator.plain_caching or config.needs_kv_cache_zeroing or self._reprefillable:
            # vllm-0.33 hybrids and sliding windows cache through their coordinator
            # (round-down, retention masks); a zeroing pool records its new blocks; a
            # re-prefillable tail (L > 1) is held back from caching by the general path
            # alone (the fused paths cached up to the hashed tokens)
            self._plain_managers = False
        # Managers that may free blocks in remove_skipped_blocks (a skip rule).
        self.skipping_managers = [
            m
            for m in self.managers
            if type(m).get_num_skipped_tokens is not SingleTypeKVCacheManager.get_num_skipped_tokens
            or type(m).remove_skipped_blocks is not SingleTypeKVCacheManager.remove_skipped_blocks
        ]
        #: the pool's one manager when it is alone and skips no blocks (the common
        #: layout: :meth:`~kvcoord.engine.pool.KVCachePool.decode_token` checks it
        #: inline, :meth:`~kvcoord.engine.pool.KVCachePool.decode_step` takes only it)
        self._lone_manager: SingleTypeKVCacheManager | None = (
            self.managers[0] if len(self.managers) == 1 and not self.skipping_managers else None
        )
        self._no_new_blocks: BlockIds = tuple(() for _ in self.managers)
        #: update_and_allocate answers a decode step inside its blocks at once
        #: (:meth:`_decode_inside_blocks`); off only to test it against the general path
        self.decode_fast_path = (
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
        self.cow_managers: list[CopyOnWrite] = [m for m in self.managers if isinstance(m, CopyOnWrite)]
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

    def _require_033(self, call: str) -> None:
        if not self.rules.full_sequence_admission:
            raise FailedPreconditionError(
                f"{call} is a vllm-0.33 call; this pool's profile is {self.config.profile}"
            )
