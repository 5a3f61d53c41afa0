"""Assembling and running the gRPC server: listeners, health, reflection, sessions."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvcoord.v1 import allocator_pb2 as pb

from .access import AccessControl
from .cluster import Cluster, ClusterError
from .config import ServerConfig
from .data_dir_lock import DataDirLock
from .durability import JournalRecorder
from .gc_freezer import GcFreezer
from .idempotency import IdempotencyStore
from .journal_behind import journal_behind
from .kv_event_feed import Publishers
from .lease_clock import LeaseClock, keep_ticking
from .logs import ids
from .observers import OperationObserver
from .recovery import Recovery, open_journal
from .registry import PoolRegistry
from .server_cluster import cluster_of, follow_store_health, join_cluster
from .servicer import AllocatorServicer, add_servicer
from .sessions import SessionTable
from .startup import StartupDecision, check_data_dir, decide_startup
from .store_journal import StoreRecorder
from .tasks import cancel_and_wait
from .tls import server_credentials

__all__ = ["ClusterError", "ListenError", "RunningServer", "start_server"]


class ListenError(Exception):
    """A listener cannot be bound (the port is in use, the address is not local)."""


async def _close_journal(recorder: object) -> None:
    """Close the journal of a server that did not start (nothing to snapshot)."""
    if isinstance(recorder, JournalRecorder):
        recorder.close()
        await recorder.journal.close()


logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name
#: how long a stopping server waits for a lease marker write in flight before it gives
#: the data directory back (lease_marker.py)
MARKER_JOIN_SECONDS = 30.0
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


@dataclasses.dataclass
class RunningServer:
    """A started server; ``addresses`` are the bound listeners (ports resolved)."""

    server: grpc.aio.Server
    servicer: AllocatorServicer
    health: health.aio.HealthServicer
    addresses: list[str]
    grace_seconds: float
    _reaper: asyncio.Task[None]
    #: what recovery found (journal mode), else None
    recovery: Recovery | None = None
    #: set once the journal could not be written: the server no longer serves (health
    #: NOT_SERVING, every call UNAVAILABLE) and its owner must stop it (main.py exits)
    journal_failed: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    _health_task: asyncio.Task[None] | None = None
    #: the pools' KV event publishers in vLLM's format ([[kv_events]]), if any
    publishers: Publishers | None = None
    #: the data directory's start-up findings (startup.py): the grace and its reason
    startup: StartupDecision | None = None
    #: this replica's membership and claims ([cluster]; None on a single node)
    cluster: Cluster | None = None
    #: the data directory held by this server alone (None without one): given back at stop
    data_dir_lock: DataDirLock | None = None
    #: the Allocator service's health following the cluster lease (server_cluster.py)
    store_health: asyncio.Task[None] | None = None

    async def allocator_health(self, can_serve: bool) -> None:
        """The Allocator service's health as the cluster lease allows ("" stays SERVING: the
        process answers, a liveness probe's question); never SERVING once failed or stopping."""
        if not (self.journal_failed.is_set() or self.servicer.stopping):
            await self.health.set(SERVICE_NAME, SERVING if can_serve else NOT_SERVING)

    def on_journal_failure(self, exc: BaseException) -> None:
        """Stop serving loudly: in memory the state is ahead of the disk, so a restart
        (which recovers the committed prefix) is the only way back."""
        logger.critical(
            "journal or lease marker write failed: this server stops serving and must be restarted: %s", exc
        )
        self.servicer.journal_failed(exc)
        self._reaper.cancel()
        if self.store_health is not None:
            self.store_health.cancel()
        self._health_task = asyncio.get_running_loop().create_task(self._not_serving())
        self.journal_failed.set()

    async def _not_serving(self) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)

    async def stop(self, grace: float | None = None, snapshot: bool = True) -> None:
        """Graceful shutdown: health turns NOT_SERVING, in-flight calls finish, streams
        end; with a journal, a snapshot is taken (unless ``snapshot`` is False: tests
        that read the records) so the next start replays nothing."""
        grace = self.grace_seconds if grace is None else grace
        if self.cluster is not None and self.journal_failed.is_set() is False:
            # a graceful leave: every pool goes to its next owner with its state
            try:
                await self.cluster.leave()
            except Exception as exc:  # noqa: BLE001 - the pools stay unclaimed until this replica is back
                logger.error("handing the pools over at stop failed: %s", exc)
        self.servicer.stopping = True
        self.servicer.step_streams.end()  # (an idle Step stream never holds the grace period)
        await self.health.enter_graceful_shutdown()
        await cancel_and_wait([self._reaper] + ([self.store_health] if self.store_health else []))
        await self.server.stop(grace)
        if self.publishers is not None:
            await self.publishers.close()
        if self.servicer.score_peers is not None:  # (its channels to the other replicas)
            await self.servicer.score_peers.close()
        try:
            await self._snapshot_and_close(snapshot)
        finally:
            try:
                if self.cluster is not None:  # nothing is served any more: the claims go
                    await self.cluster.stop()
            finally:
                await self._release_data_dir()

    async def _release_data_dir(self) -> None:
        """Give the data directory back, once the journal is closed and no write of the
        lease marker is in flight (another server may start on it then); a marker write
        not done within MARKER_JOIN_SECONDS keeps it held until this process ends (which
        waits for the write)."""
        if self.data_dir_lock is None:
            return
        recorder = self.servicer.registry.recorder
        if isinstance(recorder, JournalRecorder) and recorder.journal.hung:
            # a commit that may still land: no other server may open the journal meanwhile
            logger.error(
                "a journal commit never returned: the data directory stays locked until this process ends"
            )
            return
        marker = self.startup.marker if self.startup is not None else None
        if marker is not None and marker.hung:
            marker.close(0)
            logger.error(
                "a lease marker write never returned: the data directory stays locked until this process ends"
            )
            return
        if marker is not None and not await asyncio.to_thread(marker.close, MARKER_JOIN_SECONDS):
            logger.error(
                "the lease marker's write did not end within %.0f s: the data directory stays locked until "
                "this process ends", MARKER_JOIN_SECONDS,
            )  # fmt: skip
            return
        self.data_dir_lock.release()

    async def _snapshot_and_close(self, snapshot: bool) -> None:
        recorder = self.servicer.registry.recorder
        if isinstance(recorder, JournalRecorder):
            if snapshot and recorder.journal.failed is None:
                # a clean stop: the next start loads this snapshot and replays nothing
                # (once every Step applied in slices is done: its call may be gone)
                try:
                    await self.servicer.registry.locks.wait_all()
                    await recorder.final_snapshot()
                except Exception as exc:  # the records are still there: the next start replays them
                    logger.error("the snapshot at stop failed: %s", exc)
            recorder.close()
            await recorder.journal.close()

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def _reap(servicer: AllocatorServicer, every: float, lease_clock: Callable[[], float]) -> None:
    """End lapsed sessions and reservations every ``every`` seconds; a :class:`LeaseClock`
    ticks beside it (ended with it: a server that stops reaping counts no more pauses)."""
    ticker = None
    if isinstance(lease_clock, LeaseClock):
        ticker = asyncio.get_running_loop().create_task(keep_ticking(lease_clock))
    freezer = GcFreezer()
    try:
        while True:
            await asyncio.sleep(every)
            try:
                servicer.reap_expired_sessions()
                servicer.expire_reservations()
                freezer.maybe_freeze(servicer.registry.pools.values())
            except Exception:  # pragma: no cover - logged, the reaper keeps going
                logger.exception("session reaper failed")
    finally:
        if ticker is not None:
            ticker.cancel()


def _options(cfg: ServerConfig) -> list[tuple[str, int]]:
    s = cfg.server
    return [
        # gRPC binds with SO_REUSEPORT by default: a second server on a port in use would
        # listen beside the first and the kernel would split new connections between
        # two servers with different pools and sessions. Off, the second cannot bind
        # (ListenError: `serve` exits 3); a restart after SIGKILL still binds at once
        # (SO_REUSEADDR, which gRPC always sets).
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", s.max_message_bytes),
        ("grpc.max_send_message_length", s.max_message_bytes),
        ("grpc.keepalive_time_ms", int(s.keepalive_time_seconds * 1000)),
        ("grpc.keepalive_timeout_ms", int(s.keepalive_timeout_seconds * 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 5000),
        ("grpc.http2.max_pings_without_data", 0),
    ]


async def start_server(
    cfg: ServerConfig,
    *,
    observer: OperationObserver | None = None,
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    instance_id: str | None = None,
    clock: Callable[[], float] = time.monotonic,
    wall_clock: Callable[[], float] = time.time,
    reap_interval: float = 1.0,
    start_empty: bool = False,
    restored: bool = False,
) -> RunningServer:
    """Create the declared pools, bind every listener and start serving.

    TCP listeners use TLS when ``[server.tls]`` names a certificate (unix sockets stay
    plaintext, see :mod:`kvcoord.service.tls`). With ``durability = "journal"`` and a
    ``data_dir``, the state journaled there is recovered first (no grace period then:
    nothing was lost; unless the journal is behind what clients were told, a restored
    backup: then its sessions are fenced and the grace period applies), and configured
    pools that are not in it are created. The data directory's start-up rules (a
    writable directory, a lost journal refused unless ``start_empty``, a grace period
    that survives restarts) are :mod:`kvcoord.service.startup`'s. ``restored``: the
    operator restored the data directory from a copy (``kvcoord serve --restored``), so
    its history may be behind what clients were told: it is handled as a restore a
    client proved (every session and fence ends, prefix caches are emptied, a durable
    grace of ``max_session_lease_seconds``) before the first call is answered.

    The data directory is held by this server alone from before anything in it is read
    until :meth:`RunningServer.stop` (data_dir_lock.py).

    Raises:
        DataDirInUseError: another server holds the data directory.
        RuntimeError: a listener could not be bound.
        MarkerError: the data directory's lease marker cannot be read.
        DataDirError: the data directory cannot be written (or its grace.json read or written).
        JournalLostError: the journal is gone while journal.progress names committed
            records (and ``start_empty`` is not set).
        JournalError: the journal is incompatible or damaged (the message names the file).
        ValueError: a TLS file is unreadable or invalid.
    """
    lock = None
    if cfg.server.data_dir:
        lock = DataDirLock.acquire(check_data_dir(cfg.server.data_dir))
    try:
        running = await _start(
            cfg, observer, interceptors, instance_id, clock, wall_clock, reap_interval, start_empty, restored
        )
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    running.data_dir_lock = lock
    return running


async def _start(
    cfg: ServerConfig,
    observer: OperationObserver | None,
    interceptors: Sequence[grpc.aio.ServerInterceptor],
    instance_id: str | None,
    clock: Callable[[], float],
    wall_clock: Callable[[], float],
    reap_interval: float,
    start_empty: bool,
    restored: bool,
) -> RunningServer:
    """:func:`start_server` once the data directory is held."""
    st = cfg.server
    # Leases (and what is aged with them) leave out the time the server could not run
    # (lease_clock.py); an injected clock is a test's, whose jumps are time passing.
    lease_clock = LeaseClock(clock) if clock is time.monotonic else clock
    sessions = SessionTable(lease_clock, st.session_lease_seconds, st.max_session_lease_seconds)
    if cfg.writes_can_stall:  # a lease asked for must outlast a stall (stalls.py)
        sessions.stall_bound = st.stall_seconds
    decision = decide_startup(cfg, clock, wall_clock, start_empty)
    grace_until = decision.grace_until
    if decision.marker is not None:
        sessions.on_lease = decision.cover_lease
    registry = PoolRegistry(
        cfg.limits,
        sessions,
        IdempotencyStore(lease_clock, st.idempotency_window_seconds, st.idempotency_max_bytes),
        instance_id,
        grace_until,
        clock,
    )
    registry.wall_clock = wall_clock
    registry.max_message_bytes = st.max_message_bytes
    recovery = None
    if st.journaled:
        store = cfg.cluster.enabled and cfg.cluster.journal == "store"
        recovery = open_journal(
            registry, st.data_dir, st.synchronous, st.snapshot_every, wall_clock,
            make_recorder=StoreRecorder if store else JournalRecorder,
            # a restore found: the grace is durable before its first record (recovery.py)
            before_fencing=decision.restored_at_start, fence_generation=decision.restore_generation,
        )  # fmt: skip
        if recovery.restored:
            # The journal may be behind what clients were told (recovery.py ended and
            # fenced its sessions): a worker of the previous instance may still use
            # blocks this state calls free, until its lease ends. Without a lease marker
            # that may be any lease this server grants.
            grace_until = decision.restored(recovery.restored)
        elif recovery.recovered:
            # Every acknowledged allocation is back: no lease of the previous instance
            # can hold a block this one hands out, so no grace period from the lease
            # marker; but a grace an earlier instance began (a restore, a lost journal)
            # and did not see to its end still runs (startup.py, grace.json).
            grace_until = decision.recovered()
            for s in sessions.sessions.values():
                sessions.renew(s)
        registry.grace_until = grace_until
        for service in registry.pools.values():  # created during recovery with the old grace
            service.grace_until = grace_until
        logger.info(
            "journal %s: recovered %d pools, %d sessions (snapshot after record %d + %d records) in %.3f s",
            recovery.path, len(registry.pools), len(sessions.sessions), recovery.snapshot_seq,
            recovery.records, recovery.seconds,
        )  # fmt: skip
        registry.positions.on_behind = lambda why: journal_behind(registry, decision, why)
        if restored:
            # The operator restored this directory (deploy/README.md, "Restore the
            # volume"): nothing here can tell how far the lost history went, so every
            # session and fence of it ends now, before any call is answered.
            journal_behind(registry, decision, "the data directory was restored (--restored)")
            grace_until = registry.grace_until
        elif decision.unfenced_restore(registry.positions.generation):
            # An earlier instance proved a restore, wrote its grace and was killed before
            # its fencing was committed (startup.py): fence now, before any answer.
            journal_behind(
                registry,
                decision,
                "an earlier instance proved it and was stopped before its fencing committed",
            )
            grace_until = registry.grace_until
    elif st.durability == "journal":
        logger.warning("no data_dir: durability is none, a restart loses every pool and allocation")
    # Written (synced) before the first answer: a restart inside the grace applies the rest
    # (DataDirError, exit 3, when it cannot be).
    decision.persist_at_start(grace_until)
    if grace_until > clock():
        logger.warning(
            "leases granted by an earlier instance may run for another %.1f s (%s): no session may "
            "attach (and so no block is handed out) until then",
            grace_until - clock(), decision.reason or "lease marker",
        )  # fmt: skip
    access = AccessControl(cfg.tenants, cfg.server.auth_tokens, sessions)
    with_identities = [t.name for t in cfg.tenants if t.identities]
    if with_identities and not (cfg.server.tls.enabled and cfg.server.tls.mutual):
        logger.warning(
            "tenants %s have mTLS identities, but [server.tls] sets no client_ca_file: no client "
            "certificate is asked for, so those identities can never name a caller",
            ", ".join(sorted(with_identities)),
        )
    servicer = AllocatorServicer(registry, observer, access=access, max_message_bytes=st.max_message_bytes)
    for handle in registry.pools.values():
        servicer.observer.pool_created(handle)
    for decl in () if cfg.cluster.enabled else cfg.pools:  # a cluster creates them once it joined
        existing = registry.pools.get(decl.name)
        if existing is not None:
            if existing.wire_config != decl.config:
                logger.warning(
                    "pool %s: the journaled pool differs from the configured one and is kept "
                    "(delete it over the wire to apply the new layout)",
                    decl.name,
                    extra=ids(pool=decl.name),
                )
            continue
        handle, _ = registry.create(decl.name, decl.config)
        servicer.observer.pool_created(handle)
    await registry.recorder.durable()
    # Credentials and roles are checked per call in front of every Allocator handler
    # (servicer.add_servicer, access.py); health and reflection stay open.
    server = grpc.aio.server(options=_options(cfg), interceptors=list(interceptors))
    add_servicer(servicer, server, interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    tls = cfg.server.tls
    credentials = server_credentials(tls) if tls.enabled else None
    addresses = []
    for address in cfg.server.listen:
        unix = address.startswith("unix:")
        try:
            if credentials is not None and not unix:
                port = server.add_secure_port(address, credentials)
            else:
                port = server.add_insecure_port(address)
        except RuntimeError:  # grpc's "Failed to bind to address ..."
            port = 0
        logger.info("gRPC listener %s: %s", address, "plaintext" if unix else tls.describe())
        if access.required and not unix and credentials is None:
            logger.warning(
                "gRPC listener %s is plaintext: bearer tokens cross the network unencrypted", address
            )
        if port == 0:
            await _close_journal(registry.recorder)
            raise ListenError(f"cannot listen on {address}: the address is in use or not available here")
        if address.startswith("unix:"):
            addresses.append(address)
        else:
            host = address.rsplit(":", 1)[0]
            addresses.append(f"{host}:{port}")
    try:
        cluster = (
            cluster_of(cfg, registry, servicer, access, addresses, server) if cfg.cluster.enabled else None
        )
    except ClusterError:
        await _close_journal(registry.recorder)
        raise
    await server.start()
    if cluster is not None:
        try:
            await join_cluster(cfg, cluster, registry, servicer)
        except BaseException:
            await server.stop(0)
            await _close_journal(registry.recorder)
            raise
    for name, ok in (("", True), (SERVICE_NAME, cluster is None or cluster.view.lease_valid)):
        await health_servicer.set(name, SERVING if ok else NOT_SERVING)  # (a lease may end as it starts)
    reaper = asyncio.get_running_loop().create_task(_reap(servicer, reap_interval, lease_clock))
    running = RunningServer(
        server, servicer, health_servicer, addresses, cfg.server.grace_seconds, reaper, recovery
    )
    if isinstance(registry.recorder, JournalRecorder):
        registry.recorder.journal.on_failure.append(running.on_journal_failure)
        registry.recorder.journal.stall_seconds = cfg.server.stall_seconds
    if cfg.kv_events:
        running.publishers = Publishers(
            cfg.kv_events,
            registry,
            data_dir=cfg.server.data_dir if cfg.server.journaled else None,
            on_gap=lambda pool: servicer.observer.events_gap(pool, "zmq"),
        )
    decision.on_marker_failure = running.on_journal_failure
    if decision.marker is not None:
        decision.marker.stall_seconds = cfg.server.stall_seconds
    running.startup = decision
    running.cluster = cluster
    if cluster is not None:
        running.store_health = asyncio.get_running_loop().create_task(
            follow_store_health(cluster, running.allocator_health)
        )
    return running
