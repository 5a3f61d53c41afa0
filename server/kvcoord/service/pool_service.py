"""The rules between the wire and the engine, for one pool, in plain Python.

:class:`PoolService` owns a pool's engine and everything the service keeps beside
it: which session owns which request, positioned request sync, Step semantics
(apply in order, stop at the first failure), per-session event cursors and
prefix-cache statistics, fencing by server instance and pool incarnation, and the
event journal. It is the only door to the engine: the servicer, recovery, the
registry and metrics read and change a pool through its methods, never the engine
itself. The servicer only converts messages to and from these calls. Failures are
:class:`~.errors.ServiceError` with a rules :class:`~.errors.Status`; this module
imports no gRPC.

Every pool operation runs on the server's event loop without awaiting, so a pool is
linearizable; a large Step is applied in slices (:meth:`PoolService.applying`) while its
pool is held and nothing else reads or changes it (pool_locks.py). A failed operation changes nothing (the engine validates first; a
request sync made for a failed operation is undone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import cbor2
from kvcoord.engine import (
    AllBlocksCleared,
    CacheHit,
    EngineError,
    HintMismatchError,
    KVCacheConfig,
    KVCacheEvent,
    KVCachePool,
    PrefixCacheStats,
    RequestCheckpoint,
    StaleCacheHitError,
)
from kvcoord.engine.block_pool import BlockHashToBlockMap
from kvcoord.engine.invariants import PoolCheck, check_pool
from kvcoord.engine.profiles import PROFILES, VLLM_016
from kvcoord.engine.reservations import Reservations
from kvcoord.engine.results import BlockIds
from kvcoord.engine.state import STATE_VERSION, export_state, import_state
from kvcoord.wire.rules import rules_fingerprint

from . import operations as op
from .budget import event_buffer_bytes
from .errors import ErrorReason, Position, ServiceError, Status, as_service_error
from .events import EventJournal, event_wire_bytes
from .fences import Fence
from .sessions import Session, SessionTable

#: free-queue positions a hint lookup walks by default, and at most
DEFAULT_WALK_LIMIT = 4096
#: an Allocate of at least this many new tokens, in a Step applied in slices, takes its
#: blocks in slices too (the pool held: pool_locks.py)
SLICED_ALLOCATE_TOKENS = 4096
#: blocks taken or cached between two yields of such an Allocate
ALLOCATE_SLICE_BLOCKS = 256
MAX_WALK_LIMIT = 1 << 16

if TYPE_CHECKING:  # pragma: no cover
    from .positions import JournalPositions

__all__ = [
    "UNSCORED_NO_PROMPT",
    "drain",
    "UNSCORED_TOO_LONG",
    "Fence",
    "HashSettings",
    "ScoreSettings",
    "Inspection",
    "Limits",
    "PoolCounters",
    "PoolScore",
    "PoolService",
    "RequestView",
    "ReservationLease",
    "UnscoredPool",
]


#: Attach's pool state: the first never-used block, the used free blocks (head first),
#: the prefix-cache map as (hash, block) pairs (engine ``replica_state``)
ReplicaState = tuple[int, list[int], list[tuple[bytes, int]]]

#: (hash_algo, hash_block_size, hash_seed): how a pool's clients hash blocks
HashSettings = tuple[str, int, str]

#: which prompt hashes score a pool (ScorePools): a vllm-0.16 pool's HashSettings, or
#: for a vllm-0.33 pool its HashSettings, "vllm-0.33" and num_hash_lookahead_tokens
#: (0.33 hashes differ from 0.16's as soon as a prompt has a LoRA, a salt, multimodal
#: items or look-ahead tokens: the same three settings must not pick 0.16's hashes)
ScoreSettings = HashSettings | tuple[str, int, str, str, int]


def score_settings(settings: HashSettings, profile: str, num_hash_lookahead_tokens: int) -> ScoreSettings:
    """The settings a prompt hashed by ``profile``'s rules scores (``""``: vllm-0.16).

    Raises:
        ServiceError: INVALID_ARGUMENT for an unknown profile, or look-ahead tokens
            outside vllm-0.33.
    """
    profile = profile or VLLM_016
    if profile not in PROFILES:
        raise ServiceError(Status.INVALID, f"unknown profile {profile[:64]!r} (known: {', '.join(PROFILES)})")
    if profile == VLLM_016:
        if num_hash_lookahead_tokens:
            raise ServiceError(Status.INVALID, "num_hash_lookahead_tokens needs the vllm-0.33 profile")
        return settings
    return (*settings, profile, num_hash_lookahead_tokens)


#: why a pool was not scored (UnscoredPool.reason)
UNSCORED_NO_PROMPT = "NO_PROMPT"
UNSCORED_TOO_LONG = "TOO_LONG"


@dataclasses.dataclass(frozen=True, slots=True)
class PoolScore:
    """One pool's answer to a router: the hit a request would get now, and room left."""

    pool: str
    hit: CacheHit
    num_free_blocks: int
    usage: float
    num_total_blocks: int
    fence: Fence

    def rank(self) -> tuple[int, int, str]:
        """Sort key, best first: longest hit, then most free blocks, then name."""
        return (-self.hit.num_tokens, -self.num_free_blocks, self.pool)


_set_pool, _set_hit, _set_free, _set_usage, _set_total, _set_fence = (
    vars(PoolScore)[f.name].__set__ for f in dataclasses.fields(PoolScore)
)


def new_score(
    pool: str, hit: CacheHit, num_free_blocks: int, usage: float, num_total_blocks: int, fence: Fence
) -> PoolScore:
    """``PoolScore(...)`` without the frozen dataclass's ``__init__`` (one per pool per
    ScorePools call): the slots written through their member descriptors, as the
    generated ``__init__`` does, at a fraction of the cost (as ``engine.results.new_hit``)."""
    score: PoolScore = object.__new__(PoolScore)
    _set_pool(score, pool)
    _set_hit(score, hit)
    _set_free(score, num_free_blocks)
    _set_usage(score, usage)
    _set_total(score, num_total_blocks)
    _set_fence(score, fence)
    return score


@dataclasses.dataclass(frozen=True, slots=True)
class ReservationLease:
    """Who holds a live reservation of this pool, and until when (monotonic)."""

    tenant: str
    deadline: float


@dataclasses.dataclass(frozen=True, slots=True)
class UnscoredPool:
    """A pool that cannot serve the prompt as sent (``reason``: UNSCORED_*)."""

    pool: str
    reason: str
    message: str


@dataclasses.dataclass(frozen=True, slots=True)
class RequestView:
    """One request as InspectPool shows it."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    num_computed_tokens: int
    num_tokens: int


@dataclasses.dataclass(frozen=True, slots=True)
class Inspection:
    """A pool's state for an operator (:meth:`PoolService.inspect`)."""

    num_free_blocks: int
    usage: float
    free_queue_head: list[int]
    requests: list[RequestView]
    cached_block_ids: list[int]


@dataclasses.dataclass(frozen=True, slots=True)
class PoolCounters:
    """A pool's lifetime counters and gauges (the /metrics scrape)."""

    usage: float
    num_free_blocks: int
    num_requests: int
    lookups: int
    queries: int
    hits: int
    short_lookups: int
    group_hit_tokens: tuple[int, ...]
    evictions: int
    refusals: int
    allocated: int
    freed: int


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """Server limits; exceeding one is RESOURCE_EXHAUSTED."""

    max_pools: int = 64
    max_blocks_per_pool: int = 50_000_000
    max_requests_per_pool: int = 1_000_000
    max_ops_per_step: int = 65_536
    event_buffer: int = 65_536
    #: the longest request a pool admits; a pool's max_model_len 0 means this
    max_tokens_per_request: int = 1 << 20
    #: budget for the estimated memory of every pool together (budget.py)
    max_pool_memory_bytes: int = 8 << 30
    #: live sessions per tenant (a tenant's max_sessions overrides it)
    max_sessions_per_tenant: int = 10_000
    #: live ScorePools reservations per tenant (every pool), and their longest life
    max_reservations_per_tenant: int = 256
    max_reservation_seconds: float = 30.0


Undo = Callable[[], None]


@dataclasses.dataclass(frozen=True, slots=True)
class MirrorState:
    """An exclusive session's pool state (AttachResponse.pool_state with
    want_engine_state): :func:`export_state`'s value as CBOR, its version, the engine's
    rules fingerprint and the session's cache namespace."""

    engine_state: bytes
    version: int
    rules: str
    cache_namespace: str


def _noop() -> None:
    pass


T = TypeVar("T")


def drain(work: Generator[None, None, T]) -> T:
    """Run a sliced piece of work (:meth:`PoolService.applying`) to its end at once."""
    while True:
        try:
            next(work)
        except StopIteration as done:
            value: T = done.value
            return value


#: the checks of a run that has none
_NO_CHECKS = op.RunChecks((), (), (), (), (), ())


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
        #: no session may attach before this monotonic time (post-restart grace)
        self.grace_until = 0.0
        #: when this incarnation was created (seconds since the epoch; journaled, so a
        #: recovered pool keeps it): its counters' ``_created`` time
        self.created_at = 0.0
        #: earlier instances of this server whose state was recovered without loss
        #: (durability.py): their fences stay valid for this incarnation
        self.lineage: frozenset[str] | set[str] = frozenset()
        #: the byte budget of a TakeEventsOp's events (the servicer sets it from the
        #: server's max_message_bytes; None: no budget)
        self.answer_event_bytes: int | None = None
        #: live reservations' holders and deadlines (the engine holds the blocks); a
        #: reservation the engine holds without one here (recovered) is expired
        self.reservation_leases: dict[str, ReservationLease] = {}
        #: proves a fence's journal position against what this journal holds (positions.py)
        self.positions: JournalPositions | None = None

    # -- fencing and sessions -----------------------------------------------------------
    def check_fence(self, fence: Fence | None) -> None:
        """Refuse a caller whose block ids belong to another instance or incarnation.

        Raises:
            ServiceError: FAILED_PRECONDITION with INSTANCE_CHANGED / INCARNATION_CHANGED;
                UNAVAILABLE when the caller was answered under a newer term (this
                replica was deposed: another owner serves the pool).
        """
        if fence is None:
            return
        if not self.knows_instance(fence.instance_id):
            raise ServiceError(
                Status.PRECONDITION,
                f"the server restarted (instance {fence.instance_id[:40]!r} is gone, this is "
                f"{self.fence.instance_id!r}): every block id you hold in pool {self.name!r} is void; "
                "attach again and recompute your requests",
                ErrorReason.INSTANCE_CHANGED,
            )
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
        if fence.position and self.positions is not None:
            self.positions.check(fence)

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
    ) -> Session:
        """The hash handshake, then a new session of ``tenant``.

        ``profile`` is the semantics profile the client follows (``""``: vllm-0.16).

        Raises:
            ServiceError: FAILED_PRECONDITION when the client follows another profile
                (PROFILE_MISMATCH), naming each hash difference (HASH_MISMATCH), or when an exclusive session would share the pool
                or a pool with fine-grained hits has a session already (POOL_EXCLUSIVE); UNAVAILABLE (GRACE_PERIOD)
                right after a restart; RESOURCE_EXHAUSTED when the tenant already has
                ``max_sessions`` (default: max_sessions_per_tenant) live sessions.
        """
        mine = self.config.profile
        theirs = profile or VLLM_016
        if theirs != mine:
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.name!r} follows profile {mine!r} but the client follows {theirs[:64]!r}: "
                "its hashes and the pool's answers would not agree; attach with the pool's profile",
                ErrorReason.PROFILE_MISMATCH,
            )
        algo, block_size, seed = self.hash_settings
        diffs = []
        if hash_algo != algo:
            diffs.append(f"hash_algo is {algo!r} but the client uses {hash_algo[:64]!r}")
        if hash_block_size != block_size:
            diffs.append(f"hash_block_size is {block_size} but the client uses {hash_block_size}")
        if hash_seed != seed:
            diffs.append(f"hash_seed is {seed!r} but the client uses {hash_seed[:64]!r}")
        lag = self.config.num_hash_lookahead_tokens
        if num_hash_lookahead_tokens != lag:
            diffs.append(
                f"num_hash_lookahead_tokens is {lag} but the client uses {num_hash_lookahead_tokens}"
            )
        if diffs:
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.name!r} hashes differently, so no prefix would ever hit: " + "; ".join(diffs),
                ErrorReason.HASH_MISMATCH,
            )
        wait = self.grace_until - self.sessions.clock()
        if wait > 0:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"the server restarted while leases of its previous instance may still run; pool "
                f"{self.name!r} hands out no block for another {wait:.1f} s (retry then)",
                ErrorReason.GRACE_PERIOD,
            )
        others = self.sessions.of_pool(self.name)
        if self.config.partial_hash_hits and others:
            # The copy-on-write pairs and their retained blocks are the pool's, not a
            # session's: one session takes and releases them all, and drops them when
            # it ends (end_session).
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.name!r} has fine-grained (partial) hits, whose copy-on-write pairs one "
                f"session takes and releases: it already has {len(others)} session(s); attach once it ends",
                ErrorReason.POOL_EXCLUSIVE,
            )
        holder = next((o for o in others if o.exclusive), None)
        if holder is not None or (exclusive and others):
            if holder is None:
                # Other tenants' sessions are not counted to this one (nor named).
                own = sum(1 for o in others if o.tenant == tenant)
                whose = (
                    f"{own} session(s) of your tenant" if own == len(others) else "sessions of other tenants"
                )
                if 0 < own < len(others):
                    whose += f" and {own} of yours"
                message = f"pool {self.name!r} has {whose}; an exclusive session must be the only one"
            else:
                # The holder's client is named to its own tenant only.
                whose = f"({holder.client_name!r})" if holder.tenant == tenant else "of another tenant"
                message = f"pool {self.name!r} has an exclusive session {whose}; no other may attach"
            raise ServiceError(Status.PRECONDITION, message, ErrorReason.POOL_EXCLUSIVE)
        limit = max_sessions or self.limits.max_sessions_per_tenant
        live = self.sessions.count_of_tenant(tenant)
        if live >= limit:
            raise ServiceError(
                Status.EXHAUSTED,
                f"tenant {tenant or '(full access)'!r} already has {live} live sessions "
                f"(max_sessions_per_tenant {limit}); detach unused ones or let their leases end",
            )
        s = self.sessions.open(self.name, client_name, lease_seconds)
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
            ServiceError: see :meth:`check_fence` and :meth:`SessionTable.get`.
        """
        self.check_fence(fence)
        s = self.sessions.get(session_id, self.name)
        self.sessions.renew(s)
        return s

    def end_session(self, s: Session) -> int:
        """Free every request the session still owns (detach, lease expiry, a restored
        server's void sessions). In a pool with fine-grained hits (one session at a
        time: :meth:`attach`) the copy-on-write pairs it was handed and did not release,
        or not taken yet, end with it: nobody else would run the copies or release
        their blocks."""
        self.sessions.close(s.session_id)
        owned = list(s.owned)
        for rid in owned:
            self.engine.free(rid)
            del self.owners[rid]
        s.owned.clear()
        if self.config.partial_hash_hits:
            self.engine.drop_block_copies()
        self._publish()
        return len(owned)

    # -- reads ----------------------------------------------------------------------------
    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], num_tokens: int, tenant: str = ""
    ) -> CacheHit:
        """The hit a request of ``tenant`` with these hashes would get; changes nothing."""
        return self.engine.find_longest_cache_hit(block_hashes, num_tokens, self.cache_namespace(tenant))

    # -- routing (ScorePools, scoring.py) -------------------------------------------------
    def score(
        self, prompts: Mapping[ScoreSettings, Sequence[bytes]], num_tokens: int, tenant: str = ""
    ) -> PoolScore | UnscoredPool:
        """This pool's score for a prompt of ``num_tokens`` tokens hashed once per hash
        settings: the hit :meth:`find_longest_cache_hit` answers for ``tenant`` (the
        same engine call: read-only), or why the pool cannot be scored.

        Raises:
            ServiceError: INVALID_ARGUMENT naming the pool when the prompt with its
                settings has the wrong hashes (count, type, length).
        """
        engine = self.engine
        if num_tokens > engine.max_model_len:
            return UnscoredPool(
                self.name,
                UNSCORED_TOO_LONG,
                f"the prompt's {num_tokens} tokens exceed the pool's max_model_len {engine.max_model_len}",
            )
        if self.config.enable_caching:
            hashes = prompts.get(self.score_settings)
            if hashes is None:
                algo, size, seed = self.hash_settings
                return UnscoredPool(
                    self.name,
                    UNSCORED_NO_PROMPT,
                    f"no prompt hashed with the pool's settings (hash_algo {algo!r}, hash_block_size "
                    f"{size}, hash_seed {seed!r}, profile {self.config.profile!r}"
                    + (
                        f", num_hash_lookahead_tokens {self.config.num_hash_lookahead_tokens})"
                        if self.config.num_hash_lookahead_tokens
                        else ")"
                    ),
                )
        else:
            hashes = ()  # nothing is ever cached: the hit is empty whatever the hashes
        try:
            # the engine's own call, one layer less than find_longest_cache_hit above
            hit = engine.find_longest_cache_hit(
                hashes, num_tokens, self.cache_namespace(tenant) if tenant else ""
            )
        except EngineError as exc:
            raise ServiceError(Status.INVALID, f"pool {self.name!r}: {exc}") from None
        free, usage = engine.free_and_usage()
        return new_score(self.name, hit, free, usage, self.config.num_blocks - 1, self.fence)

    # -- what ScoreIndex (scoring.py) reads: hit lengths without this pool's own search
    def score_target(self) -> tuple[BlockHashToBlockMap, int, int, int, str] | None:
        """What a cross-pool score index watches here: the prefix-cache map (a new
        engine has a new one), the id and block size of the full-attention group the
        search starts with, the hash block size, and how a hit follows from that
        group's run of cached keys ("unitary", "eagle": one group; "run": a hybrid whose
        first attention group is that group alone; "search": the coordinator's own
        search). ``None`` when caching is off or the search starts otherwise.

        A vllm-0.33 pool of one group has the same search as a 0.16 one (the run of
        cached keys, at most ``(num_tokens - 1) // block_size`` blocks and one per hash
        it has: look-ahead hashes are fewer; 0.33 refuses EAGLE's drop). A vllm-0.33
        hybrid is "search": its hit is cut back on every full-attention group, so an
        empty run of the first one means no hit, and any other run is its own
        coordinator's search (sparse retention, scheduler-block alignment and
        shared-prefix junctions are rules the run alone does not follow)."""
        engine = self.engine
        cfg = engine.config
        first = engine.hits._first_full
        if first is None or not cfg.enable_caching or (cfg.profile != VLLM_016 and cfg.use_eagle):
            return None
        if cfg.coordinator_kind == "unitary":
            how = "eagle" if cfg.use_eagle else "unitary"
        elif cfg.profile != VLLM_016:
            how = "search"
        else:
            how = "run" if len(engine.coordinator.attention_groups[0][1]) == 1 else "search"  # type: ignore[attr-defined]
        return engine.block_pool.cached_block_hash_to_block, first[0], first[1], cfg.hash_block_size, how

    def score_map(self) -> BlockHashToBlockMap:
        return self.engine.block_pool.cached_block_hash_to_block

    def score_keys(
        self, prompts: Mapping[ScoreSettings, Sequence[bytes]], num_tokens: int, tenant: str
    ) -> Sequence[bytes] | None:
        """The keys :meth:`score` searches for, after its checks; ``None`` when
        :meth:`score` answers an :class:`UnscoredPool` (or caching is off).

        Raises:
            ServiceError: as :meth:`score`.
        """
        engine = self.engine
        hashes = prompts.get(self.score_settings)
        if num_tokens > engine.max_model_len or hashes is None:
            return None
        try:
            return engine.hits.lookup_keys(hashes, num_tokens, self.cache_namespace(tenant) if tenant else "")
        except EngineError as exc:
            raise ServiceError(Status.INVALID, f"pool {self.name!r}: {exc}") from None

    def score_of_length(self, hit: CacheHit) -> PoolScore:
        """This pool's score with ``hit`` (found by a score index)."""
        free, usage = self.engine.free_and_usage()
        return new_score(self.name, hit, free, usage, self.config.num_blocks - 1, self.fence)

    def hit_length_from_run(self, keys: Sequence[bytes], num_tokens: int, run: int) -> int:
        """The hit length of a "run" pool (:meth:`score_target`) given its first group's run."""
        return int(self.engine.coordinator.hit_length_from_run(keys, num_tokens - 1, run))  # type: ignore[attr-defined]

    def reserve(
        self, reservation_id: str, hashes: Sequence[bytes], num_tokens: int, tenant: str, seconds: float
    ) -> CacheHit:
        """Hold ``tenant``'s hit of this prompt for ``seconds`` (engine ``reserve``); an
        empty hit holds nothing. The caller checks limits and journals it.

        Raises:
            ServiceError: FAILED_PRECONDITION when an exclusive session holds the pool
                (its client predicts every allocation: a held block would break that).
        """
        if any(o.exclusive for o in self.sessions.of_pool(self.name)):
            raise ServiceError(
                Status.PRECONDITION,
                f"pool {self.name!r} has an exclusive session, which predicts every allocation: "
                "it cannot hold reservations",
                ErrorReason.POOL_EXCLUSIVE,
            )
        hit = self.engine.reserve(reservation_id, hashes, num_tokens, self.cache_namespace(tenant))
        if hit.num_tokens:
            self.reservation_leases[reservation_id] = ReservationLease(
                tenant, self.sessions.clock() + seconds
            )
        return hit

    def expired_reservations(self) -> list[str]:
        """Live reservations whose time ran out (or whose lease was lost in a restart)."""
        now = self.sessions.clock()
        leases = self.reservation_leases
        return [
            rid
            for rid in self.engine.reservations.live
            if (lease := leases.get(rid)) is None or lease.deadline <= now
        ]

    def release_reservation(self, reservation_id: str) -> bool:
        """Release a reservation no request adopted (expiry; also a journal replay)."""
        self.reservation_leases.pop(reservation_id, None)
        return self.engine.release_reservation(reservation_id)

    def reservations_of(self, tenant: str) -> int:
        return sum(1 for lease in self.reservation_leases.values() if lease.tenant == tenant)

    def _adopt(self, rid: str, got_tokens: int) -> None:
        r = self.engine.adopt_reservation(rid, got_tokens)
        if r is not None:
            self.reservation_leases.pop(r.reservation_id, None)

    def _allocate_adopting(self, s: Session, o: op.Allocate) -> op.Value:
        """:meth:`_allocate`; a request's first allocation then adopts the oldest
        reservation made for its prompt (the pool is vLLM's exactly while none is live)."""
        engine = self.engine
        if not engine.reservations.live:
            return self._allocate_plain(s, o) if o.plain else self._allocate(s, o)
        rid = o.sync.request_id
        first = not (rid in engine.requests and any(m.req_to_blocks.get(rid) for m in engine.managers))
        value = self._allocate(s, o)
        if first and isinstance(value, op.AllocateOutcome) and value.new_block_ids is not None:
            got = value.hit.num_tokens if value.hit is not None else o.num_new_computed_tokens
            self._adopt(rid, got)
        return value

    def _admit_adopting(self, s: Session, o: op.Admit) -> op.Value:
        """:meth:`_admit`; each admitted request then adopts a reservation of its prompt,
        in admission order."""
        if not self.engine.reservations.live:
            return self._admit(s, o)
        value = self._admit(s, o)
        if isinstance(value, op.Admitted):
            for sync, outcome in zip(o.syncs, value.outcomes, strict=False):
                if outcome.new_block_ids is not None:
                    self._adopt(sync.request_id, outcome.hit.num_tokens if outcome.hit is not None else 0)
        return value

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
        self._publish()
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
        """Release a deleted pool's objects a slice at a time (yields between slices)."""
        return self.engine.teardown()

    def export_state(self) -> dict[str, Any]:
        """The engine's state as plain values (snapshots: recovery.py)."""
        return export_state(self.engine)

    def import_state(self, value: dict[str, Any]) -> None:
        """Replace the engine by one rebuilt from :meth:`export_state`'s value."""
        self.engine = import_state(self.config, value)

    def replay_reserve(
        self, reservation_id: str, hashes: Sequence[bytes], num_tokens: int, tenant: str
    ) -> None:
        """Hold a journaled reservation again, with no lease (recovery releases it at once:
        :meth:`expired_reservations`)."""
        self.engine.reserve(reservation_id, hashes, num_tokens, self.cache_namespace(tenant))

    # -- operations ---------------------------------------------------------------------
    def apply(self, s: Session, ops: Sequence[op.Operation]) -> list[op.Outcome]:
        """Apply ``ops`` in order for session ``s``; after the first failure the rest
        are not applied (``aborted_by`` names the failed one). Earlier ones stay.

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when there are too many operations.
        """
        return drain(self.applying(s, ops))

    def applying(
        self, s: Session, ops: Sequence[op.Operation], every: int = 0
    ) -> Generator[None, None, list[op.Outcome]]:
        """:meth:`apply` in slices: a generator that yields after every ``every``
        operations (0: never) and returns the outcomes. Its caller may serve other
        pools between slices, but nothing may touch this pool until it returns (the
        session's statistics are swapped into the engine meanwhile; pool_locks.py).

        Raises:
            ServiceError: RESOURCE_EXHAUSTED when there are too many operations.
        """
        self.check_step_size(len(ops))
        engine = self.engine
        shared_stats = engine.prefix_cache_stats
        if shared_stats is not None:
            engine.prefix_cache_stats = s.stats
        out: list[op.Outcome] = []
        failed = -1
        try:
            for i, o in enumerate(ops):
                if failed >= 0:
                    out.append(op.Outcome(aborted_by=failed))
                    continue
                if every and i and not i % every:
                    yield
                try:
                    if every and type(o) is op.Allocate and self._sliceable(o):
                        value = yield from self._allocating(s, o, ALLOCATE_SLICE_BLOCKS)
                    else:
                        value = _HANDLERS[type(o)](self, s, o)
                except ServiceError as exc:
                    out.append(op.Outcome(error=exc))
                    failed = i
                except Exception as exc:  # engine errors keep their status (errors.py)
                    out.append(op.Outcome(error=as_service_error(exc)))
                    failed = i
                else:
                    out.append(op.Outcome(value))
        finally:
            # Once for the whole Step: an operation reading the journal (TakeEvents,
            # a prefix-cache reset) publishes what came before it itself, and the
            # journal keeps the same events whether they come one by one or at once.
            self._publish()
            if shared_stats is not None:
                s.stats = engine.prefix_cache_stats
                engine.prefix_cache_stats = shared_stats
        return out

    def check_step_size(self, n: int) -> None:
        """Raises:
        ServiceError: RESOURCE_EXHAUSTED when ``n`` operations are more than a Step may hold.
        """
        if n > self.limits.max_ops_per_step:
            raise ServiceError(
                Status.EXHAUSTED,
                f"{n} operations in one Step; the limit is {self.limits.max_ops_per_step}",
            )

    def free_requests(self, s: Session, request_ids: Sequence[str], preempt: bool) -> None:
        """Free (or preempt) several requests, all checked before any is touched.

        Raises:
            ServiceError: INVALID_ARGUMENT for a duplicate, NOT_FOUND
                (REQUEST_UNKNOWN) for an unknown request or another tenant's,
                PERMISSION_DENIED for another session's request of the same tenant.
        """
        drain(self.freeing_requests(s, request_ids, preempt))

    def freeing_requests(
        self, s: Session, request_ids: Sequence[str], preempt: bool, every: int = 0
    ) -> Generator[None, None, None]:
        """:meth:`free_requests` in slices: a generator that yields after every
        ``every`` requests freed (0: never), every check made before the first; nothing
        may touch this pool until it returns (pool_locks.py).

        Raises:
            ServiceError: as :meth:`free_requests`, before the first yield.
        """
        if len(set(request_ids)) != len(request_ids):
            raise ServiceError(Status.INVALID, "request_ids lists a request twice")
        for rid in request_ids:
            self._owned(s, rid)
        kind = op.Preempt if preempt else op.Free
        outcomes = yield from self.applying(s, [kind(rid) for rid in request_ids], every)
        for o in outcomes:
            if o.error is not None:  # pragma: no cover - every failure is checked above
                raise o.error

    # -- internals ----------------------------------------------------------------------
    def _publish(self) -> None:
        events = self.engine.take_events()
        if events:
            self.events.publish(events)

    def _position(self, rid: str) -> Position:
        req = self.engine.requests.get(rid)
        if req is None:
            return Position(rid, False)
        return Position(rid, True, req.num_tokens, len(req.block_hashes), req.num_computed_tokens)

    def _owned(self, s: Session, rid: str) -> None:
        """Check that ``rid`` exists and belongs to ``s``."""
        if not rid:
            raise ServiceError(Status.INVALID, "request_id is required")
        owner = self.owners.get(rid)
        if owner is None or owner.tenant != s.tenant:
            # Another tenant's request is answered exactly as an unknown one: no caller
            # learns which request ids another tenant has live.
            raise ServiceError(
                Status.NOT_FOUND,
                f"request {rid[:128]!r} is not in pool {self.name!r} (never registered, or freed)",
                ErrorReason.REQUEST_UNKNOWN,
                self._position(rid) if owner is None else Position(rid, False),
            )
        if owner is not s:
            raise ServiceError(
                Status.DENIED,
                f"request {rid[:128]!r} belongs to another session of pool {self.name!r}",
            )

    def sync(self, s: Session, sync: op.RequestSync) -> Undo:
        """Apply a positioned request sync; returns how to undo it.

        Raises:
            ServiceError: SYNC_MISMATCH / REQUEST_UNKNOWN with the server's position,
                PERMISSION_DENIED, RESOURCE_EXHAUSTED; engine errors for bad values.
        """
        rid = sync.request_id
        engine = self.engine
        if sync.new_request:
            if not rid:
                raise ServiceError(Status.INVALID, "request_id is required")
            if sync.base_num_tokens or sync.base_num_hashes:
                raise ServiceError(
                    Status.INVALID,
                    f"request {rid[:128]!r}: a new_request sync starts at position 0, got base "
                    f"{sync.base_num_tokens} tokens / {sync.base_num_hashes} hashes",
                )
            owner = self.owners.get(rid)
            if owner is not None and owner.tenant != s.tenant:
                # Request ids are pool-wide: this one is taken, and saying so is unavoidable
                # (README "Tenants"), but not by whom.
                raise ServiceError(
                    Status.DENIED,
                    f"request id {rid[:128]!r} is in use in pool {self.name!r}; request ids are shared by "
                    "every tenant of a pool: use unique (random) ones",
                )
            if owner is not None and owner is not s:
                raise ServiceError(
                    Status.DENIED,
                    f"request {rid[:128]!r} belongs to another session of pool {self.name!r}",
                )
            if rid in engine.requests:
                raise ServiceError(
                    Status.PRECONDITION,
                    f"request {rid[:128]!r} is already registered in pool {self.name!r}",
                    ErrorReason.SYNC_MISMATCH,
                    self._position(rid),
                )
            if len(engine.requests) >= self.limits.max_requests_per_pool:
                raise ServiceError(
                    Status.EXHAUSTED,
                    f"pool {self.name!r} already tracks {len(engine.requests)} requests (max_requests_per_pool)",
                )
            engine.add_request(
                rid,
                sync.append_token_ids,
                sync.append_block_hashes,
                lora=sync.lora,
                skip_reading_prefix_cache=sync.skip_reading_prefix_cache,
                num_preemptions=sync.num_preemptions or 0,
                cache_namespace=s.cache_namespace,
                cache_salt=sync.cache_salt,
                extra_key_sources=sync.extra_key_sources,
                num_prompt_tokens=sync.num_prompt_tokens,
                kv_cache_report_full=sync.kv_cache_report_full,
            )
            if sync.num_computed_tokens is not None:
                try:
                    engine.update_request(rid, num_computed_tokens=sync.num_computed_tokens)
                except Exception:
                    engine.restore_request(rid, None)
                    raise
            self.owners[rid] = s
            s.owned[rid] = None

            def forget() -> None:
                engine.restore_request(rid, None)
                self.owners.pop(rid, None)
                s.owned.pop(rid, None)

            return forget
        if self.owners.get(rid) is not s:  # (a request id of s is never empty)
            self._owned(s, rid)  # raises, saying why
        req = engine.requests[rid]
        if req.num_tokens != sync.base_num_tokens or len(req.block_hashes) != sync.base_num_hashes:
            raise ServiceError(
                Status.PRECONDITION,
                f"request {rid[:128]!r}: the sync applies at {sync.base_num_tokens} tokens / "
                f"{sync.base_num_hashes} hashes, but the server holds {req.num_tokens} / "
                f"{len(req.block_hashes)}; nothing was changed",
                ErrorReason.SYNC_MISMATCH,
                self._position(rid),
            )
        computed = sync.num_computed_tokens
        if not sync.append_token_ids and not sync.append_block_hashes and computed is None:
            return _noop
        # engine.checkpoint_request's value, from the record at hand
        checkpoint = RequestCheckpoint(req.num_tokens, len(req.block_hashes), req.num_computed_tokens)
        engine.update_request(
            rid,
            num_computed_tokens=computed,
            append_token_ids=sync.append_token_ids,
            append_block_hashes=sync.append_block_hashes,
        )
        return lambda: engine.restore_request(rid, checkpoint)

    def _with_sync(self, s: Session, sync: op.RequestSync, call: Callable[[str], op.Value]) -> op.Value:
        undo = self.sync(s, sync)
        try:
            return call(sync.request_id)
        except Exception:
            undo()
            raise

    def _lookup(self, s: Session, o: op.Lookup) -> op.Value:
        if o.hint:
            if o.answered is not None:
                raise ServiceError(Status.INVALID, "a lookup is either a hint or answered")
            if not s.exclusive:
                raise ServiceError(
                    Status.PRECONDITION,
                    "hint lookups need an exclusive session: with other sessions on the pool "
                    "nothing the client can see proves a hint still holds",
                )
            limit = min(o.walk_limit or DEFAULT_WALK_LIMIT, MAX_WALK_LIMIT)

            def hinted(rid: str) -> op.Value:
                hit, margin = self.engine.lookup_hint(rid, limit)
                return op.Hinted(hit, margin)

            return self._with_sync(s, o.sync, hinted)
        answered = o.answered
        if answered is None:
            if self.engine.rules.full_sequence_admission:  # vllm-0.33: with the junction

                def looked_up(rid: str) -> op.Value:
                    hit = self.engine.get_computed_blocks(rid)
                    return op.LookedUp(hit, self.engine.shared_prefix_boundary(rid))

                return self._with_sync(s, o.sync, looked_up)
            return self._with_sync(s, o.sync, self.engine.get_computed_blocks)

        def checked(rid: str) -> op.Value:
            try:
                return self.engine.check_lookup(rid, answered, answered.num_tokens)
            except HintMismatchError as err:
                raise ServiceError(
                    Status.PRECONDITION,
                    f"{err}; the client's proof that its hint still held was wrong: treat the "
                    "requests of this Step as lost and report this as a bug",
                    ErrorReason.PREDICTION_FAILED,
                ) from None

        return self._with_sync(s, o.sync, checked)

    def _allocate(self, s: Session, o: op.Allocate) -> op.Value:
        engine = self.engine
        rid = o.sync.request_id
        undo = self._allocate_begins(s, o)
        try:
            if o.lookup:
                res = engine.allocate_slots_with_lookup(
                    rid,
                    o.num_new_tokens,
                    o.num_lookahead_tokens,
                    o.num_external_computed_tokens,
                    o.delay_cache_blocks,
                    o.num_encoder_tokens,
                    o.full_sequence_must_fit,
                    o.reserved_blocks,
                    o.num_in_flight_tokens,
                    o.watermark_blocks,
                    o.skip_zeroing_group_ids,
                )
                if res.new_block_ids is None and o.must_succeed:
                    raise self._prediction_failed(rid)
                table = (
                    engine.get_block_ids(rid) if o.return_table and res.new_block_ids is not None else None
                )
                return op.AllocateOutcome(res.new_block_ids, res.num_new_tokens, res.hit, table=table)
            new = engine.allocate_slots(rid, *_allocate_args(o))
            if new is None and o.must_succeed:
                raise self._prediction_failed(rid)
        except Exception as exc:
            return self._allocate_failed(exc, undo, o)
        return self._allocate_granted(new, o)

    def _sliceable(self, o: op.Allocate) -> bool:
        """Whether an Allocate of a Step applied in slices takes its blocks in slices
        too (:meth:`_allocating`): a large one without lookup, no reservation live
        (a first allocation may adopt one: :meth:`_allocate_adopting`)."""
        return (
            not o.lookup
            and type(o.num_new_tokens) is int
            and o.num_new_tokens >= SLICED_ALLOCATE_TOKENS
            and not self.engine.reservations.live
        )

    def _allocating(self, s: Session, o: op.Allocate, every: int) -> Generator[None, None, op.Value]:
        """:meth:`_allocate` without lookup, the engine taking and caching the blocks
        ``every`` at a time (yielding between slices, after every check that can
        refuse: engine.KVCachePool.allocating_slots); the same outcome and pool."""
        rid = o.sync.request_id
        undo = self._allocate_begins(s, o)
        try:
            new = yield from self.engine.allocating_slots(every, rid, *_allocate_args(o))
            if new is None and o.must_succeed:
                raise self._prediction_failed(rid)
        except Exception as exc:
            return self._allocate_failed(exc, undo, o)
        return self._allocate_granted(new, o)

    def _allocate_begins(self, s: Session, o: op.Allocate) -> Callable[[], None]:
        """An Allocate's checks and request sync; returns what undoes the sync."""
        if o.must_refuse and (o.must_succeed or o.lookup):
            raise ServiceError(Status.INVALID, "must_refuse cannot be combined with must_succeed or lookup")
        return self.sync(s, o.sync)

    def _allocate_failed(self, exc: Exception, undo: Callable[[], None], o: op.Allocate) -> op.Value:
        """An Allocate whose engine call raised ``exc``: the sync undone, the error
        raised again, except a stale hit."""
        undo()
        if not isinstance(exc, StaleCacheHitError):
            raise exc
        # A concurrency conflict, not bad input: an outcome with nothing changed
        # (the request sync that came with it is undone too) -- unless the client
        # already answered it as a success.
        if o.must_succeed:
            raise self._prediction_failed(o.sync.request_id) from None
        return op.AllocateOutcome(None, o.num_new_tokens, stale_hit=True)

    def _allocate_granted(self, new: BlockIds | None, o: op.Allocate) -> op.Value:
        """The outcome of an Allocate the engine answered ``new``."""
        engine = self.engine
        rid = o.sync.request_id
        if new is not None and o.must_refuse:
            # Applied (its blocks stay with the request until the client frees it).
            raise ServiceError(
                Status.PRECONDITION,
                f"request {rid[:128]!r}: the pool granted an allocation the client had already answered "
                f"as refused ({engine.num_free_blocks} blocks free after it); its count of free blocks "
                "was wrong, treat the requests of this Step as lost and report this as a bug",
                ErrorReason.PREDICTION_FAILED,
            )
        table = engine.get_block_ids(rid) if o.return_table and new is not None else None
        return op.AllocateOutcome(new, o.num_new_tokens, table=table)

    def _allocate_plain(self, s: Session, o: op.Allocate) -> op.Value:
        """:meth:`_allocate` for a plain allocation (``o.plain``: a decode step's): the
        request's update and its allocation in one engine call, without the general
        path's undo. Anything the general path would refuse or treat otherwise (not
        this session's request, another position, nothing to update) goes to it."""
        sync = o.sync
        rid = sync.request_id
        req = self.engine.requests.get(rid)
        if (
            self.owners.get(rid) is not s
            or req is None
            or len(req.all_token_ids) != sync.base_num_tokens
            or len(req.block_hashes) != sync.base_num_hashes
            or not sync.append_token_ids
        ):
            return self._allocate(s, o)
        # A refused update changes nothing; an allocation that raises takes the update
        # back (as _allocate's undo does); a refusal (None) keeps the update, as there.
        new = self.engine.update_and_allocate(
            rid, sync.num_computed_tokens, sync.append_token_ids, sync.append_block_hashes, o.num_new_tokens
        )
        return op.AllocateOutcome(new, o.num_new_tokens)

    def _allocate_run(self, s: Session, o: op.AllocateRun) -> op.Value:
        """Each entry as an AllocateOp with its sync and must_succeed, in order."""
        n = len(o.request_ids)
        columns = (o.base_num_tokens, o.base_num_hashes, o.num_computed_tokens, o.num_new_tokens,
                   o.num_lookahead_tokens, o.num_append_tokens, o.num_append_hashes)  # fmt: skip
        if any(len(c) != n for c in columns):
            raise ServiceError(Status.INVALID, "allocate_run: every column needs one value per entry")
        if sum(o.num_append_tokens) != len(o.append_token_ids) or sum(o.num_append_hashes) != len(
            o.append_block_hashes
        ):
            raise ServiceError(
                Status.INVALID,
                "allocate_run: num_append_tokens / num_append_hashes do not add up to the appended values",
            )
        engine = self.engine
        requests = engine.requests
        tokens, hashes = o.append_token_ids, o.append_block_hashes
        groups = len(engine.managers)
        counts = [0] * (n * groups)  # an entry taking no block (most) leaves its zeros
        new_ids: list[int] = []
        checks = o.checks or _NO_CHECKS
        check_at = self._check_positions(checks, n)
        mine = self._owned_prefix(s, o.request_ids)
        i = t = h = c = 0
        while i < n:
            while c < len(check_at) and check_at[c] == i:
                self._check_unchanged(s, checks, c)
                c += 1
            stop = min(mine, check_at[c] if c < len(check_at) else n)
            if i < stop:
                # plain decode steps up to the next check, in one engine call; entry i
                # is the first it left (untouched) for the one-by-one path below
                i, t, h = engine.decode_run(o, i, stop, t, h, counts, new_ids)
                if i == stop:
                    continue
            rid = o.request_ids[i]
            nt, nh = o.num_append_tokens[i], o.num_append_hashes[i]
            base_t, base_h = o.base_num_tokens[i], o.base_num_hashes[i]
            req = requests.get(rid)
            if i >= mine or req is None or req.num_tokens != base_t or len(req.block_hashes) != base_h:
                # not this session's, or not at that position: the general path says which
                self.sync(s, op.RequestSync(rid, (), (), False, base_t, base_h))
                raise AssertionError(f"request {rid!r} passed the checks it failed")  # pragma: no cover
            before = (req.num_tokens, len(req.block_hashes), req.num_computed_tokens)
            engine.update_request(rid, num_computed_tokens=o.num_computed_tokens[i],
                                  append_token_ids=tokens[t : t + nt], append_block_hashes=hashes[h : h + nh])  # fmt: skip
            t += nt
            h += nh
            try:
                new = engine.allocate_slots(rid, o.num_new_tokens[i], 0, None, o.num_lookahead_tokens[i])
                if new is None:
                    raise self._prediction_failed(rid)
            except Exception:
                engine.restore_request(rid, RequestCheckpoint(*before))
                raise
            for g, group in enumerate(new):
                if group:
                    counts[i * groups + g] = len(group)
                    new_ids += group
            i += 1
        while c < len(check_at):
            self._check_unchanged(s, checks, c)
            c += 1
        return op.RunOutcome(counts, new_ids)

    def _owned_prefix(self, s: Session, request_ids: Sequence[str]) -> int:
        """How many of ``request_ids``, from the first, are requests ``s`` holds (all of
        them, in a session's own decode step; one pass in C)."""
        holders = list(map(self.owners.get, request_ids))
        if holders.count(s) == len(holders):
            return len(holders)
        return next(k for k, x in enumerate(holders) if x is not s)

    @staticmethod
    def _check_positions(checks: op.RunChecks, n: int) -> Sequence[int]:
        """The checks' positions, once every column has one value per check and the
        positions go from 0 to ``n`` without going back."""
        m = len(checks.request_ids)
        if not m and not checks.at:
            return ()
        columns = (checks.at, checks.num_computed_tokens, checks.num_new_tokens, checks.num_lookahead_tokens,
                   checks.num_tokens)  # fmt: skip
        if any(len(col) != m for col in columns):
            raise ServiceError(
                Status.INVALID,
                "allocate_run: every check_* column needs one value per check",
            )
        at = checks.at
        if m and (at[-1] > n or any(a > b for a, b in zip(at, at[1:], strict=False))):
            raise ServiceError(
                Status.INVALID,
                f"allocate_run: check_at must not decrease and be at most the number of entries ({n})",
            )
        return at

    def _check_unchanged(self, s: Session, checks: op.RunChecks, j: int) -> None:
        """Check j of a run: the allocation the client answered as changing nothing would
        indeed change nothing."""
        rid = checks.request_ids[j]
        self._owned(s, rid)
        if not self.engine.allocation_changes_nothing(
            rid, checks.num_computed_tokens[j], checks.num_new_tokens[j], checks.num_lookahead_tokens[j],
            checks.num_tokens[j],
        ):  # fmt: skip
            raise self._prediction_failed(
                rid, "an allocation the client had already answered as changing nothing would take, cache or "
                "free blocks"
            )  # fmt: skip

    def _decode(self, s: Session, o: op.Decode) -> op.Value:
        """A DecodeOp: a decode step's allocations in columns, each entry answered, and
        leaving the pool, exactly as its AllocateOp would in the same Step. An entry of
        this session's request at its position with tokens to append, while no
        reservation is live, takes the engine's fused update-and-allocate (as
        :meth:`_allocate_plain`); any other entry is built into its Allocate and applied
        by the Allocate handler, which says what is wrong with it. The first entry that
        fails fails the operation with its own error (op.DecodeFailed, carrying the
        entries before it, which stay applied).

        Raises:
            ServiceError: INVALID_ARGUMENT (nothing applied) when the columns do not have
                one value per entry or the appended values do not add up;
                :class:`~.operations.DecodeFailed` when an entry fails.
        """
        rids = o.request_ids
        n = len(rids)
        base_t, base_h, computed = o.base_num_tokens, o.base_num_hashes, o.num_computed_tokens
        new_tokens, look, num_t, num_h = (
            o.num_new_tokens,
            o.num_lookahead_tokens,
            o.num_append_tokens,
            o.num_append_hashes,
        )
        if any(len(c) != n for c in (base_t, base_h, computed, new_tokens, look, num_t, num_h)):
            raise ServiceError(Status.INVALID, "decode: every column needs one value per entry")
        tokens, hashes = o.append_token_ids, o.append_block_hashes
        if sum(num_t) != len(tokens) or sum(num_h) != len(hashes):
            raise ServiceError(
                Status.INVALID,
                "decode: num_append_tokens / num_append_hashes do not add up to the appended values",
            )
        engine = self.engine
        must = o.must_succeed
        groups = len(engine.managers)
        counts = [0] * (n * groups)  # an entry taking no block (most) leaves its zeros
        ids: list[int] = []
        refused: list[int] = []
        # Entries of this session's requests, up to the first that is not (it fails and
        # stops the operation), take the engine's fused paths; none while a reservation is
        # live (a first allocation may adopt one: the handler's).
        mine = 0 if engine.reservations.live else self._owned_prefix(s, rids)
        requests = engine.requests
        run = engine.decode_run
        i = t = h = 0
        while i < n:
            if i < mine:
                # the run of plain decode steps, in one engine call; entry i is the first
                # it left (untouched) for the one-by-one path below
                i, t, h = run(o, i, mine, t, h, counts, ids)
                if i == n:
                    break
            rid, bt, bh, c, nn, la, nt, nh = (
                rids[i], base_t[i], base_h[i], computed[i], new_tokens[i], look[i], num_t[i], num_h[i]
            )  # fmt: skip
            tk, hs = tokens[t : t + nt], hashes[h : h + nh]
            t += nt
            h += nh
            try:
                req = requests.get(rid)
                if (
                    i < mine
                    and nt
                    and req is not None
                    and len(req.all_token_ids) == bt
                    and len(req.block_hashes) == bh
                ):
                    before = RequestCheckpoint(bt, bh, req.num_computed_tokens)
                    new = engine.update_and_allocate(rid, c, tk, hs, nn, la)
                    if new is None and must:  # as the Allocate handler: the sync undone, then the error
                        engine.restore_request(rid, before)
                        raise self._prediction_failed(rid)
                else:
                    sync = op.RequestSync(rid, tk, hs, False, bt, bh, c)
                    value = self._allocate_adopting(
                        s, op.Allocate(sync, nn, num_lookahead_tokens=la, must_succeed=must)
                    )
                    assert isinstance(value, op.AllocateOutcome)
                    new = value.new_block_ids
            except Exception as exc:  # noqa: BLE001 - every failure is the entry's answer
                raise op.DecodeFailed(
                    as_service_error(exc), op.DecodeOutcome(i, counts[: i * groups], ids, refused)
                ) from exc
            if new is None:
                refused.append(i)
            else:
                for g, group in enumerate(new):
                    if group:
                        counts[i * groups + g] = len(group)
                        ids += group
            i += 1
        return op.DecodeOutcome(n, counts, ids, refused)

    def _prediction_failed(self, rid: str, what: str = "") -> ServiceError:
        what = what or (
            f"the pool refused an allocation the client had already answered as successful "
            f"({self.engine.num_free_blocks} blocks free); its bound was wrong"
        )
        return ServiceError(
            Status.PRECONDITION,
            f"request {rid[:128]!r}: {what}, treat the requests of this Step as lost and report this as a bug",
            ErrorReason.PREDICTION_FAILED,
        )

    def _free(self, s: Session, o: op.Free) -> op.Value:
        if o.if_held and o.request_id and self.owners.get(o.request_id) is not s:
            # "Free it if I still hold it": not held by this session (its first free was
            # applied, or the id is another session's request by now), nothing to do.
            return None
        self._owned(s, o.request_id)
        self.engine.free(o.request_id, o.all_groups_reversed)
        del self.owners[o.request_id]
        s.owned.pop(o.request_id, None)
        return None

    def _preempt(self, s: Session, o: op.Preempt) -> op.Value:
        self._owned(s, o.request_id)
        self.engine.preempt(o.request_id)
        return None

    def _cache_blocks(self, s: Session, o: op.CacheBlocks) -> op.Value:
        return self._with_sync(s, o.sync, lambda rid: self.engine.cache_blocks(rid, o.num_computed_tokens))

    def _remove_skipped(self, s: Session, o: op.RemoveSkipped) -> op.Value:
        return self._with_sync(
            s, o.sync, lambda rid: self.engine.remove_skipped_blocks(rid, o.total_computed_tokens)
        )

    def _evict(self, s: Session, o: op.EvictBlocks) -> op.Value:
        self.engine.evict_blocks(o.block_ids)
        return None

    def _get_block_ids(self, s: Session, o: op.GetBlockIds) -> op.Value:
        self._owned(s, o.request_id)
        if o.computed_tokens is not None:
            if o.answered is not None:
                raise ServiceError(
                    Status.INVALID,
                    "get_block_ids: computed_tokens cannot come with answered",
                )
            return self.engine.get_block_ids_for_computed_tokens(o.request_id, o.computed_tokens)
        table = self.engine.get_block_ids(o.request_id)
        if o.answered is not None and o.answered != table:
            raise self._prediction_failed(
                o.request_id, f"the client answered its block table with {o.answered}, the pool holds {table}"
            )
        return table

    def _common_prefix(self, s: Session, o: op.CommonPrefix) -> op.Value:
        self._owned(s, o.request_id)
        return self.engine.get_num_common_prefix_blocks(o.request_id)

    def _reset(self, s: Session, o: op.ResetPrefixCache) -> op.Value:
        return self.reset_prefix_cache()

    def _take_events(self, s: Session, o: op.TakeEvents) -> op.Value:
        budget = self.answer_event_bytes
        return self.take_events(s, budget)

    def _make_stats(self, s: Session, o: op.MakeStats) -> op.Value:
        if o.peek:
            return self.engine.peek_prefix_cache_stats()
        return self.engine.make_prefix_cache_stats()

    def take_events(
        self,
        s: Session,
        max_bytes: int | None = None,
        max_event_bytes: int | None = None,
        max_events: int | None = None,
    ) -> op.EventsTaken:
        """The events of the session's cache namespace since its previous take (its
        cursor moves).

        A session sees what vLLM's own manager would show it: blocks stored and removed
        in its own namespace (tenants with isolated caches never see each other's token
        ids or hashes), and every AllBlocksCleared. Without namespaces (no tenants, or a
        shared cache) that is every event of the pool. WatchEvents filters alike
        (:meth:`events_filter`).

        Args:
            max_bytes: the answer's budget for events (their :func:`event_wire_bytes`):
                the events are cut before the first that would pass it, ``more`` is
                set and the cursor stays after the last one given, so the next take
                continues there (None: no budget).
            max_event_bytes: the most one event may take in any answer: a larger one
                could never be given, so it is dropped for this session with ``gap``
                set (None: ``max_bytes``).
            max_events: at most this many events, cut the same way (a replay of an
                answer that was cut gives as many events as it held: the cursor ends
                where it did).
        """
        self._publish()
        journal = self.events
        gap = journal.missed(s.events_cursor)
        kept = journal.since(s.events_cursor)
        prefix = None
        if self.engine.cache_namespaces:  # else every event is of the default namespace
            prefix = self.engine.cache_namespace_prefix(s.cache_namespace)
        if max_bytes is None and max_events is None and prefix is None:
            s.events_cursor = journal.last_sequence
            return op.EventsTaken([e for _, e in kept], gap)
        largest = max_bytes if max_event_bytes is None else max_event_bytes
        events: list[KVCacheEvent] = []
        used = 0
        more = False
        cursor = journal.last_sequence
        for seq, e in kept:
            if prefix is not None and not isinstance(e, AllBlocksCleared) and e.cache_prefix != prefix:
                continue
            if max_events is not None and len(events) >= max_events:
                more = True
                cursor = seq - 1
                break
            if max_bytes is not None:
                size = event_wire_bytes(e)
                if used + size > max_bytes:
                    if largest is not None and size > largest:
                        gap = True  # no answer can carry it
                        continue
                    more = True
                    cursor = seq - 1
                    break
                used += size
            events.append(e)
        s.events_cursor = cursor
        return op.EventsTaken(events, gap, more)

    def events_filter(self, tenant: str, administers: bool) -> Callable[[KVCacheEvent], bool] | None:
        """Which of the pool's events a watcher of ``tenant`` may read (WatchEvents):
        ``None`` (every event) for the full-access tenant and a tenant administering
        the pool; else those of its own cache namespace (:meth:`cache_namespace`), as
        :meth:`take_events` gives its sessions, and every AllBlocksCleared. A namespace
        the pool has not seen yet (the tenant never attached) matches no event until it
        appears; looking it up registers nothing (replay assigns prefixes in attach order)."""
        if not tenant or administers:
            return None
        namespace = self.cache_namespace(tenant)
        engine = self.engine

        def visible(event: KVCacheEvent) -> bool:
            if isinstance(event, AllBlocksCleared):
                return True
            prefix = engine.cache_namespaces.get(namespace) if namespace else b""
            return prefix is not None and event.cache_prefix == prefix

        return visible

    def make_stats(self, s: Session) -> PrefixCacheStats | None:
        """The session's statistics since its previous make, then reset."""
        if s.stats is None:
            return None
        stats, s.stats = s.stats, PrefixCacheStats()
        return stats

    def _admit(self, s: Session, o: op.Admit) -> op.Value:
        """Lookup then allocate each request in order, as a scheduler's waiting loop
        does, until the budget is spent or the pool refuses one."""
        if o.token_budget < 0 or o.num_lookahead_tokens < 0:
            raise ServiceError(Status.INVALID, "token_budget and num_lookahead_tokens must be >= 0")
        engine = self.engine
        budget = o.token_budget
        out: list[op.AllocateOutcome] = []
        for sync in o.syncs:
            if budget <= 0:
                break
            try:
                undo = self.sync(s, sync)
            except Exception:
                if out:
                    break  # stop before it (see below)
                raise
            rid = sync.request_id
            try:
                hit = engine.get_computed_blocks(rid)
                n = min(engine.requests[rid].num_tokens - hit.num_tokens, budget)
                new = engine.allocate_slots(
                    rid, n, hit.num_tokens, None if hit.is_empty else hit, o.num_lookahead_tokens
                )
            except Exception:
                undo()
                if out:
                    # Stop before the failing request (nothing of it applied): the
                    # admitted ones stand, and it fails on its own at the next admit.
                    break
                raise
            out.append(op.AllocateOutcome(new, n, hit))
            if new is None:
                break
            budget -= n
        return op.Admitted(out)

    def _sync(self, s: Session, o: op.Sync) -> op.Value:
        self.sync(s, o.sync)
        return None

    def _record_stats(self, s: Session, o: op.RecordStats) -> op.Value:
        self._owned(s, o.request_id)
        self.engine.record_prefix_cache_stats(o.request_id, o.num_hits)
        return None

    def _estimate_cached_tokens(self, s: Session, o: op.EstimateCachedTokens) -> op.Value:
        self._owned(s, o.request_id)
        return self.engine.estimate_cached_tokens(o.request_id)

    def _new_step_starts(self, s: Session, o: op.NewStepStarts) -> op.Value:
        self.engine.new_step_starts()
        return None

    def _take_new_block_ids(self, s: Session, o: op.TakeNewBlockIds) -> op.Value:
        return self.engine.take_new_block_ids()

    def _take_offloads(self, s: Session, o: op.TakeBoundaryStateOffloads) -> op.Value:
        return self.engine.take_boundary_state_offloads()

    def _take_copies(self, s: Session, o: op.TakeBlockCopies) -> op.Value:
        return self.engine.take_kv_cache_block_copies()

    def _release_retained(self, s: Session, o: op.ReleaseRetained) -> op.Value:
        self.engine.release_retained_blocks(o.block_ids)
        return None

    def _drop_offloads(self, s: Session, o: op.DropOffloads) -> op.Value:
        self._owned(s, o.request_id)
        self.engine.drop_boundary_state_offloads(o.request_id)
        return None

    def _record_for_zeroing(self, s: Session, o: op.RecordForZeroing) -> op.Value:
        self._owned(s, o.request_id)
        self.engine.record_blocks_for_zeroing(o.request_id, o.start_token)
        return None

    def _num_blocks_to_allocate(self, s: Session, o: op.GetNumBlocksToAllocate) -> op.Value:
        self._owned(s, o.request_id)
        return self.engine.get_num_blocks_to_allocate(
            o.request_id, o.num_tokens, o.total_computed_tokens, o.num_tokens_main_model,
            o.apply_admission_cap, o.num_encoder_tokens,
        )  # fmt: skip


_HANDLERS: dict[type, Callable[[PoolService, Session, object], op.Value]] = {
    op.Lookup: PoolService._lookup,  # type: ignore[dict-item]
    op.Allocate: PoolService._allocate_adopting,  # type: ignore[dict-item]
    op.Free: PoolService._free,  # type: ignore[dict-item]
    op.Preempt: PoolService._preempt,  # type: ignore[dict-item]
    op.CacheBlocks: PoolService._cache_blocks,  # type: ignore[dict-item]
    op.RemoveSkipped: PoolService._remove_skipped,  # type: ignore[dict-item]
    op.EvictBlocks: PoolService._evict,  # type: ignore[dict-item]
    op.GetBlockIds: PoolService._get_block_ids,  # type: ignore[dict-item]
    op.CommonPrefix: PoolService._common_prefix,  # type: ignore[dict-item]
    op.ResetPrefixCache: PoolService._reset,  # type: ignore[dict-item]
    op.TakeEvents: PoolService._take_events,  # type: ignore[dict-item]
    op.MakeStats: PoolService._make_stats,  # type: ignore[dict-item]
    op.Sync: PoolService._sync,  # type: ignore[dict-item]
    op.Admit: PoolService._admit_adopting,  # type: ignore[dict-item]
    op.AllocateRun: PoolService._allocate_run,  # type: ignore[dict-item]
    op.Decode: PoolService._decode,  # type: ignore[dict-item]
    op.RecordStats: PoolService._record_stats,  # type: ignore[dict-item]
    op.EstimateCachedTokens: PoolService._estimate_cached_tokens,  # type: ignore[dict-item]
    op.NewStepStarts: PoolService._new_step_starts,  # type: ignore[dict-item]
    op.GetNumBlocksToAllocate: PoolService._num_blocks_to_allocate,  # type: ignore[dict-item]
    op.TakeNewBlockIds: PoolService._take_new_block_ids,  # type: ignore[dict-item]
    op.TakeBoundaryStateOffloads: PoolService._take_offloads,  # type: ignore[dict-item]
    op.TakeBlockCopies: PoolService._take_copies,  # type: ignore[dict-item]
    op.ReleaseRetained: PoolService._release_retained,  # type: ignore[dict-item]
    op.DropOffloads: PoolService._drop_offloads,  # type: ignore[dict-item]
    op.RecordForZeroing: PoolService._record_for_zeroing,  # type: ignore[dict-item]
}


def _allocate_args(o: op.Allocate) -> tuple[Any, ...]:
    """An Allocate's arguments to ``KVCachePool.allocate_slots`` after the request id, in
    its order: written once for the call made at once and the one made in slices (the
    two once carried different fields)."""
    return (
        o.num_new_tokens,
        o.num_new_computed_tokens,
        o.new_computed_blocks,
        o.num_lookahead_tokens,
        o.num_external_computed_tokens,
        o.delay_cache_blocks,
        o.num_encoder_tokens,
        o.full_sequence_must_fit,
        o.reserved_blocks,
        o.num_in_flight_tokens,
        o.watermark_blocks,
        o.skip_zeroing_group_ids,
    )
