"""The registry's state as plain values (lists, ints, bytes, strings: no pickled
object), for snapshots (:func:`dump_state`, :func:`load_state`; recovery.py reads and
writes them) and for a pool handed over to another replica (:func:`dump_pool`,
:func:`adopt_pool`; cluster.py), and the limits journal records are applied under."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

from kvcoord.engine import PrefixCacheStats
from kvcoord.engine.state import STATE_VERSION, event_from_value, event_to_value
from kvcoord.v1 import allocator_pb2 as pb

from .mutation_bodies import take_events_budget
from .pool_service import Limits, PoolService
from .pool_types import ReservationLease
from .registry import PoolRegistry
from .sessions import Session, attach_tail

__all__ = [
    "SNAPSHOT_FORMAT",
    "adopt_pool",
    "apply_limits",
    "check_format",
    "dump_pool",
    "dump_state",
    "journaled_limits",
    "limits_from",
    "load_pools",
    "load_state",
    "pool_value",
    "session_value",
    "snapshot_fingerprint",
]

#: the snapshot value's format (1 was pickle, no longer read)
SNAPSHOT_FORMAT = 2


def snapshot_fingerprint() -> str:
    """Names the snapshot format and the engine state version it contains."""
    return f"kvcoord-snapshot-{SNAPSHOT_FORMAT}-state{STATE_VERSION}"


def _stats(stats: PrefixCacheStats | None) -> list[Any] | None:
    return None if stats is None else list(dataclasses.astuple(stats))


def pool_value(service: PoolService) -> dict[str, Any]:
    """One pool's state as plain values (without its sessions)."""
    wire: Any = service.wire_config
    return {
        "name": service.name,
        "config": wire.SerializeToString(),
        "incarnation": service.fence.incarnation,
        "created_at": service.created_at,
        "engine": service.export_state(),
        "events": [(seq, event_to_value(e)) for seq, e in service.events.kept()],
        "last_sequence": service.events.last_sequence,
        "owners": [(rid, s.session_id) for rid, s in service.owners.items()],
        "term": service.fence.term,
        "held": {instance: list(end) for instance, end in service.held.items()},
    }


def session_value(s: Session) -> tuple[Any, ...]:
    """One session as plain values (its attach key last, when it has one, then whether
    its Attach reset the prefix cache, when it did)."""
    return (
        s.session_id, s.pool, s.client_name, s.lease_seconds, list(s.owned), s.events_cursor,
        _stats(s.stats), s.exclusive, s.tenant, *attach_tail(s),
    )  # fmt: skip


def dump_state(
    registry: PoolRegistry, writer: str, limits: Limits, wall_clock: Callable[[], float] = time.time
) -> dict[str, Any]:
    """The registry's whole state as plain values (see the module docstring).

    Args:
        writer: the instance whose records follow this state.
        limits: the limits the journal's records are applied with.
    """
    pools = [pool_value(service) for service in registry.pools.values()]
    sessions = [session_value(s) for s in registry.sessions.sessions.values()]
    return {
        "format": SNAPSHOT_FORMAT,
        "lineage": sorted(registry.lineage | {registry.instance_id}),
        "writer": writer,
        "limits": journaled_limits(registry, limits),
        "pools": pools,
        "sessions": sessions,
        "idempotency": [list(e) for e in registry.idempotency.export()],
        "idempotency_sequences": registry.idempotency.export_sequences(),
        "wall": wall_clock(),
        # the last record of each earlier instance (positions.py); the current one's
        # end is where recovery from this snapshot finds the next start record
        "positions": {**registry.positions.export(), "latest": registry.instance_id},
    }


def load_state(
    registry: PoolRegistry, state: dict[str, Any], wall_clock: Callable[[], float] = time.time
) -> str:
    """Rebuild ``registry`` (empty, recording nothing) from a :func:`dump_state` value,
    under the limits it names. Returns the instance whose records follow it."""
    if state.get("format") != SNAPSHOT_FORMAT:
        raise ValueError(f"snapshot format {state.get('format')!r}, this kvcoord reads {SNAPSHOT_FORMAT}")
    apply_limits(registry, limits_from(state["limits"]))
    registry.lineage.update(state["lineage"])
    registry.positions.restore(state.get("positions"))
    load_pools(registry, state["pools"], state["sessions"])
    offline = max(0.0, wall_clock() - state["wall"])
    registry.idempotency.restore([(*e[:4], e[4] + offline, e[5]) for e in state["idempotency"]])
    registry.idempotency.restore_sequences(state.get("idempotency_sequences"))
    return str(state["writer"])


def load_pools(
    registry: PoolRegistry, pools: list[dict[str, Any]], sessions: list[Any], built: object = None
) -> list[PoolService]:
    """Create ``pools`` (values of :func:`pool_value`) with their ``sessions``.
    ``built``: the first pool's engine, built from its value already (pool_load.py),
    taken when made for the config the pool is created with (else built here)."""
    services = {}
    for p in pools:
        held = _held(p.get("held"))
        service, _ = registry.create(
            p["name"], pb.PoolConfig.FromString(p["config"]), p["incarnation"], p["created_at"]
        )
        service.import_state(p["engine"], built)
        built = None
        service.held = held
        if p.get("term"):
            service.fence = dataclasses.replace(service.fence, term=int(p["term"]))
        service.events.restore([(seq, event_from_value(v)) for seq, v in p["events"]], p["last_sequence"])
        services[p["name"]] = (service, p["owners"])
    table = registry.sessions
    for sid, pool, client_name, lease, owned, cursor, stats, exclusive, tenant, *key in sessions:
        s = Session(sid, pool, client_name, lease, table.clock() + lease, exclusive=exclusive, tenant=tenant,
                    attach_key=key[0] if key else "", reset_at_attach=len(key) > 1 and bool(key[1]))  # fmt: skip
        s.owned = dict.fromkeys(owned)
        s.events_cursor = cursor
        s.stats = None if stats is None else PrefixCacheStats(*stats)
        table.sessions[sid] = s
        owner = services.get(pool)
        if owner is not None:  # the engine's namespace table came with the snapshot
            owner[0].bind_namespace(s)
    for service, owners in services.values():
        service.owners = {rid: table.sessions[sid] for rid, sid in owners}
    return [service for service, _ in services.values()]


def _held(value: Any) -> dict[str, list[Any]]:
    """A pool value's ``held`` (absent before kvcoord carried it): instance id ->
    [position, tag] (positions.py, JournalPositions.brought).

    Raises:
        TypeError: not that shape.
    """
    held: dict[str, list[Any]] = {}
    for instance, end in (value or {}).items():
        position, tag = end
        if not isinstance(instance, str) or type(position) is not int or not isinstance(tag, bytes):
            raise TypeError(f"a pool's held positions are instance -> [int, bytes], not {end!r:.80}")
        held[instance] = [position, tag]
    return held


def dump_pool(registry: PoolRegistry, name: str, leases: bool = False) -> dict[str, Any]:
    """Everything of one pool that moves with it to another replica (a handover,
    cluster.py): its engine state and events, its sessions with their cursors, the
    kept answers of those sessions (idempotency), and the instances whose fences stay
    valid for it (this one and its lineage); its pool value carries the records of
    earlier instances it holds (``held``: it was rebuilt from the cluster store, on this
    replica or another; positions.py, JournalPositions.brought).

    ``leases`` (a handover's value, not a base in the cluster store): also the live
    reservations' holders and the seconds each has left (:func:`adopt_leases`)."""
    service = registry.pools[name]
    sessions = registry.sessions.of_pool(name)
    ids = {s.session_id for s in sessions}
    extra: dict[str, Any] = {}
    if leases:
        now = service.sessions.clock()
        extra["leases"] = [
            [rid, lease.tenant, max(0.0, lease.deadline - now)]
            for rid, lease in service.reserving.leases.items()
        ]
    return {
        **extra,
        "format": SNAPSHOT_FORMAT,
        "state_version": STATE_VERSION,
        "pool": pool_value(service),
        "sessions": [session_value(s) for s in sessions],
        "idempotency": [list(e) for e in registry.idempotency.export() if e[0] in ids],
        "idempotency_sequences": registry.idempotency.export_sequences(ids),
        "lineage": sorted(registry.lineage | {registry.instance_id}),
    }


def check_format(value: Any) -> None:
    """Raises ValueError unless ``value`` is a pool (:func:`dump_pool`) in the format and
    engine state version this kvcoord reads."""
    if not isinstance(value, dict):
        raise ValueError(f"a handed-over pool is a map, not {type(value).__name__}")
    if value.get("format") != SNAPSHOT_FORMAT or value.get("state_version") != STATE_VERSION:
        raise ValueError(
            f"a handed-over pool in format {value.get('format')!r}/state {value.get('state_version')!r}, "
            f"this kvcoord reads {SNAPSHOT_FORMAT}/state {STATE_VERSION}: run one version across the cluster"
        )


def adopt_pool(registry: PoolRegistry, value: dict[str, Any], built: object = None) -> PoolService:
    """Load a pool :func:`dump_pool` made on another replica into ``registry``
    (recording nothing: the caller journals it). A copy of the pool already here (a
    stale one, from an earlier handover that did not complete) is replaced.
    ``built``: its engine built already (off the loop: pool_load.py).

    Raises:
        ValueError: another format or engine state version.
    """
    check_format(value)
    name = value["pool"]["name"]
    if name in registry.pools:
        registry.remove(name)
    registry.lineage.update(value["lineage"])
    (service,) = load_pools(registry, [value["pool"]], value["sessions"], built)
    registry.idempotency.restore([tuple(e) for e in value["idempotency"]])
    registry.idempotency.restore_sequences(value.get("idempotency_sequences"))
    for s in registry.sessions.of_pool(name):
        s.expires_at = registry.sessions.clock() + s.lease_seconds
    return service


def adopt_leases(service: PoolService, value: dict[str, Any]) -> None:
    """The reservations of a pool handed over (:func:`dump_pool` with ``leases``) held
    here for the time each had left (at most max_reservation_seconds; was: none, and
    the reaper released every one at once). Not on a replay of the handover's journal
    record: a restarted server releases the reservations it recovered.

    Raises:
        TypeError: not [reservation id, tenant, seconds] entries.
    """
    clock = service.sessions.clock
    for entry in value.get("leases") or ():
        rid, tenant, left = entry
        if not isinstance(rid, str) or not isinstance(tenant, str) or type(left) not in (int, float):
            raise TypeError(f"a handed-over reservation lease is [str, str, seconds], not {entry!r:.80}")
        if rid in service.reservations.live and left > 0:
            seconds = min(float(left), service.limits.max_reservation_seconds)
            service.reserving.leases[rid] = ReservationLease(tenant, clock() + seconds)


def journaled_limits(registry: PoolRegistry, limits: Limits) -> dict[str, int]:
    """What the journal's records are applied under: the pools' limits and the answer
    budget (``max_message_bytes``: events past it wait for the next answer, so it
    decides how far a session's event cursor moves)."""
    return {**dataclasses.asdict(limits), "max_message_bytes": registry.max_message_bytes}


def limits_from(value: dict[str, int]) -> Limits:
    """Journaled limits (a limit this kvcoord does not know is ignored; one it knows
    that is missing takes its default)."""
    names = {f.name for f in dataclasses.fields(Limits)}
    return Limits(**{k: v for k, v in value.items() if k in names})


def apply_limits(registry: PoolRegistry, limits: Limits, answer_bytes: int | None = None) -> None:
    """Make ``limits`` the registry's and every pool's (event buffers resized), and
    ``answer_bytes`` (when given) the answer budget replayed calls are cut at."""
    registry.limits = limits
    registry.memory.limit = limits.max_pool_memory_bytes
    if answer_bytes is not None:
        registry.max_message_bytes = answer_bytes
    for service in registry.pools.values():
        service.limits = limits
        service.events.resize(limits.event_buffer)
        service.answer_event_bytes = take_events_budget(registry.max_message_bytes)
