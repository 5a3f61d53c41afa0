"""Recovery: load the latest snapshot, replay the journal after it, resume journaling.

A snapshot is the registry's whole state as plain values (lists, ints, bytes,
strings: no pickled object; :mod:`.registry_state` makes and reads them), encoded as
CBOR by durability.py: every pool's engine
state (:func:`kvcoord.engine.state.export_state`), its kept events and sequence
counter, request owners, sessions with their cursors and statistics, idempotency
answers, the lineage of recovered instances, the instance writing the records after
it, and the server limits then in effect. Its fingerprint names the format and the
engine's state version: a snapshot of another format is refused with a message
naming the file.

Records are replayed under the limits they were applied with (``limits`` records), so
raising a limit (or changing anything that changes no acknowledged answer) never
prevents a restart; each replayed call is applied and answered as it was live
(mutations.py, with :data:`~.mutating_calls.MUTATIONS`) and its answer's
digest compared with the journaled one. Once replayed, the
configured limits apply: a pool holding more than a lowered limit allows stops the
start, naming the pool and the record.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
from kvcoord.v1 import allocator_pb2 as pb

from .attach_reset import reset_for_new_engine
from .durability import SNAPSHOT_FILE_GLOB, JournalRecorder, decode_record
from .journal import JournalError, JournalStore
from .journal_writer import Journal
from .mutating_calls import MUTATIONS
from .mutations import MutationRunner
from .pool_service import Limits
from .registry import PoolRegistry
from .registry_state import (
    adopt_pool,
    apply_limits,
    dump_state,
    journaled_limits,
    limits_from,
    load_state,
    snapshot_fingerprint,
)
from .sessions import Session

__all__ = [
    "Recovery",
    "Replayer",
    "RestoreFenceError",
    "fence_restored",
    "open_journal",
    "void_earlier_instances",
]

logger = logging.getLogger(__name__)


class RestoreFenceError(JournalError):
    """A restored journal's fencing could not empty a pool's prefix cache (a block is
    held by neither a session nor a reservation): at start-up the server refuses to
    start; while serving, the call that proved the restore fails INTERNAL (not a
    journal write failure: the journal is fine)."""


class Replayer:
    """Applies journal records to a registry (which records nothing meanwhile).

    Args:
        registry: the registry being recovered.
        now_wall: seconds since the epoch now (record ages: idempotency windows).
        writer: the instance that wrote the records (from the snapshot; later ``start``
            records name the next ones).
    """

    def __init__(self, registry: PoolRegistry, now_wall: float, writer: str = "") -> None:
        self.registry = registry
        self.now_wall = now_wall
        self.writer = writer
        #: the last record applied to each pool (named when a limit refuses the start)
        self.touched: dict[str, int] = {}
        self.seq = 0

    def apply(self, seq: int, record: list[Any]) -> None:
        """Apply one record.

        Raises:
            ValueError: the record cannot be replayed as it was applied.
        """
        self.seq = seq
        registry = self.registry
        kind, when = record[0], float(record[1])
        if kind == "start":
            registry.lineage.add(record[2])
            self.writer = record[2]
            registry.positions.started(str(record[2]), seq)
        elif kind == "limits":
            apply_limits(registry, limits_from(record[2]), int(record[2].get("max_message_bytes", 0)))
        elif kind == "restored":  # fences of every earlier instance are void from here on
            if len(record) > 3:  # instances started from here on tag under a new key
                registry.positions.generation = int(record[3])
            if len(record) > 2:
                # the instances it voided (the one that proved it among them); the one
                # that wrote it, proven while serving, is not one of them
                voided = [str(i) for i in record[2]]
                registry.positions.void(voided)
                registry.lineage.difference_update(voided)
            else:  # (a kvcoord that did not name them: every instance until then)
                registry.positions.void_all()
                registry.lineage.clear()
        elif kind == "create":
            registry.create(record[2], pb.PoolConfig.FromString(record[3]), record[4], float(record[5]))
            self.touched[record[2]] = seq
        elif kind == "delete":
            registry.remove(record[2])
        elif kind == "term":  # the pool's ownership term changed (cluster.py)
            service = registry.pools[record[2]]
            service.fence = dataclasses.replace(service.fence, term=int(record[3]))
        elif kind == "adopt":  # a pool handed over by another replica (cluster.py)
            adopt_pool(registry, record[2])
            if len(record) > 3:  # the records of earlier instances it brought (positions.py)
                registry.positions.held(record[3])
            self.touched[record[2]["pool"]["name"]] = seq
        elif kind == "attach":
            _, _, pool, sid, client_name, lease, exclusive, tenant, *key = record
            service = registry.pools[pool]
            table = registry.sessions
            s = Session(
                sid, pool, client_name, lease, table.clock() + lease, exclusive=exclusive, tenant=tenant,
                attach_key=key[0] if key else "", reset_at_attach=len(key) > 1 and bool(key[1]),
            )  # fmt: skip
            table.sessions[sid] = s
            if s.reset_at_attach:  # as PoolService.attach: the reset, then the session's cursors
                reset_for_new_engine(service, s)
            service.init_session(s)
        elif kind in ("detach", "expire"):
            ending = registry.sessions.sessions.get(record[2])
            if ending is None:
                raise ValueError(
                    f"its {kind} names session {record[2]!r}, which no earlier record attached or which ended "
                    "before it: the journal does not match the server that wrote it"
                )
            self.touched[ending.pool] = seq
            # freed as abandoned by the rule the record names (older journals: freed
            # plainly; then with reservations keeping entries: durability.ABANDONED)
            registry.end_session(ending, abandon=int(record[3]) if len(record) > 3 else 0)
        elif kind == "call":
            self._call(record, when)
        elif kind == "reset":
            registry.pools[record[2]].reset_prefix_cache()
        elif kind == "reserve":  # held again, with no time left (released after recovery)
            _, _, pool, reservation_id, num_tokens, hashes, tenant = record
            registry.pools[pool].replay_reserve(reservation_id, hashes, num_tokens, tenant)
        elif kind == "unreserve":
            registry.pools[record[2]].release_reservation(record[3])
        else:
            raise ValueError(f"unknown record kind {kind!r}")

    def _call(self, record: list[Any], when: float) -> None:
        _, _, rpc, body, key, digest, told = record
        m = MUTATIONS.get(rpc)
        if m is None:
            raise ValueError(f"unknown rpc {rpc!r}")
        runner = MutationRunner(self.registry)
        age = max(0.0, self.now_wall - when)
        pool = runner.replay(m, body, key, digest, told, self.writer, self.seq, age)
        self.touched[pool] = self.seq

    def check_limits(self, limits: Limits, path: Path, snapshot_seq: int) -> None:
        """The recovered state must fit the configured limits (lowered since, perhaps).

        Raises:
            JournalError: naming the pool, the limit and the record after which it held more.
        """
        registry = self.registry

        def where(pool: str) -> str:
            seq = self.touched.get(pool)
            return f"record {seq}" if seq is not None else f"the snapshot after record {snapshot_seq}"

        problems = []
        if len(registry.pools) > limits.max_pools:
            problems.append(f"it holds {len(registry.pools)} pools, more than max_pools {limits.max_pools}")
        for name, service in registry.pools.items():
            held = service.num_requests
            if held > limits.max_requests_per_pool:
                problems.append(
                    f"pool {name!r} holds {held} requests after {where(name)}, more than "
                    f"max_requests_per_pool {limits.max_requests_per_pool}"
                )
            if service.config.num_blocks > limits.max_blocks_per_pool:
                problems.append(
                    f"pool {name!r} has {service.config.num_blocks} blocks (created by {where(name)}), "
                    f"more than max_blocks_per_pool {limits.max_blocks_per_pool}"
                )
        if problems:
            raise JournalError(
                f"journal {path}: the recovered state does not fit the configured limits: "
                + "; ".join(problems)
                + ". Start with limits at least that high (lower them once the pools hold less)"
            )


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """What :func:`open_journal` found."""

    recorder: JournalRecorder
    path: str
    snapshot_seq: int
    records: int
    seconds: float
    #: why the journal may be behind what clients were told ("" when it is not): its
    #: sessions were then ended and fenced, and the server must apply the grace period
    restored: str = ""

    @property
    def recovered(self) -> bool:
        """True when the journal held any history (a restart, not a first start)."""
        return self.snapshot_seq > 0 or self.records > 0


def open_journal(
    registry: PoolRegistry,
    data_dir: str,
    synchronous: str,
    snapshot_every: int,
    wall_clock: Callable[[], float] = time.time,
    make_recorder: type[JournalRecorder] = JournalRecorder,
    before_fencing: Callable[[str], None] | None = None,
    fence_generation: int = 0,
) -> Recovery:
    """Recover ``registry`` (empty) from ``data_dir`` and journal from now on.

    Recovered sessions get a fresh lease; the new instance is appended to the journal
    (its predecessors' fences stay valid: :attr:`PoolRegistry.lineage`), and the
    configured limits when they differ from those the journal was written under.

    A journal behind what clients were told (:attr:`JournalStore.behind`) is fenced
    (:func:`fence_restored`) after ``before_fencing(why)`` returns: the caller makes
    the grace period durable there. Once the fencing's records are committed the
    journal is no longer behind, so a start that fails (or a crash) after them would
    otherwise forget the restore and serve with no grace. ``fence_generation``: the
    restore generation grace.json names (the fencing begins it at least).

    Raises:
        JournalError: an incompatible or damaged journal or snapshot (names the file),
            or a state that does not fit limits lowered since (RestoreFenceError: see
            :func:`fence_restored`).
    """
    started = time.perf_counter()
    configured = registry.limits
    configured_answer_bytes = registry.max_message_bytes
    store = JournalStore(data_dir, synchronous)
    # before replay: replayed answers are tagged as their clients were (positions.py)
    registry.positions.key = store.fence_key
    for stale in store.path.parent.glob(SNAPSHOT_FILE_GLOB):  # a snapshot a crash interrupted
        stale.unlink(missing_ok=True)
    snap = store.snapshot()
    after = 0
    # Idempotency answers age by serving time only: "now" for replay is the time of the
    # last journaled record, not the wall clock at this start (a clock set forward
    # while the server was down must not expire answers a client may still retry; the
    # downtime does not count, which keeps answers longer, never shorter).
    served_until = _last_record_time(store)
    now_wall = served_until if served_until is not None else wall_clock()
    replayer = Replayer(registry, now_wall)
    if snap is not None:
        expected = snapshot_fingerprint()
        if snap.fingerprint != expected:
            raise JournalError(
                f"journal {store.path}: the snapshot after record {snap.seq} was written by an "
                f"incompatible kvcoord ({snap.fingerprint}, this one reads {expected}); start the "
                "version that wrote it"
            )
        try:
            replayer.writer = load_state(
                registry,
                cbor2.loads(snap.body),
                lambda: served_until if served_until is not None else -math.inf,
            )
            # (a snapshot of a kvcoord before 863d21c may not name the writer's generation)
            registry.positions.snapshot_loaded(replayer.writer)
        except Exception as exc:
            raise JournalError(
                f"journal {store.path}: the snapshot after record {snap.seq} cannot be loaded: {exc!r}"
            ) from None
        after = snap.seq
    count = 0
    for seq, body in store.records(after):
        try:
            replayer.apply(seq, decode_record(body))
        except JournalError:
            raise
        except Exception as exc:
            raise JournalError(f"journal {store.path}: record {seq} cannot be replayed: {exc!r}") from None
        count += 1
    recovered = journaled_limits(registry, registry.limits)
    replayer.check_limits(configured, store.path, after)
    apply_limits(registry, configured, configured_answer_bytes)
    journal = Journal(store, after + count)
    journal.snapshot_seq = after
    recorder = make_recorder(
        journal,
        snapshot_every,
        lambda: dump_state(registry, registry.instance_id, registry.limits, wall_clock),
        snapshot_fingerprint(),
        wall_clock,
    )
    # the records replayed count toward the next snapshot: a crash loop, whose instances
    # each live shorter than snapshot_every records, does not replay ever more of them
    recorder.since_snapshot = count
    # a snapshot waits while a pool is mid-Step (pool_locks.py): it would hold half a
    # Step whose record comes after it
    recorder.paused = registry.locks.any_busy
    for service in registry.pools.values():
        service.events.durable_sequence = service.events.last_sequence
    clock = registry.sessions.clock
    for s in registry.sessions.sessions.values():
        s.expires_at = clock() + s.lease_seconds
    registry.recorder = recorder
    positions = registry.positions
    positions.ended(after + count)
    if store.behind and (after or count):
        logger.warning(
            "journal %s may be behind what clients were told (%s): every recovered session is "
            "ended, its fence void and every prefix cache reset",
            store.path, store.behind,
        )  # fmt: skip
        if before_fencing is not None:
            before_fencing(store.behind)
        fence_restored(registry, recorder, fence_generation)
    # the instance's start (and its restore generation) is known before its record is
    # appended: a snapshot that record triggers holds it, so the answers after it
    # replay tagged under the key they were told with (positions.py)
    positions.started(registry.instance_id, journal.appended + 1)
    recorder.started(registry.instance_id)
    if recovered != journaled_limits(registry, configured) or not (after or count):
        recorder.limits_changed(journaled_limits(registry, configured))
    return Recovery(
        recorder,
        str(store.path),
        after,
        count,
        time.perf_counter() - started,
        store.behind if count or after else "",
    )


def _last_record_time(store: JournalStore) -> float | None:
    """The wall time of the journal's last record, if it holds one (its checksum and
    contents are verified when it is replayed)."""
    last = store.last_record()
    if last is None:
        return None
    try:
        return float(decode_record(last)[1])
    except Exception:  # noqa: BLE001 - replay names the damaged record
        return None


def void_earlier_instances(registry: PoolRegistry) -> list[str]:
    """Every fence of an instance before this one is void (a restore): returns every
    instance settled (positions.py, :meth:`JournalPositions.voided`), for the
    ``restored`` record. This instance's own fences stay valid, after a restart too."""
    voided = registry.positions.voided(registry.lineage, registry.instance_id)
    registry.lineage.clear()
    return voided


def fence_restored(registry: PoolRegistry, recorder: JournalRecorder, at_least: int = 0) -> None:
    """After a restored (older) journal: a client may hold blocks this state has never
    given it, and a cached hash may name a block since overwritten. So no earlier fence
    stays valid (a live worker's next call fails INSTANCE_CHANGED, its heartbeat
    SESSION_EXPIRED), every session ends (its requests are freed), every router's
    reservation is released (it holds cached blocks without a session, and a reserved
    hit may name a block the lost history overwrote) and every prefix cache is
    forgotten; each step is journaled, so a later restart replays it. The caller makes
    the grace period durable first (a crash after these records leaves a journal that
    is no longer behind, so nothing else would bring the grace back), and calls this
    while no Step is applied in slices to any pool (pool_locks.py).

    ``at_least``: the restore generation grace.json names (JournalPositions.next_generation).

    Every pool is tried, then:

    Raises:
        RestoreFenceError: a pool still holds blocks with no session and no reservation
            left (a bug: nothing else may hold one); its prefix cache is not emptied.
    """
    # each change before its record, as everywhere: a snapshot the record starts holds
    # the state after it (and replay skips the records a snapshot covers). Nothing here
    # awaits, so the records go to the journal in one commit.
    recorder.restored(void_earlier_instances(registry), registry.positions.next_generation(at_least))
    for s in list(registry.sessions.sessions.values()):
        registry.end_session(s)
        recorder.session_expired(s.session_id, s.pool, registry.pools.get(s.pool))
    refused = []
    for service in registry.pools.values():
        for reservation_id in list(service.reservations.live):
            service.release_reservation(reservation_id)
            recorder.reservation_released(service, reservation_id)
        if service.reset_prefix_cache():
            recorder.prefix_cache_reset(service)
        else:
            refused.append(service.name)
    if refused:
        raise RestoreFenceError(
            f"pools {refused} still hold blocks after every session and reservation of a restored "
            "journal ended, so their prefix caches could not be emptied (a kvcoord bug: please report it)"
        )
