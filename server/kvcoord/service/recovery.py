"""Recovery: load the latest snapshot, replay the journal after it, resume journaling.

Snapshots are the whole state, serialized exactly: every pool's engine (blocks,
free queue in order, reference counts, hash map, requests, managers, statistics),
its kept events and sequence counter, request owners, sessions with their cursors
and statistics, idempotency answers, and the lineage of recovered instances. The
format is pickle with two reductions that keep it flat and fast: a block is stored
without its free-list links, and the free queue as its blocks in order (relinked on
load). Snapshots are read only from the server's own data directory, and carry a
fingerprint of the format and of the engine's field layout: a snapshot written by
an incompatible kvcoord is refused with a message naming the file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

from kvcoord.engine import KVCachePool, PrefixCacheStats
from kvcoord.engine.blocks import KVCacheBlock
from kvcoord.engine.free_queue import FreeKVCacheBlockQueue
from kvcoord.engine.request import Request
from kvcoord.engine.reservations import Reservation, ReservationCounters
from kvcoord.engine.stats import LookupCounters
from kvcoord.v1 import allocator_pb2 as pb

from .convert import allocate_from_pb, allocate_to_pb, operation_from_pb, outcome_to_pb
from .durability import JournalRecorder, decode_record
from .errors import ServiceError
from .journal import Journal, JournalError, JournalStore
from .operations import AllocateOutcome
from .registry import PoolRegistry
from .sessions import Session

__all__ = [
    "Recovery",
    "dump_state",
    "fence_restored",
    "load_state",
    "open_journal",
    "replay_record",
    "snapshot_fingerprint",
]

logger = logging.getLogger(__name__)

SNAPSHOT_FORMAT = 1


def snapshot_fingerprint() -> str:
    """Names the snapshot format and the layout of the classes it contains."""
    layout = repr(
        [
            (cls.__qualname__, _field_names(cls))
            for cls in (
                KVCacheBlock,
                FreeKVCacheBlockQueue,
                Request,
                PrefixCacheStats,
                LookupCounters,
                Session,
                Reservation,
                ReservationCounters,
            )
        ]
        + [sorted(vars(KVCachePool(_probe_config())).keys())]
    )
    digest = hashlib.sha256(layout.encode()).hexdigest()[:16]
    return f"kvcoord-snapshot-{SNAPSHOT_FORMAT}-py{sys.version_info[0]}.{sys.version_info[1]}-{digest}"


def _probe_config() -> Any:
    from kvcoord.engine import FullAttentionSpec, KVCacheConfig

    return KVCacheConfig(num_blocks=2, groups=(FullAttentionSpec(16),), hash_block_size=16)


def _field_names(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return list(getattr(cls, "__slots__", ()))


def dump_state(registry: PoolRegistry, wall_clock: Callable[[], float] = time.time) -> bytes:
    """The registry's whole state as bytes (see the module docstring)."""
    pools = []
    for name, service in registry.pools.items():
        wire: Any = service.wire_config
        pools.append(
            {
                "name": name,
                "config": wire.SerializeToString(),
                "incarnation": service.fence.incarnation,
                "created_at": service.created_at,
                "engine": service.engine,
                "events": service.events.kept(),
                "last_sequence": service.events.last_sequence,
                "owners": [(rid, s.session_id) for rid, s in service.owners.items()],
            }
        )
    sessions = [
        (
            s.session_id,
            s.pool,
            s.client_name,
            s.lease_seconds,
            list(s.owned),
            s.events_cursor,
            s.stats,
            s.exclusive,
            s.tenant,
        )
        for s in registry.sessions.sessions.values()
    ]
    state = {
        "lineage": sorted(registry.lineage | {registry.instance_id}),
        "pools": pools,
        "sessions": sessions,
        "idempotency": registry.idempotency.export(),
        "wall": wall_clock(),
        # the last record of each earlier instance (positions.py); the current one's
        # end is where recovery from this snapshot finds the next start record
        "positions": {**registry.positions.export(), "latest": registry.instance_id},
    }
    # Blocks hold no links to each other (the free queue keeps its own order), so the
    # pools pickle without deep recursion.
    return pickle.dumps(state, protocol=5)


def load_state(registry: PoolRegistry, body: bytes, wall_clock: Callable[[], float] = time.time) -> None:
    """Rebuild ``registry`` (empty, recording nothing) from :func:`dump_state` bytes."""
    state = pickle.loads(body)  # noqa: S301 - our own data directory, checksummed
    registry.lineage.update(state["lineage"])
    registry.positions.restore(state.get("positions"))
    services = {}
    for p in state["pools"]:
        # a snapshot older than created_at: the pool existed when it was written
        created_at = p.get("created_at", state["wall"])
        service, _ = registry.create(
            p["name"], pb.PoolConfig.FromString(p["config"]), p["incarnation"], created_at
        )
        service.engine = p["engine"]
        service.events.restore(p["events"], p["last_sequence"])
        services[p["name"]] = (service, p["owners"])
    table = registry.sessions
    for sid, pool, client_name, lease, owned, cursor, stats, exclusive, tenant in state["sessions"]:
        s = Session(sid, pool, client_name, lease, table.clock() + lease, exclusive=exclusive, tenant=tenant)
        s.owned = dict.fromkeys(owned)
        s.events_cursor = cursor
        s.stats = stats
        table.sessions[sid] = s
        owner = services.get(pool)
        if owner is not None:  # the engine's namespace table came with the snapshot
            owner[0].bind_namespace(s)
    for service, owners in services.values():
        service.owners = {rid: table.sessions[sid] for rid, sid in owners}
    offline = max(0.0, wall_clock() - state["wall"])
    registry.idempotency.restore([(*e[:4], e[4] + offline, e[5]) for e in state["idempotency"]])


def replay_record(registry: PoolRegistry, record: list[Any], now_wall: float) -> None:
    """Apply one journal record to ``registry`` (which records nothing meanwhile)."""
    kind, when = record[0], float(record[1])
    if kind == "start":
        registry.lineage.add(record[2])
    elif kind == "restored":  # fences of every earlier instance are void from here on
        registry.lineage.clear()
    elif kind == "create":
        created_at = float(record[5]) if len(record) > 5 else when
        registry.create(record[2], pb.PoolConfig.FromString(record[3]), record[4], created_at)
    elif kind == "delete":
        registry.delete(record[2])
    elif kind == "attach":
        _, _, pool, sid, client_name, lease, *rest = record
        service = registry.pools[pool]
        table = registry.sessions
        s = Session(
            sid,
            pool,
            client_name,
            lease,
            table.clock() + lease,
            exclusive=bool(rest and rest[0]),
            tenant=rest[1] if len(rest) > 1 else "",
        )
        table.sessions[sid] = s
        service.init_session(s)
    elif kind in ("detach", "expire"):
        _end_session(registry, registry.sessions.sessions[record[2]])
    elif kind == "call":
        _replay_call(registry, record, when, now_wall)
    elif kind == "reset":
        service = registry.pools[record[2]]
        service.engine.reset_prefix_cache()
        service.events.publish(service.engine.take_events())
    elif kind == "reserve":  # held again, with no time left (released after recovery)
        _, _, pool, reservation_id, num_tokens, hashes, tenant = record
        service = registry.pools[pool]
        service.engine.reserve(reservation_id, hashes, num_tokens, service.cache_namespace(tenant))
    elif kind == "unreserve":
        registry.pools[record[2]].release_reservation(record[3])
    else:
        raise ValueError(f"unknown record kind {kind!r}")


def _end_session(registry: PoolRegistry, s: Session) -> None:
    """End a session as Detach or lease expiry does: its answers forgotten, its
    requests freed."""
    registry.idempotency.drop_session(s.session_id)
    owner = registry.pools.get(s.pool)
    if owner is not None:
        owner.end_session(s)
    else:
        registry.sessions.close(s.session_id)


def _check_replayed(pool: str, operations: list[Any], outcomes: list[Any], told: Any) -> None:
    """A replayed Step must give each operation the answer its client was given (a
    different one would leave the client believing in blocks the pool does not hold).

    Raises:
        ValueError: naming the operation, and what may have changed since.
    """
    if len(outcomes) != len(told):
        raise ValueError(
            f"a Step of pool {pool!r} replays {len(outcomes)} answers, its client got {len(told)}"
        )
    for i, (operation, outcome, result) in enumerate(zip(operations, outcomes, told, strict=True)):
        again = outcome_to_pb(operation, outcome)
        if again != result:
            raise ValueError(
                f"replaying a Step of pool {pool!r} answers its operation {i} "
                f"({type(operation).__name__}) otherwise than its client was told "
                f"(status {again.status_code} against {result.status_code}): the server's limits or "
                "configuration changed since it was recorded; start with the previous ones"
            )


def _replay_call(registry: PoolRegistry, record: list[Any], when: float, now_wall: float) -> None:
    _, _, rpc, body, key, digest, answer = record
    request: Any
    if rpc == "Step":
        request = pb.StepRequest.FromString(body)
    elif rpc == "Allocate":
        request = pb.AllocateRequest.FromString(body)
    elif rpc == "Free":
        request = pb.FreeRequest.FromString(body)
    else:
        raise ValueError(f"unknown rpc {rpc!r}")
    service = registry.pools[request.pool]
    s = registry.sessions.sessions[request.session_id]
    groups = len(service.config.groups)
    if rpc == "Step":
        operations = [operation_from_pb(o, groups) for o in request.ops]
        outcomes = service.apply(s, operations)
        if answer is not None:
            _check_replayed(request.pool, operations, outcomes, pb.StepResponse.FromString(answer).results)
        if request.include_state:  # the answer took the session's events and statistics
            service.take_events(s)
            service.make_stats(s)
    elif rpc == "Allocate":
        (outcome,) = service.apply(s, [allocate_from_pb(request.op, groups)])
        if answer is not None:  # None: a keyless call in a journal written before answers were kept
            told = pb.AllocateResponse.FromString(answer)
            value = outcome.value
            if told.HasField("result"):
                same = isinstance(value, AllocateOutcome) and allocate_to_pb(value) == told.result
            else:  # its client was told an error (a refusal turned error, must_succeed)
                same = outcome.error is not None
            if not same:
                raise ValueError(
                    f"replaying an Allocate of pool {request.pool!r} answers otherwise than its client was "
                    "told: the server's limits or configuration changed since it was recorded; start with "
                    "the previous ones"
                )
    else:
        try:
            service.free_requests(s, request.request_ids, request.preempt)
        except ServiceError as err:  # a refused Free is never journaled: this one was applied
            raise ValueError(
                f"replaying a Free of pool {request.pool!r} is refused ({err.message}) though its client "
                "was told it was applied: the journal does not match the server that wrote it"
            ) from None
        if answer is not None:
            told_free = pb.FreeResponse.FromString(answer).num_free_blocks
            if told_free != service.engine.num_free_blocks:
                raise ValueError(
                    f"replaying a Free of pool {request.pool!r} leaves {service.engine.num_free_blocks} "
                    f"free blocks, its client was told {told_free}: the server's limits or configuration "
                    "changed since it was recorded; start with the previous ones"
                )
    if key:
        store = registry.idempotency
        real = store.clock
        at = real() - max(0.0, now_wall - when)  # the record's time on the monotonic clock
        store.clock = lambda: at
        try:
            store.expire()
            store.remember(s.session_id, rpc, key, digest, answer)
        finally:
            store.clock = real


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
) -> Recovery:
    """Recover ``registry`` (empty) from ``data_dir`` and journal from now on.

    Recovered sessions get a fresh lease; the new instance is appended to the journal
    (its predecessors' fences stay valid: :attr:`PoolRegistry.lineage`).

    Raises:
        JournalError: an incompatible or damaged journal or snapshot (names the file).
    """
    started = time.perf_counter()
    store = JournalStore(data_dir, synchronous)
    snap = store.snapshot()
    after = 0
    # Idempotency answers age by serving time only: "now" for replay is the time of the
    # last journaled record, not the wall clock at this start (a clock set forward
    # while the server was down must not expire answers a client may still retry; the
    # downtime does not count, which keeps answers longer, never shorter).
    served_until = _last_record_time(store)
    if snap is not None:
        expected = snapshot_fingerprint()
        if snap.fingerprint != expected:
            raise JournalError(
                f"journal {store.path}: the snapshot after record {snap.seq} was written by an "
                f"incompatible kvcoord ({snap.fingerprint}, this one reads {expected}); start the "
                "version that wrote it"
            )
        try:
            load_state(registry, snap.body, lambda: served_until if served_until is not None else -math.inf)
        except Exception as exc:
            raise JournalError(
                f"journal {store.path}: the snapshot after record {snap.seq} cannot be loaded: {exc!r}"
            ) from None
        after = snap.seq
    count = 0
    now_wall = served_until if served_until is not None else wall_clock()
    positions = registry.positions
    for seq, body in store.records(after):
        try:
            record = decode_record(body)
            if record[0] == "start":
                positions.started(str(record[2]), seq)
            elif record[0] == "restored":
                positions.voided()
            replay_record(registry, record, now_wall)
        except JournalError:
            raise
        except Exception as exc:
            raise JournalError(f"journal {store.path}: record {seq} cannot be replayed: {exc!r}") from None
        count += 1
    journal = Journal(store, after + count)
    recorder = JournalRecorder(
        journal, snapshot_every, lambda: (snapshot_fingerprint(), dump_state(registry))
    )
    for service in registry.pools.values():
        service.events.durable_sequence = service.events.last_sequence
    clock = registry.sessions.clock
    for s in registry.sessions.sessions.values():
        s.expires_at = clock() + s.lease_seconds
    registry.recorder = recorder
    positions.ended(after + count)
    if store.behind and (after or count):
        logger.warning(
            "journal %s may be behind what clients were told (%s): every recovered session is "
            "ended, its fence void and every prefix cache reset",
            store.path, store.behind,
        )  # fmt: skip
        fence_restored(registry, recorder)
    recorder.started(registry.instance_id)
    positions.started(registry.instance_id, journal.appended)
    return Recovery(
        recorder,
        str(store.path),
        after,
        count,
        time.perf_counter() - started,
        store.behind if count or after else "",
    )


def fence_restored(registry: PoolRegistry, recorder: JournalRecorder) -> None:
    """After a restored (older) journal: a client may hold blocks this state has never
    given it, and a cached hash may name a block since overwritten. So no earlier fence
    stays valid (a live worker's next call fails INSTANCE_CHANGED, its heartbeat
    SESSION_EXPIRED), every session ends (its requests are freed) and every prefix
    cache is forgotten; each step is journaled, so a later restart replays it.

    Raises:
        JournalError: a pool still holds blocks after its sessions ended.
    """
    recorder.restored()
    registry.lineage.clear()
    registry.positions.voided()
    for s in list(registry.sessions.sessions.values()):
        _end_session(registry, s)
        recorder.session_expired(s.session_id)
    for service in registry.pools.values():
        if not service.engine.reset_prefix_cache():
            raise JournalError(
                f"pool {service.name!r} still holds blocks after every session of a restored journal ended"
            )
        service.events.publish(service.engine.take_events())
        recorder.prefix_cache_reset(service)
