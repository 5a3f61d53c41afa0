"""Named pools of one server instance, with the state the service shares between them.

All handlers run on one asyncio event loop and call the engine inline (engine calls
never await), so every pool is linearizable: operations run one at a time, in the
order they arrive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Callable, Generator

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import MAX_MODEL_LEN_UNLIMITED, config_from_pb

from .bounds import MAX_NAME_LENGTH
from .budget import MemoryBudget
from .durability import Recorder
from .errors import ErrorReason, ServiceError, Status
from .idempotency import IdempotencyStore
from .logs import ids
from .pool_locks import PoolLocks
from .pool_service import ABANDONED_PAST_RESERVATIONS, Fence, Limits, PoolService, drain
from .positions import JournalPositions
from .scoring import ScoreIndex
from .sessions import Session, SessionTable

__all__ = ["Limits", "Placement", "PoolRegistry", "new_instance_id"]

logger = logging.getLogger(__name__)

_NAME = re.compile(rf"^[A-Za-z0-9._-]{{1,{MAX_NAME_LENGTH}}}$")


#: sessions of handed-over pools remembered for redirects (the oldest are forgotten)
MAX_MOVED_SESSIONS = 100_000
#: requests a session's end frees between two yields (two looks at the clock)
END_SLICE_REQUESTS = 16


def new_instance_id() -> str:
    """A fresh server instance id (random: two starts never share one)."""
    return secrets.token_hex(8)


class Placement:
    """Which pools this server serves. This one (a single node) serves every pool it
    holds; a cluster's (cluster.py) serves only the pools whose claim it holds."""

    #: this replica's id in pool listings ("" on a single node)
    replica_id = ""
    #: how calls name this replica (``kvcoord-replica``: "<cluster>/<id>"; "" on a single node)
    name = ""

    def check(self, pool: str, local: bool) -> None:
        """Pass when this server may serve ``pool`` (``local``: it holds its state).

        Raises:
            ServiceError: NOT_OWNER (another replica serves it) or UNAVAILABLE.
        """

    def serves(self, pool: str) -> bool:
        return True

    def settled(self, pool: str) -> bool:
        """This server serves ``pool`` and it is not changing owner: its state here is the
        pool's, and a read of it (a score) may be answered from it."""
        return self.serves(pool)

    def term(self, pool: str) -> int:
        """The pool's ownership term here (0: a single node)."""
        return 0

    async def before_create(self, pool: str) -> None:
        """Make this server the pool's owner before a CreatePool creates it here."""

    async def before_delete(self, pool: str) -> None:
        """Make the delete final in the cluster before the pool is removed here (it
        then cannot come back elsewhere); raise, with nothing changed, when it cannot.

        Raises:
            ServiceError: NOT_OWNER (another replica serves it now) or UNAVAILABLE.
        """

    async def after_delete(self, pool: str) -> None:
        """The pool was deleted here: it no longer exists in the cluster."""

    async def delete_unserved(self, pool: str, incarnation: int = 0) -> bool:
        """Delete ``pool`` when it exists in the cluster but no replica serves it (its
        owner stopped without handing it over) and this replica is the one to do it;
        True once it is deleted. False: the usual rules answer (:meth:`check`); so
        they do when the caller names an ``incarnation`` (0: any) nobody can check.

        Raises:
            ServiceError: FAILED_PRECONDITION (OWNER_GONE) when it cannot be deleted
                without its owner; nothing was deleted.
        """
        return False

    async def adopt(self, pool: str, state: bytes, from_replica: str, claim_revision: int) -> int:
        """Take over a pool another replica hands over; returns its new term.

        Raises:
            ServiceError: FAILED_PRECONDITION (a single node adopts nothing).
        """
        raise ServiceError(Status.PRECONDITION, "this server is not a cluster replica ([cluster])")


class PoolRegistry:
    """The server's pools by name, its sessions and its idempotency store.

    Args:
        limits: server limits.
        sessions: the session table shared by every pool.
        idempotency: kept answers of keyed calls.
        instance_id: this server instance (default: a new random one).
        grace_until: monotonic time before which no session may attach (restart grace).
    """

    def __init__(
        self,
        limits: Limits,
        sessions: SessionTable,
        idempotency: IdempotencyStore,
        instance_id: str | None = None,
        grace_until: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits
        self.sessions = sessions
        self.idempotency = idempotency
        self.instance_id = instance_id or new_instance_id()
        self.grace_until = grace_until
        self.clock = clock
        self.pools: dict[str, PoolService] = {}
        #: the pools' estimated memory (budget.py) and each pool's share
        self.memory = MemoryBudget(limits.max_pool_memory_bytes)
        self.pool_memory: dict[str, int] = {}
        #: earlier instances whose state this one recovered (fences stay valid)
        self.lineage: set[str] = set()
        #: the last record of each earlier instance in the journal (fence positions)
        self.positions = JournalPositions()
        #: told about every mutation (the journal; the default records nothing)
        self.recorder: Recorder = Recorder()
        #: seconds since the epoch (pool creation times)
        self.wall_clock: Callable[[], float] = time.time
        #: the server's max_message_bytes: answers' events are cut below it (0: no
        #: bound); journaled with the limits, so replay cuts where the call did
        self.max_message_bytes = 0
        #: which pools this server serves (a cluster's replica: those it owns)
        self.placement = Placement()
        #: which pools cache each key, for ScorePools without block ids (scoring.py):
        #: it follows every pool's map by itself; a removed pool's bits are dropped here
        self.score_index = ScoreIndex()
        #: sessions of pools handed over to another replica -> their pool: a call naming
        #: only the session is sent where the pool went (NOT_OWNER), not told it expired
        self.moved_sessions: dict[str, str] = {}
        #: the pools a Step is being applied to in slices: every other call on one
        #: waits for it (pool_locks.py)
        self.locks = PoolLocks()
        #: a proven restore's fencing put off until no pool is held (server.py), or None
        self.fencing: asyncio.Future[None] | None = None
        self.locks.on_idle = lambda: self.recorder.pools_idle()  # (the recorder of the moment)
        #: told the pool of every session ended because its lease ran out (metrics)
        self.on_session_expired: Callable[[str], None] = lambda pool: None
        #: given every pool removed (deleted, handed over, dropped, replaced): the
        #: servicer releases its objects a slice at a time (PoolService.teardown)
        self.on_removed: Callable[[PoolService], None] = lambda service: None
        #: given the end of a session whose lease ran out (:meth:`expiring`, the session
        #: closed already) to run: the servicer runs a long one a slice at a time, its
        #: pool held (mutations.py); by default (recovery, no loop) at once
        self.run_expiry: Callable[[str, Generator[None, None, tuple[str, str, int]]], None] = _at_once
        sessions.on_lapsed = lambda s: self.run_expiry(s.pool, self.expiring(s))  # (a call found it lapsed)

    def set_term(self, name: str, term: int) -> None:
        """The pool's ownership term is now ``term`` (journaled: answers carry it)."""
        service = self.pools.get(name)
        if service is None or service.fence.term == term:
            return
        service.fence = dataclasses.replace(service.fence, term=term)
        self.recorder.term_changed(service)

    def served(self) -> dict[str, PoolService]:
        """The pools this server serves, by name (every pool on a single node)."""
        placement = self.placement
        return {n: p for n, p in self.pools.items() if placement.serves(n)}

    def settled(self) -> dict[str, PoolService]:
        """The pools this server serves that are not changing owner (ScorePools scores these)."""
        placement = self.placement
        return {n: p for n, p in self.pools.items() if placement.settled(n)}

    def create(
        self,
        name: str,
        config_pb: pb.PoolConfig,
        incarnation: int | None = None,
        created_at: float | None = None,
    ) -> tuple[PoolService, bool]:
        """Create a pool, or return the identical existing one (``created`` False).

        ``incarnation`` and ``created_at`` (its creation wall time; default now) are
        given only when recovering a journaled pool: the pool
        existed, so neither the memory budget nor max_tokens_per_request refuses it
        (limits lowered since apply to new pools; a warning is logged for the budget).
        A pool whose ``max_model_len`` is 0 admits ``max_tokens_per_request`` tokens.

        Raises:
            ServiceError: bad name, ALREADY_EXISTS with another config, or a limit
                (RESOURCE_EXHAUSTED: pools, blocks, tokens per request, memory).
        """
        if not _NAME.match(name):
            raise ServiceError(
                Status.INVALID,
                f"pool name {name[:200]!r} must be 1-128 characters of letters, digits, '.', '_' or '-'",
            )
        existing = self.pools.get(name)
        if existing is not None:
            if existing.wire_config == config_pb:
                return existing, False
            raise ServiceError(
                Status.ALREADY_EXISTS,
                f"pool {name!r} already exists with a different configuration; delete it first "
                "or use another name",
            )
        if len(self.pools) >= self.limits.max_pools:
            raise ServiceError(
                Status.EXHAUSTED,
                f"the server already holds {len(self.pools)} pools (max_pools)",
            )
        if config_pb.num_blocks > self.limits.max_blocks_per_pool:
            raise ServiceError(
                Status.EXHAUSTED,
                f"num_blocks {config_pb.num_blocks} exceeds max_blocks_per_pool {self.limits.max_blocks_per_pool}",
            )
        max_tokens = self.limits.max_tokens_per_request
        if config_pb.max_model_len > max_tokens and incarnation is None:
            raise ServiceError(
                Status.EXHAUSTED,
                f"max_model_len {config_pb.max_model_len} exceeds the server's max_tokens_per_request "
                f"{max_tokens}",
            )
        config = config_from_pb(config_pb)
        if config.max_model_len == MAX_MODEL_LEN_UNLIMITED:
            config = dataclasses.replace(config, max_model_len=max_tokens)
        try:
            need = self.memory.check(name, config_pb.num_blocks, config_pb.hash_block_size, len(self.pools))
        except ServiceError:
            if incarnation is None:
                raise
            need = 0
            logger.warning(
                "recovered pool %s does not fit max_pool_memory_bytes; kept", name, extra=ids(pool=name)
            )
        fence = Fence(self.instance_id, incarnation or secrets.randbits(63) or 1)
        term = self.placement.term(name) if incarnation is None else 0
        hash_settings = (config_pb.hash_algo, config_pb.hash_block_size, config_pb.hash_seed)
        wire = pb.PoolConfig()
        wire.CopyFrom(config_pb)
        service = PoolService(name, config, hash_settings, fence, self.limits, self.sessions, wire)
        service.grace_until, service.grace_clock = self.grace_until, self.clock
        service.created_at = self.wall_clock() if created_at is None else created_at
        service.lineage = self.lineage
        service.positions = self.positions
        self.pools[name] = service
        self.pool_memory[name] = need
        self.memory.used += need
        self.recorder.pool_created(service)
        if term:
            self.set_term(name, term)
        logger.info(
            "created pool %s (%s blocks, %s, incarnation %d)",
            name,
            config.num_blocks,
            config.coordinator_kind,
            fence.incarnation,
            extra=ids(pool=name, incarnation=fence.incarnation),
        )
        return service, True

    def get(self, name: str, fence: Fence | None = None) -> PoolService:
        """The pool called ``name``. When it does not exist, the position of a fenced
        call's ``fence`` is proven first (JournalPositions.prove): a pool made after a
        restored copy was taken is unknown to the copy, and NOT_FOUND proved nothing.

        Raises:
            ServiceError: INVALID_ARGUMENT without a name, NOT_FOUND for an unknown one
                (INSTANCE_CHANGED, FENCE_UNPROVEN: see the prove), NOT_OWNER /
                UNAVAILABLE when another replica serves it (placement).
        """
        if not name:
            raise ServiceError(Status.INVALID, "pool is required")
        service = self.pools.get(name)
        self.placement.check(name, service is not None)
        if service is None:
            if fence is not None:
                self.positions.prove(fence, self.instance_id, self.lineage)
            # Never list the pools here: callers of several tenants reach this, and a
            # pool's name is visible only to tenants holding a role on it (ListPools).
            raise ServiceError(
                Status.NOT_FOUND,
                f"pool {name[:200]!r} does not exist (ListPools shows the pools you may use)",
            )
        return service

    def for_attach(self, name: str, previous: Fence | None = None) -> PoolService:
        """The pool called ``name`` (see :meth:`get`; ``previous``: the Attach's previous
        fence, proven there when the pool does not exist), its sessions whose lease ran out
        but which were not reaped yet ended first, as the reaper would end them: an
        Attach decides on live sessions only (a lapsed exclusive session would refuse
        every Attach, its own client's too, until the reaper ran)."""
        service = self.get(name, previous)
        for s in self.sessions.expired(name):
            self.run_expiry(s.pool, self.expiring(s))
        return service

    def attaching_again(self, fence: Fence | None) -> None:
        """The fence of the session an Attach's client held before
        (AttachRequest.previous_fence; None: none): its position proves a restored data
        directory as any fenced call's does (JournalPositions.prove), before the new
        session is made. Nothing else of it is checked: the old session may be of
        another instance or incarnation (that is why its client attaches again).

        Raises:
            ServiceError: as :meth:`JournalPositions.prove` (INSTANCE_CHANGED once the
                fencing is durable; FENCE_UNPROVEN for a position without its tag).
        """
        if fence is not None:
            self.positions.prove(fence, self.instance_id, self.lineage)

    def attached_before(self, service: PoolService, key: str, tenant: str, exclusive: bool) -> Session | None:
        """The live session an earlier Attach of ``tenant`` with ``key`` made in this pool
        (its answer was lost: a retry gets the same session), renewed; None when there is
        none (or no key).

        Raises:
            ServiceError: INVALID_ARGUMENT (KEY_REUSED) when that Attach asked for
                another ``exclusive``.
        """
        s = self.sessions.attached_with(service.name, tenant, key)
        if s is None:
            return None
        if s.exclusive != exclusive:
            raise ServiceError(
                Status.INVALID,
                f"attach_key {key[:64]!r} was used by an Attach with exclusive={s.exclusive}; use a new key "
                "for another Attach",
                ErrorReason.KEY_REUSED,
            )
        self.sessions.renew(s)
        return s

    def pool_of_session(self, session_id: str, pool: str = "", fence: Fence | None = None) -> PoolService:
        """The pool a live session is attached to (SESSION_EXPIRED when there is none: a session whose lease
        ran out is ended first, as the reaper would end it). ``pool``, the pool the call names ("": none):
        a session not held here is judged only where its pool is served, else the call goes to the pool's
        owner (NOT_OWNER, OWNER_CHANGING; so does one whose pool was handed over from here); a cluster's
        replica asked with no pool named cannot know (UNAVAILABLE). For a session not held here, the
        call's ``fence`` may prove a restore first (JournalPositions.prove).

        Raises:
            ServiceError: as above; INVALID_ARGUMENT when ``pool`` is not the session's."""
        if session_id not in self.sessions.sessions:
            named = self.moved_sessions.get(session_id) or pool
            if named:
                self.placement.check(named, named in self.pools)
            elif self.placement.replica_id:
                raise ServiceError(
                    Status.UNAVAILABLE,
                    f"replica {self.placement.replica_id!r} holds no session {session_id[:64]!r}: only the "
                    "owner of its pool can tell whether it ended (name the pool in the call to be sent there)",
                )
            if fence:  # its position first, as a Step's: SESSION_EXPIRED would drop its proof
                self.positions.prove(fence, self.instance_id, self.lineage)
        s = self.sessions.get(session_id)  # (a lapsed one is ended here: SessionTable.on_lapsed)
        if pool and pool != s.pool:
            raise ServiceError(
                Status.INVALID,
                f"session {session_id[:64]!r} is attached to pool {s.pool[:200]!r}, not {pool[:200]!r}",
            )
        return self.get(s.pool)

    async def fenced(self) -> None:
        """Return once a proven restore's fencing (the sessions' ends, the caches'
        resets: server.py) is journaled and durable. A call told INSTANCE_CHANGED drops
        its fence: told before, a crash would restart with the restored sessions and
        caches alive and nobody left to prove the restore again.

        Raises:
            JournalError: the journal could not be written (the server stops).
        """
        if self.fencing is not None:
            await asyncio.shield(self.fencing)
        await self.recorder.durable()

    def session_of(self, session_id: str, fence: Fence | None, pool: str = "") -> tuple[PoolService, Session]:
        """The pool and the live session a call names (:meth:`pool_of_session`, ``pool``
        the one it names, if any), the call's fence checked (Heartbeat, Detach).

        Raises:
            ServiceError: as :meth:`pool_of_session` and :meth:`PoolService.session`."""
        service = self.pool_of_session(session_id, pool, fence)
        return service, service.session(session_id, fence)

    def end_session(
        self, s: Session, service: PoolService | None = None, abandon: int = ABANDONED_PAST_RESERVATIONS
    ) -> int:
        """End a session (Detach, an exclusive Attach whose answer cannot be sent, their
        replay): its kept answers forgotten, its requests freed in ``service`` (by
        default the pool of its name held here; none: the session is only closed) as
        abandoned (``abandon``: :meth:`PoolService.ending_session`). Returns how many
        requests were freed."""
        return drain(self.ending(s, service, abandon))

    def ending(
        self, s: Session, service: PoolService | None = None, abandon: int = ABANDONED_PAST_RESERVATIONS
    ) -> Generator[None, None, int]:
        """:meth:`end_session`, yielding every END_SLICE_REQUESTS requests freed (the
        caller holds the pool between slices: pool_locks.py); the session is closed and
        its kept answers forgotten before the first yield."""
        self.idempotency.drop_session(s.session_id)
        owner = service if service is not None else self.pools.get(s.pool)
        if owner is None:
            self.sessions.close(s.session_id)
            return 0
        return (yield from owner.ending_session(s, END_SLICE_REQUESTS, abandon))

    def delete(self, name: str) -> PoolService:
        """Remove a pool: its sessions end (their requests go with the pool)."""
        self.get(name)
        return self.remove(name)

    def handed_over(self, name: str) -> PoolService:
        """The pool went to another replica with its sessions: remove it here (journaled
        as a delete), remembering its sessions so their calls are redirected."""
        moved = self.moved_sessions
        for s in self.sessions.of_pool(name):
            moved[s.session_id] = name
        while len(moved) > MAX_MOVED_SESSIONS:
            del moved[next(iter(moved))]
        return self.remove(name)

    def remove(self, name: str) -> PoolService:
        """Remove the pool ``name`` held here, whoever serves it (a delete, or the end
        of a handover to another replica), and journal that: its sessions end here."""
        service = self.pools[name]
        del self.pools[name]
        self.score_index.forget(name)
        self.memory.used -= self.pool_memory.pop(name, 0)
        for s in self.sessions.of_pool(name):
            self.sessions.close(s.session_id)
            self.idempotency.drop_session(s.session_id)
        service.owners.clear()
        service.events.close()
        self.recorder.pool_deleted(name)
        logger.info("deleted pool %s", name, extra=ids(pool=name))
        self.on_removed(service)
        return service

    def reap_expired_sessions(self) -> int:
        """End every session whose lease ran out (:meth:`expiring`, run by
        :attr:`run_expiry`: a long one's requests are freed after this returns, each in
        turn with its pool's calls). Returns how many sessions ended."""
        lapsed = self.sessions.expired()
        for s in lapsed:
            self.run_expiry(s.pool, self.expiring(s))
        self.idempotency.expire()
        return len(lapsed)

    def expiring(self, s: Session) -> Generator[None, None, tuple[str, str, int]]:
        """End a session whose lease ran out (taken out of the session table already):
        its requests freed (yielding between slices: :meth:`ending`), then journaled as
        expired, counted and logged. Returns (session id, pool, requests freed)."""
        service = self.pools.get(s.pool)
        freed = (yield from self.ending(s, service)) if service is not None else 0
        if service is None:
            self.idempotency.drop_session(s.session_id)
        # recorded after the change: a snapshot the record triggers holds the state after it
        self.recorder.session_expired(s.session_id, s.pool, service)
        self.on_session_expired(s.pool)
        logger.warning(
            "session %s (%s) of pool %s expired; freed %d requests",
            s.session_id,
            s.client_name,
            s.pool,
            freed,
            extra=ids(pool=s.pool, session=s.session_id, tenant=s.tenant or None, requests_freed=freed),
        )
        return s.session_id, s.pool, freed


def _at_once(pool: str, work: Generator[None, None, object]) -> None:
    """Run a session's end to its end at once (:attr:`PoolRegistry.run_expiry`'s default)."""
    drain(work)
