"""The rules between the wire and the engine, for one pool, in plain Python.

:class:`PoolService` owns a pool's engine and everything the service keeps beside it: which session
owns which request, positioned request sync, Step semantics (apply in order, stop at the first
failure), per-session event cursors and prefix-cache statistics, fencing by server instance and pool
incarnation, and the event journal. It is the only door to the engine: the servicer, recovery, the
registry and metrics read and change a pool through its methods, never the engine itself. The
servicer only converts messages to and from these calls. Failures are :class:`~.errors.ServiceError`
with a rules :class:`~.errors.Status`; this module imports no gRPC.

This module keeps the pool's state, its sessions (attach, fences, namespaces; whether an Attach
may open one is attach_rules.py's) and the pool as a whole (counters, inspection, checks, state);
its other roles are parts it owns and forwards to, each in its module: request ownership and sync (pool_requests.py), the Step (pool_steps.py) and its
allocations (pool_allocations.py), events and statistics (pool_events.py), scores (pool_scores.py)
and reservations (pool_reservations.py). Nothing else uses those parts; the values it answers are
pool_types.py's.

Every pool operation runs on the server's event loop without awaiting, so a pool is
linearizable; a large Step (a large session's end) is applied in slices (:meth:`PoolService.applying`,
:meth:`PoolService.ending_session`) while its pool is held and nothing else reads or changes it
(pool_locks.py). A failed operation changes nothing (the engine validates first; a request sync
made for a failed operation is undone)."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import cbor2
from kvcoord.engine import CacheHit, KVCacheConfig, KVCachePool, PrefixCacheStats
from kvcoord.engine.invariants import PoolCheck, check_pool
from kvcoord.engine.reservations import Reservations
from kvcoord.engine.state import STATE_VERSION, export_state, import_state
from kvcoord.wire.rules import rules_fingerprint

from .attach_reset import reset_for_new_engine
from .attach_rules import check_admission, check_handshake
from .budget import event_buffer_bytes
from .errors import ErrorReason, ServiceError, Status
from .events import EventJournal
from .fences import Fence
from .pool_allocations import SLICED_ALLOCATE_TOKENS, PoolAllocations
from .pool_events import PoolEvents
from .pool_requests import RequestSyncs
from .pool_reservations import PoolReservations
from .pool_scores import PoolScoring
from .pool_steps import StepRunner
from .pool_types import (
    UNSCORED_NO_PROMPT,
    UNSCORED_TOO_LONG,
    HashSettings,
    Inspection,
    Limits,
    MirrorState,
    PoolCounters,
    PoolScore,
    ReplicaState,
    RequestView,
    ReservationLease,
    ScoreSettings,
    UnscoredPool,
    drain,
    new_score,
    score_settings,
)
from .sessions import Session, SessionTable

if TYPE_CHECKING:  # pragma: no cover
    from .positions import JournalPositions

__all__ = [
    "ABANDONED",
    "ABANDONED_PAST_RESERVATIONS",
    "SLICED_ALLOCATE_TOKENS",
    "UNSCORED_NO_PROMPT",
    "drain",
    "UNSCORED_TOO_LONG",
    "Fence",
    "HashSettings",
    "ScoreSettings",
    "Inspection",
    "Limits",
    "MirrorState",
    "PoolCounters",
    "PoolScore",
    "PoolService",
    "ReplicaState",
    "RequestView",
    "ReservationLease",
    "UnscoredPool",
    "new_score",
    "score_settings",
]


#: how a session's requests are freed when it ends (:meth:`PoolService.ending_session`),
#: the last field of its "detach" / "expire" journal record (durability.py); a record
#: without it (a journal older than these rules) frees them plainly (``free``).
#: ABANDONED: as abandoned (their blocks' cache entries dropped where only they held
#: them), routers' reservations keeping the entries of the blocks they hold too
ABANDONED = 1
#: as abandoned, reservations reading nothing: a block only reservations hold besides
#: the request loses its entry too (engine ``free_abandoned``'s ``drop_reserved``)
ABANDONED_PAST_RESERVATIONS = 2


class PoolService:
    """One named pool and its rules.

    Args:
        name: the pool's name.
        config: the validated engine layout.
        hash_settings: (hash_algo, hash_block_size, hash_seed) clients must use.
        fence: this server instance and this pool's incarnation.
        limits: server limits.
        sessions: the server's session table (sessions of every pool).
        wire_config: the configuration as the client sent it (kept for equality
            checks and descriptions; opaque here).
    """

    def __init__(
        self,
        name: str,
        config: KVCacheConfig,
        hash_settings: HashSettings,
        fence: Fence,
        limits: Limits,
        sessions: SessionTable,
        wire_config: object = None,
    ) -> None:
        self.name = name
        self.config = config
        self.hash_settings = hash_settings
        #: the prompt settings ScorePools scores this pool with
        self.score_settings = score_settings(hash_settings, config.profile, config.num_hash_lookahead_tokens)
        self.fence = fence
        self.limits = limits
        self.sessions = sessions
        self.wire_config = wire_config
        self.engine = KVCachePool(config)
        self.events = EventJournal(
            limits.event_buffer, event_buffer_bytes(config.num_blocks, hash_settings[1])
        )
        #: request id -> owning session
        self.owners: dict[str, Session] = {}
        #: no session may attach before this monotonic time (post-restart grace), read
        #: on ``grace_clock``: the registry's monotonic clock, not the session table's
        #: lease clock, which leaves out the server's pauses (lease_clock.py) and would
        #: lengthen a grace set after them by every pause since the start
        self.grace_until = 0.0
        self.grace_clock = sessions.clock
        #: when this incarnation was created (seconds since the epoch; journaled, so a
        #: recovered pool keeps it): its counters' ``_created`` time
        self.created_at = 0.0
        #: earlier instances of this server whose state was recovered without loss
        #: (durability.py): their fences stay valid for this incarnation
        self.lineage: frozenset[str] | set[str] = frozenset()
        #: records of earlier instances (any journal's) this state holds: id -> [position, tag]
        self.held: dict[str, list[Any]] = {}
        #: a TakeEventsOp's events' byte budget (set from max_message_bytes; None: none)
        self.answer_event_bytes: int | None = None
        #: proves a fence's journal position against what this journal holds (positions.py)
        self.positions: JournalPositions | None = None
        # Its parts by role (each reads the pool through it, as pool_types.PoolCore: import_state
        # replaces the engine, so none keeps it), and the calls it forwards to them.
        self.syncs = RequestSyncs(self)
        self.sync = self.syncs.sync
        self.reserving = PoolReservations(self)
        self.reserve = self.reserving.reserve
        self.expired_reservations = self.reserving.expired_reservations
        self.release_reservation = self.reserving.release_reservation
        self.reservations_of = self.reserving.reservations_of
        self.replay_reserve = self.reserving.replay_reserve
        self.allocations = PoolAllocations(self, self.syncs, self.reserving)
        self.event_feed = PoolEvents(self)
        self.take_events = self.event_feed.take_events
        self.events_filter = self.event_feed.events_filter
        self.make_stats = self.event_feed.make_stats
        self.scoring = PoolScoring(self)
        self.score = self.scoring.score
        self.score_target = self.scoring.score_target
        self.score_map = self.scoring.score_map
        self.score_keys = self.scoring.score_keys
        self.score_of_length = self.scoring.score_of_length
        self.hit_length_from_run = self.scoring.hit_length_from_run
        self.steps = StepRunner(self, self.syncs, self.allocations, self.event_feed)
        self.apply = self.steps.apply
        self.applying = self.steps.applying
        self.check_step_size = self.steps.check_step_size
        self.free_requests = self.steps.free_requests
        self.freeing_requests = self.steps.freeing_requests

    # -- fencing and sessions -----------------------------------------------------------
    def check_fence(self, fence: Fence | None) -> None:
        """Refuse a caller whose block ids belong to another instance or incarnation (an
        unknown instance's tag may prove a restore first: positions.py, check_unknown; a
        known instance's position is checked before its incarnation, for the same reason).

        Raises:
            ServiceError: FAILED_PRECONDITION with INSTANCE_CHANGED / INCARNATION_CHANGED;
                UNAVAILABLE when the caller was answered under a newer term (this
                replica was deposed: another owner serves the pool)."""
        if fence is None:
            return
        if not self.knows_instance(fence.instance_id):
            if self.positions is not None:  # a copy of this journal told it: a restore (positions.py)
                self.positions.check_unknown(fence)
            raise ServiceError(
                Status.PRECONDITION,
                f"the server restarted (instance {fence.instance_id[:40]!r} is gone, this is "
                f"{self.fence.instance_id!r}): every block id you hold in pool {self.name!r} is void; "
                "attach again and recompute your requests",
                ErrorReason.INSTANCE_CHANGED,
            )
        if fence.position and self.positions is not None:
            # before the incarnation: a position is a record of the journal, whichever
            # incarnation's answer told it (a worker of the pool made again after a
            # restored copy was taken proves the restore as any other: positions.py)
            self.positions.check(fence)
        if fence.incarnation != self.fence.incarnation:
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.name!r} was deleted and created again (incarnation {fence.incarnation} is "
                f"gone, this is {self.fence.incarnation}): every block id you hold in it is void; "
                "attach again and recompute your requests",
                ErrorReason.INCARNATION_CHANGED,
            )
        if fence.term and fence.term > self.fence.term:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {self.name!r} has a newer owner than this replica (term {fence.term} was answered, this "
                f"replica holds term {self.fence.term}): retry, the current owner will answer",
            )

    def knows_instance(self, instance_id: str) -> bool:
        """True for this instance and for earlier ones whose state this one recovered."""
        return instance_id == self.fence.instance_id or instance_id in self.lineage

    def attach(
        self,
        hash_algo: str,
        hash_block_size: int,
        hash_seed: str,
        client_name: str,
        lease_seconds: float,
        exclusive: bool = False,
        tenant: str = "",
        max_sessions: int = 0,
        profile: str = "",
        num_hash_lookahead_tokens: int = 0,
        reset_prefix_cache: bool = False,
    ) -> Session:
        """The hash handshake, then a new session of ``tenant``. ``profile``: the client's profile ("":
        vllm-0.16); ``reset_prefix_cache``: the cache reset as it starts (attach_reset.py; checked first).

        Raises:
            ServiceError: the refusals of attach_rules.py (:func:`~.attach_rules.check_handshake`,
                then :func:`~.attach_rules.check_admission`): FAILED_PRECONDITION (PROFILE_MISMATCH,
                HASH_MISMATCH, POOL_EXCLUSIVE), UNAVAILABLE (GRACE_PERIOD), RESOURCE_EXHAUSTED.
        """
        check_handshake(self, hash_algo, hash_block_size, hash_seed, profile, num_hash_lookahead_tokens)
        check_admission(self, self.grace_until, exclusive, tenant, max_sessions)
        s = self.sessions.open(self.name, client_name, lease_seconds)
        if reset_prefix_cache:
            reset_for_new_engine(self, s)
        s.exclusive = exclusive
        s.tenant = tenant
        self.init_session(s)
        return s

    def init_session(self, s: Session) -> None:
        """A new session's cursors (events from now on, statistics from zero) and its
        prefix-cache namespace (registered with the engine in attach order, so a
        replay assigns the same keys)."""
        s.events_cursor = self.events.last_sequence
        if self.engine.prefix_cache_stats is not None:
            s.stats = PrefixCacheStats()
        self.bind_namespace(s)

    def bind_namespace(self, s: Session) -> None:
        """Set the session's cache namespace from its tenant (see :meth:`cache_namespace`)."""
        s.cache_namespace = self.cache_namespace(s.tenant)
        self.engine.cache_namespace_prefix(s.cache_namespace)

    def cache_namespace(self, tenant: str) -> str:
        """The prefix-cache namespace of ``tenant``'s requests in this pool: ``""`` (the
        shared cache) for the full-access tenant and for tenants the pool's
        ``shared_cache_tenants`` lists (``"*"``: all), else the tenant's own."""
        if not tenant:
            return ""
        shared = getattr(self.wire_config, "shared_cache_tenants", ())
        if "*" in shared or tenant in shared:
            return ""
        return tenant

    def cache_prefix_of(self, namespace: str) -> bytes | None:
        """The key prefix of a cache namespace the pool has seen (None: never seen; looking
        it up registers nothing)."""
        return self.engine.cache_namespaces.get(namespace)

    def mirror_state(self, cache_namespace: str) -> MirrorState | str:
        """What an exclusive session's client loads its mirror of the pool from (an
        exclusive Attach with want_engine_state): the engine's whole state as CBOR,
        and the rules and namespace it holds under; or why there is none. Reads only.
        None while routers' reservations are live: they end (expire, or are adopted)
        by the server's own doing, which the session's mirror would not follow."""
        if self.engine.reservations.live:
            return "the pool holds routers' reservations (they end on the server's clock, not the session's)"
        return MirrorState(cbor2.dumps(export_state(self.engine)), STATE_VERSION, rules_fingerprint(),
                           cache_namespace)  # fmt: skip

    def session(self, session_id: str, fence: Fence | None) -> Session:
        """The caller's live session, renewed (fence checked first).

        Raises:
            ServiceError: see :meth:`check_fence` and :meth:`SessionTable.get`."""
        self.check_fence(fence)
        s = self.sessions.get(session_id, self.name)
        self.sessions.renew(s)
        return s

    def ending_session(
        self, s: Session, every: int, abandon: int = ABANDONED_PAST_RESERVATIONS
    ) -> Generator[None, None, int]:
        """Close the session (detach, lease expiry, a restored server's void sessions),
        then free every request it owns by the engine's ``free_abandoned`` (``abandon``:
        the rule of a journal's record, durability.py; 0: by ``free``, and
        :data:`ABANDONED`: reservations keeping entries, to replay journals older than
        those rules), yielding after every ``every`` (0: never; the pool held between
        slices: pool_locks.py); returns how many. With fine-grained hits (one session at a time: :meth:`attach`) the
        copy-on-write pairs it did not release end with it."""
        self.sessions.close(s.session_id)
        owned = list(s.owned)
        engine = self.engine
        drop = abandon != ABANDONED
        # the blocks reservations hold, read once per slice (the pool is held: nothing
        # else changes them); was: read again for every request freed, a pass over every
        # reservation's blocks each time
        reserved: dict[int, int] | None = None
        for k, rid in enumerate(owned, 1):
            if not abandon:
                engine.free(rid)
            else:
                if reserved is None:
                    reserved = engine.reservations.held_blocks() if drop and engine.reservations.live else {}
                engine.free_abandoned(rid, drop_reserved=drop, reserved=reserved)
            del self.owners[rid]
            if every and not k % every:
                # each slice's events (a BlockRemoved per cached block an abandoned
                # request held) into the journal now: moved at once after the last
                # slice, a million of them held the loop ~250 ms
                self.event_feed.publish()
                yield
                reserved = None
        s.owned.clear()
        if self.config.partial_hash_hits:
            self.engine.drop_block_copies()
        self.event_feed.publish()
        return len(owned)

    # -- reads ----------------------------------------------------------------------------
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, tenant: str = ""
    ) -> CacheHit:
        """The hit a request of ``tenant`` with these hashes would get; changes nothing."""
        return self.engine.find_longest_cache_hit(block_hashes, num_tokens, self.cache_namespace(tenant))

    def lifetime_prefix_cache_stats(self) -> PrefixCacheStats:
        c = self.engine.lookup_counters
        return PrefixCacheStats(requests=c.lookups, queries=c.queries, hits=c.hits)

    # -- the pool as a whole: what the servicer, recovery and the registry read and do ---
    @property
    def num_free_blocks(self) -> int:
        return self.engine.num_free_blocks

    @property
    def usage(self) -> float:
        return self.engine.usage

    @property
    def num_requests(self) -> int:
        return len(self.engine.requests)

    @property
    def num_materialised_blocks(self) -> int:
        """Blocks the engine has built so far (the GC freezer counts them)."""
        return len(self.engine.block_pool.blocks)

    @property
    def reservations(self) -> Reservations:
        """The engine's reservations (live ones and counters); read them, never change them."""
        return self.engine.reservations

    def counters(self) -> PoolCounters:
        e = self.engine
        bp = e.block_pool
        c = e.lookup_counters
        return PoolCounters(
            e.usage, e.num_free_blocks, len(e.requests), c.lookups, c.queries, c.hits, c.short_lookups,
            tuple(c.group_hit_tokens), bp.num_evictions, e.num_refusals, bp.num_allocated, bp.num_freed,
        )  # fmt: skip

    def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache, its events published; False when a block is still
        in use (nothing changed). The ResetPrefixCache RPC, its replay and a restored
        journal's fencing all reset through here."""
        done = self.engine.reset_prefix_cache()
        self.event_feed.publish()
        return done

    def pool_state(self) -> ReplicaState | str:
        """What an exclusive client's copy of this pool starts from (Attach's pool state),
        or why it cannot have one."""
        return self.engine.replica_state()

    def check(self) -> PoolCheck:
        """Every invariant of the engine checked (CheckPool); changes nothing."""
        return check_pool(self.engine)

    def inspect(
        self,
        request_ids: Sequence[str],
        all_requests: bool = False,
        free_queue_limit: int | None = None,
        include_cached_blocks: bool = False,
    ) -> Inspection:
        """The pool's state for an operator (InspectPool); changes nothing.

        Raises:
            EngineError: NOT_FOUND for an unknown request id.
        """
        e = self.engine
        rids = sorted(e.requests) if all_requests else request_ids
        states = []
        for rid in rids:
            req = e.get_request(rid)
            states.append(RequestView(rid, e.get_block_ids(rid), req.num_computed_tokens, req.num_tokens))
        return Inspection(
            e.num_free_blocks,
            e.usage,
            e.free_queue_head(free_queue_limit),
            states,
            e.cached_block_ids() if include_cached_blocks else [],
        )

    def teardown(self) -> Iterator[None]:
        """Release a deleted pool's objects a slice at a time (yields between slices),
        then drop its engine, parts and the calls forwarded to them: they refer back to
        it, and a pool the server froze (``gc.freeze``: GcFreezer, sliced Steps) would
        keep them forever; without the cycles reference counting frees it. Plain facts
        (name, config, fence, the closed event journal) stay for a watcher still ending.
        """
        yield from self.engine.teardown()
        parts = (self.syncs, self.reserving, self.allocations, self.event_feed, self.scoring, self.steps)
        held = vars(self)
        for name, value in list(held.items()):
            if any(value is p or getattr(value, "__self__", None) is p for p in parts):
                del held[name]
        del held["engine"]
        for part in parts:
            vars(part).clear()

    def export_state(self) -> dict[str, Any]:
        """The engine's state as plain values (snapshots: recovery.py)."""
        return export_state(self.engine)

    def import_state(self, value: dict[str, Any], built: object = None) -> None:
        """Replace the engine by one rebuilt from :meth:`export_state`'s value, or by
        ``built`` (:func:`engine_of` that value, off the loop: pool_load.py) when it was
        made for this pool's config."""
        ok = isinstance(built, KVCachePool) and built.config == self.config
        self.engine = built if ok else import_state(self.config, value)  # type: ignore[assignment]

    def runs(self, built: object) -> bool:
        """Whether this pool's engine is ``built`` (:func:`engine_of`)."""
        return self.engine is built


def engine_of(config: KVCacheConfig, value: dict[str, Any]) -> object:
    """An engine of ``config`` in :meth:`PoolService.export_state`'s ``value``, built
    apart from any pool (see :meth:`PoolService.import_state`)."""
    return import_state(config, value)


def engine_released(built: object) -> Iterator[None]:
    """Free an engine of :func:`engine_of` no pool runs, a slice at a time."""
    assert isinstance(built, KVCachePool)
    return built.teardown()
