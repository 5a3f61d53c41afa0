"""A replica's place in a cluster, wired when the server starts (server.py): its
membership and the Replicas service (:func:`cluster_of`), the store journal
(:func:`store_journal`), and joining (:func:`join_cluster`)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import cbor2
import grpc
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

from .access import AccessControl
from .cluster import Cluster, ClusterError
from .cluster_placement import ClusterPlacement, store_failed
from .config import ClusterSettings, ServerConfig
from .idempotency import IdempotencyStore
from .lease_clock import LeaseClock
from .ownership import Member
from .pool_load import PoolLoad, loaded_apart
from .registry import PoolRegistry
from .registry_state import adopt_pool, dump_pool, journaled_limits
from .score_peers import ClusterScores, ScoringReplicas
from .servicer import AllocatorServicer
from .sessions import SessionTable
from .state_export import apart, encode_started, pool_encoded
from .store_journal import PoolStreams, StoreRecorder, encode_base
from .tls import PeerTLS, peer_credentials

__all__ = ["advertised", "cluster_of", "follow_store_health", "join_cluster", "store_journal"]

logger = logging.getLogger(__name__)


def advertised(c: ClusterSettings, addresses: Sequence[str]) -> str:
    """Where clients reach this replica: ``advertise_address``, else the first TCP
    listener (a wildcard host replaced by this host's name)."""
    if c.advertise_address:
        return c.advertise_address
    for address in addresses:
        if not address.startswith("unix:"):
            host, _, port = address.rpartition(":")
            if host in ("0.0.0.0", "[::]", "::", ""):
                host = socket.gethostname()
            return f"{host}:{port}"
    raise ClusterError("[cluster] needs a TCP listener or cluster.advertise_address (clients dial it)")


def cluster_of(
    cfg: ServerConfig,
    registry: PoolRegistry,
    servicer: AllocatorServicer,
    access: AccessControl,
    addresses: Sequence[str],
    server: grpc.aio.Server,
) -> Cluster:
    """This replica's cluster membership (not joined yet), wired to its registry, and
    the ``Replicas`` service (handovers) added to ``server``."""
    c = cfg.cluster
    me = Member(c.replica_id or socket.gethostname(), advertised(c, addresses))
    cluster = Cluster(c.endpoints, c.name, me, c.lease_seconds, c.store_timeout_seconds, registry.clock)
    cluster.local_pools = lambda: list(registry.pools)
    cluster.leave_seconds = cfg.server.grace_seconds
    cluster.max_message_bytes = cfg.server.max_message_bytes

    async def export(pool: str) -> bytes:  # the pool is moving: its state is the handover's
        return await pool_encoded(
            registry.pools[pool], lambda: cbor2.dumps(dump_pool(registry, pool, leases=True))
        )

    cluster.export_pool = export
    cluster.pool_free = registry.locks.wait

    def handed_over(pool: str) -> None:
        # not held any more when the adopter's claim swap deposed a write of its journal
        # to the store first (lost, below: removed there, its sessions redirected alike)
        if pool in registry.pools:
            servicer.observer.pool_deleted(registry.handed_over(pool))

    cluster.handed_over = handed_over
    cluster.on_term = registry.set_term
    if c.journal == "store":
        store_journal(cfg, cluster, registry, servicer)
    if cfg.server.auth_tokens:  # AdoptPool(Parts) needs full access: the first full-access token
        cluster.peer_metadata = (("authorization", f"Bearer {cfg.server.auth_tokens[0]}"),)
    elif access.required:
        raise ClusterError(
            "[cluster] with tenants needs a full-access token in server.auth_tokens: the replicas "
            "hand pools over to each other with it (Replicas.AdoptPool, AdoptPoolParts)"
        )
    if not cfg.server.tls.enabled and c.peer_tls != PeerTLS():
        raise ClusterError("cluster.peer_tls is set, but [server.tls] is off: the replicas serve plaintext")
    try:
        cluster.peer_tls = peer_credentials(cfg.server.tls, c.peer_tls)
    except ValueError as exc:
        raise ClusterError(str(exc)) from None
    placement = ClusterPlacement(cluster, registry)
    registry.placement = placement
    # ScorePools answers for every pool of the cluster: each other owner is asked for its part
    # (a pool being handed over is not scored: its copy here may be behind its new owner's)
    servicer.score_peers = ClusterScores(cluster, access, lambda: list(registry.settled()))
    peers = ScoringReplicas(
        placement,
        access,
        lambda pool: servicer.observer.pool_created(registry.pools[pool]),
        lambda: list(registry.settled()),
        servicer.score_here,
    )
    pb_grpc.add_ReplicasServicer_to_server(peers, server)
    return cluster


def store_journal(
    cfg: ServerConfig, cluster: Cluster, registry: PoolRegistry, servicer: AllocatorServicer
) -> None:
    """``journal = "store"``: each pool's records also go to its stream in etcd, and a
    pool whose owner is gone is rebuilt from it (store_journal.py)."""
    recorder = registry.recorder
    if not isinstance(recorder, StoreRecorder):
        raise ClusterError('[cluster] journal = "store" needs a journaled server (server.data_dir)')
    st = cfg.server
    streams = PoolStreams(
        lambda: cluster.client,
        cluster.prefix,
        lambda: cluster.view.lease_valid,
        cfg.cluster.store_snapshot_records,
    )

    def base(pool: str) -> bytes | asyncio.Future[bytes]:
        limits = journaled_limits(registry, registry.limits)
        wall = registry.wall_clock()

        def encode() -> bytes:
            return encode_base(
                dump_pool(registry, pool),
                registry.instance_id,
                limits,
                wall,
                registry.positions.key_of(registry.instance_id),
            )

        service = registry.pools.get(pool)
        if service is None or not apart(service):
            return encode()
        # the state right after the record that made the base due, encoded by a forked
        # child (here when the process cannot fork: the record's call is applied already)
        return encode_started(encode)

    def drop(pool: str) -> None:
        if pool in registry.pools:
            servicer.observer.pool_deleted(registry.remove(pool))

    def lost(pool: str) -> None:  # its records could not be written: the store's copy is the pool's
        if pool in registry.pools:
            servicer.observer.pool_deleted(registry.handed_over(pool))
        if cluster.client is not None:
            task = asyncio.get_running_loop().create_task(cluster.release(pool))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    def prepare(value: dict[str, Any] | None, encoded: bytes | None) -> Awaitable[PoolLoad]:
        return loaded_apart(encoded, value, registry.limits.max_tokens_per_request)

    async def load(ready: PoolLoad, term: int) -> None:
        name = str(ready.value["pool"]["name"])
        try:
            service = adopt_pool(registry, ready.value, ready.built)
            # records of an earlier instance of this journal the store held and it did not
            # (killed between the two commits): held now, for this start and the next
            brought = registry.positions.brought(service.held)
            registry.recorder.adopted(ready.value, service, brought, ready.encoded)
        finally:
            ready.let_go(registry.pools.get(name))
        registry.set_term(name, term)
        servicer.observer.pool_created(registry.pools[name])
        await registry.recorder.durable()

    lease_clock = registry.sessions.clock
    # (made on the rebuild's thread: the live lease clock is read there without counting
    # anything, store_rebuild.py; what a pool's replay ages is counted as the live pool's)
    peek = lease_clock.peek if isinstance(lease_clock, LeaseClock) else lease_clock

    def scratch(writer: str) -> PoolRegistry:
        return PoolRegistry(
            cfg.limits,
            SessionTable(peek, st.session_lease_seconds, st.max_session_lease_seconds),
            IdempotencyStore(peek, st.idempotency_window_seconds, st.idempotency_max_bytes),
            writer,
            clock=registry.clock,
        )

    streams.on_lost = lost
    streams.stall_seconds = st.stall_seconds
    recorder.attach_streams(streams, base)
    cluster.streams = streams
    cluster.drop_local = drop
    cluster.prepare_pool = prepare
    cluster.load_pool = load
    cluster.scratch_registry = scratch


async def join_cluster(
    cfg: ServerConfig, cluster: Cluster, registry: PoolRegistry, servicer: AllocatorServicer
) -> None:
    """Register this replica, claim the pools its journal holds, and create the
    configured pools placed here that the cluster does not have yet.

    Raises:
        ClusterError: the store cannot be reached, or refuses this replica.
    """
    c, me = cfg.cluster, cluster.me
    try:
        await cluster.start()
        for decl in cfg.pools:
            view = cluster.view
            if decl.name in registry.pools or decl.name in view.catalog or decl.name in view.claims:
                continue
            if not view.placed_here(decl.name) or await cluster.claim(decl.name) is None:
                continue
            handle, _ = registry.create(decl.name, decl.config)
            servicer.observer.pool_created(handle)
        await registry.recorder.durable()
    except BaseException as exc:
        await cluster.stop()
        # a store that did not answer: "cannot start", exit 3 (was: a traceback, exit 1)
        if isinstance(exc, Exception) and store_failed(exc):
            raise ClusterError(f"the cluster store failed while this replica joined: {exc!r}") from exc
        raise
    logger.info(
        "replica %s serves %d pools of cluster %s (members: %s)",
        me.replica_id, len(cluster.view.owned()), c.name, ", ".join(sorted(cluster.view.members)),
    )  # fmt: skip


#: how often a replica compares its health with its cluster lease (seconds)
HEALTH_EVERY = 0.25


async def follow_store_health(cluster: Cluster, serving: Callable[[bool], Awaitable[None]]) -> None:
    """Tell ``serving`` (the Allocator service's health) whether this replica can serve
    its pools: False once its cluster lease may have ended (cut off from the store: it
    refuses every pool call then, ownership.py), True again once a renewal succeeded.
    Without it a replica cut off from etcd stayed SERVING while refusing every pool,
    and load balancers kept routing to it. Runs until cancelled; called only on a
    change (and once at the start)."""
    was: bool | None = None
    while True:
        now = cluster.view.lease_valid
        if now != was:
            if was is not None or not now:  # (cut off already at the start: said too)
                log = logger.info if now else logger.error
                log(
                    "replica %s %s: health %s",
                    cluster.me.replica_id,
                    "reaches the cluster store again"
                    if now
                    else "is cut off from the cluster store (its lease may "
                    "have ended: no pool is served here)",
                    "SERVING" if now else "NOT_SERVING",
                )
            await serving(now)
            was = now
        await asyncio.sleep(HEALTH_EVERY)
