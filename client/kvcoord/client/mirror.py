"""An exclusive session's mirror of its pool: the engine itself, loaded from the server.

The server gives an exclusive session its pool's whole engine state when it attaches
(``AttachRequest.want_engine_state``: :func:`kvcoord.engine.state.export_state`'s
value as CBOR, with the server engine's rules fingerprint and the session's cache
namespace). :class:`Mirror` loads it into a :class:`~kvcoord.engine.KVCachePool` of
the pool's configuration and applies every call the session makes to it, in the order
the session sends them, so it answers each call at once, exactly as the server will:
the rules are the engine's, written once, for every layout the engine knows (hybrid,
sliding window, chunked local, mamba, cross-attention, EAGLE, tenants' namespaces).

What the server's answers are compared with is kept here too: the events the session
is owed (those of its cache namespace, as the server filters them) and its
prefix-cache statistics, per Step and for the scheduler. Block ids and free counts
are the engine's answers themselves.

A server whose engine has another rules fingerprint (another release, a patched
engine) is not mirrored: :class:`MirrorUnavailableError` says why, and the caller runs
without prediction. Never a guess.
"""

from __future__ import annotations

import marshal
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import grpc
from kvcoord.engine import (
    BlockRemoved,
    BlockStored,
    EngineError,
    HandedTokenIds,
    InvalidArgumentError,
    KVCacheEvent,
    LoRA,
    PrefixCacheStats,
    StaleCacheHitError,
    TokenIds,
)
from kvcoord.engine.managers.base import SingleTypeKVCacheManager
from kvcoord.engine.state import STATE_VERSION, StateError, import_state
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import config_from_pb
from kvcoord.wire.rules import rules_fingerprint

from .errors import KVCoordError, error_from_code
from .items import NO_STATS, add_stats
from .tracking import SyncValues

__all__ = ["Mirror", "MirrorUnavailableError", "StaleCacheHitError"]

BlockIds = tuple[tuple[int, ...], ...]

#: the largest token id the wire's uint32 carries
UINT32_MAX = 0xFFFFFFFF


class MirrorUnavailableError(Exception):
    """The pool cannot be mirrored here (the message says why, for people)."""


def engine_error(err: EngineError) -> KVCoordError:
    """The client's typed error for an engine refusal: what the server answers, made
    from the same two values the server maps (the engine error's status and reason),
    so a request the pool does not hold is a ``RequestUnknownError``, never a plain
    ``NotFoundError`` (which says the pool is gone)."""
    return error_from_code(getattr(grpc.StatusCode, err.status.value), str(err), reason=err.reason)


class Mirror:
    """The pool's engine, loaded from an exclusive Attach's state.

    Args:
        config: the pool's configuration (``PoolInfo.config``).
        state: ``AttachResponse.pool_state`` of an Attach with ``want_engine_state``.

    Raises:
        MirrorUnavailableError: no engine state, another state version or another
            rules fingerprint than this client's engine, or a state that does not fit
            the configuration.
    """

    def __init__(self, config: pb.PoolConfig, state: pb.PoolState) -> None:
        if not state.engine_state:
            raise MirrorUnavailableError("the server sent no engine state (it predates the mirror)")
        if state.engine_state_version != STATE_VERSION:
            raise MirrorUnavailableError(
                f"the server's engine state is version {state.engine_state_version}, this client's engine "
                f"reads {STATE_VERSION}"
            )
        ours = rules_fingerprint()
        if state.engine_rules != ours:
            raise MirrorUnavailableError(
                f"the server's engine rules are {state.engine_rules!r}, this client's {ours!r} (another "
                "kvcoord release on one side): its answers could differ"
            )
        try:
            engine = import_state(config_from_pb(config), cbor2.loads(state.engine_state))
        except (StateError, EngineError, ValueError, KeyError, TypeError) as err:
            raise MirrorUnavailableError(f"the server's engine state cannot be loaded: {err}") from None
        engine.take_events()  # made before the session: not its events
        # every block made now, as vLLM's own pool makes them: vLLM's engine core
        # freezes its heap once built, and blocks made later as first taken would be
        # walked by every full collection
        engine.block_pool.free_block_queue.materialize()
        self.log_stats = config.log_stats if config.HasField("log_stats") else True
        engine.prefix_cache_stats = PrefixCacheStats() if self.log_stats else None
        self.engine = engine
        #: where the engine records its statistics (read by ``_drain_stats``)
        self._engine_hits = engine.hits
        self._update_and_allocate = engine.update_and_allocate
        #: a decode step inside the request's blocks, or ``None`` (nothing changed):
        #: the engine's ``decode_token``, which makes no event and no statistic
        self.decode_token = engine.decode_token
        self._decode_step = engine.decode_step
        self.namespace = state.cache_namespace
        #: the cache prefix of the session's events (None: every event is the session's)
        self._prefix: bytes | None = (
            engine.cache_namespace_prefix(self.namespace) if engine.cache_namespaces else None
        )
        self.enable_events = engine.block_pool.enable_kv_cache_events
        self._block_pool = engine.block_pool
        #: the engine's free queue (made with its block pool, never replaced) and its
        #: common-prefix read, each read once a scheduler step: one object each, not the
        #: pool's chain of calls (every function a step runs once is cold in the caches)
        self._free_queue = engine.block_pool.free_block_queue
        self._common_prefix = engine.get_num_common_prefix_blocks
        self._lone_common_prefix = engine.lone_common_prefix()  # (one group: its manager's, one call)
        #: the session's events (the engine's values) since the Step was cut, for the
        #: sender to digest as the server does, and those not given to the scheduler yet
        #: (what ``convert`` made of them, when set: vLLM's types, made as the engine
        #: makes its events, as vLLM's block pool builds its own)
        self._step_events: list[KVCacheEvent] = []
        self.events: list[Any] = []
        self.convert: Callable[[list[KVCacheEvent]], list[Any]] | None = None
        #: statistics since the Step was cut, and since the scheduler last made them
        self.step_stats = PrefixCacheStats()
        self._user_stats = PrefixCacheStats()
        #: whether any statistic was added to each sum since it was last taken (else
        #: taking it makes no new object: most scheduler steps look nothing up)
        self._step_changed = self._user_changed = False
        self.block_size = engine.config.groups[0].block_size if engine.config.groups else 0

    # -- requests -------------------------------------------------------------------------
    def apply(self, sync: SyncValues) -> Callable[[], None]:
        """Apply a request sync (the tracker's values: the message is written later, on
        the sender thread) as the server will apply its message; returns how to undo it.

        Raises:
            KVCoordError: the engine refuses it, or a token does not fit the wire's
                ``uint32`` (nothing changed).
        """
        engine = self.engine
        rid = sync.request_id
        computed = sync.computed
        tokens = wire_tokens(rid, sync.tokens, sync.source_tokens)
        try:
            if sync.new_request:
                lora = sync.lora
                engine.add_request(
                    rid,
                    tokens,
                    sync.hashes,
                    lora=LoRA(*lora) if lora is not None and lora[1] else None,
                    skip_reading_prefix_cache=sync.skip_reading_prefix_cache,
                    num_preemptions=sync.num_preemptions,
                    cache_namespace=self.namespace,
                    cache_salt=sync.cache_salt or None,  # named in a vllm-0.33 pool's events
                    extra_key_sources=sync.extra_key_sources,  # (as well)
                    num_prompt_tokens=sync.num_prompt_tokens,
                    kv_cache_report_full=sync.kv_cache_report_full,  # (hits re-announced)
                )
                if computed:  # (a new record counts 0 computed tokens already)
                    try:
                        engine.update_request(rid, num_computed_tokens=computed)
                    except EngineError:
                        engine.restore_request(rid, None)
                        raise
                return lambda: engine.restore_request(rid, None)
            checkpoint = engine.checkpoint_request(rid)
            prompt = sync.num_prompt_tokens  # (a streaming session's, grown)
            if sync.rewind is not None:  # (the engine's rule, as the server applies it)
                return engine.update_rewound(rid, sync.rewind, computed, tokens, sync.hashes, prompt)
            engine.update_request(
                rid,
                num_computed_tokens=computed,
                append_token_ids=tokens,
                append_block_hashes=sync.hashes,
                num_prompt_tokens=prompt,
            )
        except EngineError as err:
            raise engine_error(err) from None
        return lambda: engine.restore_request(rid, checkpoint)

    def grow(
        self, request_id: str, computed: int, tokens: Sequence[int], hashes: Sequence[bytes], num_new_tokens: int,
        num_lookahead_tokens: int, inside_checked: bool = False,
    ) -> BlockIds | None:  # fmt: skip
        """A registered request's run entry (``RequestTracker.sync_run``'s values, then
        an allocation without a hit, in one engine call): its update and its new blocks
        per group, or ``None`` when too few blocks are free (the update kept, as the
        server keeps it). Refused by the engine: nothing changed. ``inside_checked``:
        :attr:`decode_token` of these values just answered ``None`` (the engine's
        ``update_and_allocate`` does not check it again).

        Raises:
            KVCoordError: the engine refuses the update or the allocation.
        """
        if len(tokens) != 1 or type(tokens[0]) is not int or tokens[0] > UINT32_MAX:  # (a decode's one token)
            _check_wire_tokens(request_id, tokens)
        try:
            new = self._update_and_allocate(
                request_id, computed, tokens, hashes, num_new_tokens, num_lookahead_tokens, inside_checked
            )
        except EngineError as err:
            raise engine_error(err) from None
        if self._block_pool.kv_event_queue:
            self._collect()
        return new

    def decode_step(
        self, request_id: str, computed: int, token: int, block_hash: bytes | None, num_new_tokens: int,
        num_lookahead_tokens: int,
    ) -> BlockIds | None:  # fmt: skip
        """A decode step taking a block or caching one (its token and the hash of the
        block it completes, ``None``: none): the engine's ``decode_step``, its events
        kept; ``None``, nothing changed, for anything it does not take (:meth:`grow`)."""
        new = self._decode_step(request_id, computed, token, block_hash, num_new_tokens, num_lookahead_tokens)
        if new is not None and self._block_pool.kv_event_queue:
            self._collect()
        return new

    def holds(self, request_id: str) -> bool:
        return request_id in self.engine.requests

    def common_prefix(self, request_id: str) -> list[int] | None:
        """The engine's ``get_num_common_prefix_blocks`` as a list, or ``None`` for a
        request it does not hold (:meth:`call`'s, written out: vLLM's scheduler asks
        every step)."""
        if request_id not in self.engine.requests:
            return None
        lone = self._lone_common_prefix
        try:
            value = [lone(request_id)] if lone is not None else list(self._common_prefix(request_id))
        except EngineError as err:
            raise engine_error(err) from None
        if self._block_pool.kv_event_queue:
            self._collect()
        return value

    # -- calls ----------------------------------------------------------------------------
    def lookup(self, request_id: str) -> tuple[BlockIds, int]:
        """The request's prefix hit (statistics recorded, as the server records them)."""
        hit = self.engine.get_computed_blocks(request_id)
        self._collect()  # (a "full" report-mode request's hit is re-announced)
        return hit.block_ids, hit.num_tokens

    def allocate(self, request_id: str, *args: Any) -> BlockIds | None:
        """``KVCachePool.allocate_slots``; engine refusals as the client's errors.

        Raises:
            StaleCacheHitError: the hit went stale (the server answers it as refused).
            KVCoordError: bad input (nothing changed).
        """
        try:
            new = self.engine.allocate_slots(request_id, *args)
        except StaleCacheHitError:
            raise
        except EngineError as err:
            raise engine_error(err) from None
        self._collect()
        return new

    def free_if_held(self, request_id: str, uncomputed_from: int | None = None) -> object | None:
        """Free the request's blocks and forget it (nothing for a request it does not
        hold); ``uncomputed_from``: an undone step's free (see the engine's ``free``).
        Returns the engine's record of the request (``None``: not held), which the
        caller may keep to let go of it later (its token list's deallocation)."""
        engine = self.engine
        record = engine.requests.get(request_id)
        if record is not None:
            engine.free(request_id, False, uncomputed_from)
            if self._block_pool.kv_event_queue:
                self._collect()
        return record

    def call(self, method: str, *args: Any) -> Any:
        """Any other engine call (``cache_blocks``, ``remove_skipped_blocks``,
        ``evict_blocks``, ``reset_prefix_cache``, ``get_num_common_prefix_blocks``),
        its events kept; engine refusals as the client's errors."""
        try:
            value = getattr(self.engine, method)(*args)
        except EngineError as err:
            raise engine_error(err) from None
        self._collect()
        return value

    def skips_blocks(self, request_id: str, total_computed_tokens: int) -> bool:
        """Whether ``remove_skipped_blocks`` may change anything (True for a group
        with a rule of its own: mamba)."""
        for m in self.engine.managers:
            if type(m).remove_skipped_blocks is not SingleTypeKVCacheManager.remove_skipped_blocks:
                return True
            if m.skips_blocks(request_id, total_computed_tokens):
                return True
        return False

    def caches_more(self, request_id: str, num_computed_tokens: int) -> bool:
        """Whether ``cache_blocks`` may change anything (True for a group with a rule
        of its own: cross-attention)."""
        for m in self.engine.managers:
            if type(m).cache_blocks is not SingleTypeKVCacheManager.cache_blocks:
                return True
            if num_computed_tokens // m.block_size > m.num_cached_block.get(request_id, 0):
                return True
        return False

    def table(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block table per group.

        Raises:
            RequestUnknownError: the pool does not hold the request (as the server answers).
        """
        try:
            return tuple(list(g) for g in self.engine.get_block_ids(request_id))
        except EngineError as err:
            raise engine_error(err) from None

    @property
    def num_free_blocks(self) -> int:
        return self._free_queue.num_free_blocks  # (the engine's property's read, two calls less)

    @property
    def usage(self) -> float:
        return self._block_pool.get_usage()  # (as num_free_blocks: read at every step's end)

    # -- what is compared -----------------------------------------------------------------
    def _collect(self) -> None:
        """Keep the session's events of the call just made (as the engine's values: the
        messages are made off the scheduler's thread, by the sender)."""
        if not self.enable_events or not self._block_pool.kv_event_queue:
            return
        events = self._block_pool.take_events()
        if events:
            prefix = self._prefix
            if prefix is not None:
                # another namespace's block: not this session's to see
                events = [
                    e
                    for e in events
                    if not isinstance(e, BlockRemoved | BlockStored) or e.cache_prefix == prefix
                ]
            self._step_events += events
            convert = self.convert
            self.events += events if convert is None else convert(events)

    def _drain_stats(self) -> None:
        """Move the engine's statistics into the step's and the scheduler's sums: only
        when it recorded any (a lookup counts one request, preempted or not; a reset
        sets ``reset``), so a drain with nothing to add makes no new object."""
        now = self._engine_hits.prefix_cache_stats
        if now is None or not (now.requests or now.preempted_requests or now.reset):
            return
        stats = self.engine.make_prefix_cache_stats()
        if stats is not None:
            add_stats(self.step_stats, stats)
            add_stats(self._user_stats, stats)
            self._step_changed = self._user_changed = True

    def take_step(self) -> tuple[int, list[KVCacheEvent], PrefixCacheStats]:
        """The free count now, and the events and statistics since the previous call:
        what the server's answer to the Step cut now must give (its events digested as
        a StepResponse's, its statistics as its message: both made on the sender
        thread). Statistics unchanged since the last call are :data:`NO_STATS`
        (shared: read, never changed)."""
        self._drain_stats()
        events, self._step_events = self._step_events, []
        free = self._free_queue.num_free_blocks
        if not self._step_changed:
            return free, events, NO_STATS
        stats, self.step_stats = self.step_stats, PrefixCacheStats()
        self._step_changed = False
        return free, events, stats

    def take_events(self) -> list[Any]:
        """The events since the previous call (the engine's values, or ``convert``'s)."""
        events, self.events = self.events, []
        return events

    def take_stats(self) -> PrefixCacheStats:
        """The statistics since the previous call (vLLM's make_prefix_cache_stats)."""
        stats = self.take_changed_stats()
        return PrefixCacheStats() if stats is None else stats

    def take_changed_stats(self) -> PrefixCacheStats | None:
        """:meth:`take_stats`, or ``None`` when nothing was recorded since the previous
        call (every count 0, no reset): no object made for an all-zero sum."""
        self._drain_stats()
        if not self._user_changed:
            return None
        stats, self._user_stats = self._user_stats, PrefixCacheStats()
        self._user_changed = False
        return stats

    def peek_stats(self) -> PrefixCacheStats:
        self._drain_stats()
        return self._user_stats.copy()


def _check_wire_tokens(request_id: str, tokens: Sequence[int]) -> None:
    """Refuse token ids the wire's ``uint32`` cannot carry before the mirror takes them
    (the Step's message is written later, on the sender thread, where the error would
    lose the session); negative and non-integer ids are the engine's to name."""
    if tokens:
        try:
            too_big = max(tokens) > UINT32_MAX
        except TypeError:
            return
        if too_big:
            raise engine_error(
                InvalidArgumentError(f"request {request_id!r}: a token id does not fit uint32")
            )


#: a prompt this long or longer is checked by :func:`wire_tokens`'s C passes
_CHECK_IN_BULK = 16
_UINT32_ARRAY = "I" if array("I").itemsize == 4 else ""
#: marshal's record of an int in -2**31..2**31-1 (format 2: no reference flags)
_MARSHAL_INT = ord("i")


def _small_exact_ints(tokens: list[int]) -> bool:
    """Every one of ``tokens`` (a plain list) an ``int`` (not a subclass) in
    ``0..2**31-1``, told in one C pass: marshal's format 2 writes a list as ``[``, its
    length (4 bytes), then each element's record, whose first byte names its kind; an
    int of that range is ``i`` and 4 little-endian bytes, always 5 bytes. So the dump
    is ``5 + 5 * n`` bytes with ``i`` at every fifth byte from the fifth exactly when
    every element is such an int (records are read from the first: each ``i`` record
    ends where the next starts), and none is negative when every record's last byte
    is below 0x80. A bool, a larger or negative int, a float or a string writes another
    record; an int subclass or any other object cannot be written (``ValueError``).
    ``False`` says nothing about the tokens (the two-pass check decides)."""
    try:
        out = marshal.dumps(tokens, 2)
    except ValueError:
        return False
    n = len(tokens)
    return len(out) == 5 + 5 * n and out[5::5].count(_MARSHAL_INT) == n and out[9::5].isascii()


def wire_tokens(request_id: str, tokens: Sequence[int], source: list[int] | None = None) -> Sequence[int]:
    """``tokens`` as :class:`TokenIds` (which the engine copies without checking each
    again) once every one is an ``int`` (not a subclass) the wire's ``uint32`` carries:
    one C pass (marshal's, :func:`_small_exact_ints`) for ids below 2**31, which are all
    of any tokenizer's; else one C pass for the range (``array``), one for the exact
    types. A :class:`HandedTokenIds` (the tracker's registration, made for this one
    call) is given back itself, which the engine keeps without a copy. Anything else,
    or a short list, goes through :func:`_check_wire_tokens` and is given back
    unchecked (a plain list), for the engine's own check to name a bad token.
    ``source``: a plain list holding the same tokens as ``tokens`` (the list a
    :class:`HandedTokenIds` was just copied from, :attr:`SyncValues.source_tokens`),
    read by the check instead of a copy."""
    n = len(tokens)
    handed = type(tokens) is HandedTokenIds
    if n >= _CHECK_IN_BULK and _UINT32_ARRAY:
        # (marshal writes no list subclass: a HandedTokenIds is read through the list it
        # was copied from, or as a plain copy, a slice: one C copy, where ``list()`` of a
        # subclass iterates it)
        if type(source) is list and len(source) == n:
            plain = source
        else:
            plain = (
                tokens if type(tokens) is list else tokens[:] if isinstance(tokens, list) else list(tokens)
            )
        if _small_exact_ints(plain):
            return tokens if handed else TokenIds(tokens)
        try:
            # (``fromlist`` reads any list in one C pass with no copy; ``array(code,
            # tokens)`` would read a list subclass element by element, about 5 x slower)
            array(_UINT32_ARRAY).fromlist(plain)
        except (OverflowError, TypeError, ValueError):
            pass
        else:
            if list(map(type, tokens)).count(int) == n:
                return tokens if handed else TokenIds(tokens)
    _check_wire_tokens(request_id, tokens)
    return list(tokens) if handed else tokens  # (not marked checked: the engine checks each)
