"""Assembling and running the gRPC server: listeners, health, reflection, sessions."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from kvcoord.v1 import allocator_pb2 as pb

from .auth import TokenAuthInterceptor
from .config import ServerConfig
from .idempotency import IdempotencyStore
from .lease_marker import LeaseMarker
from .registry import PoolRegistry
from .servicer import AllocatorServicer, OperationObserver, add_servicer
from .sessions import SessionTable
from .tls import server_credentials

__all__ = ["RunningServer", "start_server"]

logger = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Allocator"].full_name


@dataclasses.dataclass
class RunningServer:
    """A started server; ``addresses`` are the bound listeners (ports resolved)."""

    server: grpc.aio.Server
    servicer: AllocatorServicer
    health: health.aio.HealthServicer
    addresses: list[str]
    grace_seconds: float
    _reaper: asyncio.Task[None]

    async def stop(self, grace: float | None = None) -> None:
        """Graceful shutdown: health turns NOT_SERVING, in-flight calls finish, streams end."""
        grace = self.grace_seconds if grace is None else grace
        self.servicer.stopping = True
        await self.health.enter_graceful_shutdown()
        self._reaper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reaper
        await self.server.stop(grace)

    async def wait(self) -> None:
        await self.server.wait_for_termination()


async def _reap(servicer: AllocatorServicer, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            servicer.reap_expired_sessions()
        except Exception:  # pragma: no cover - logged, the reaper keeps going
            logger.exception("session reaper failed")


def _options(cfg: ServerConfig) -> list[tuple[str, int]]:
    s = cfg.server
    return [
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
) -> RunningServer:
    """Create the declared pools, bind every listener and start serving.

    TCP listeners use TLS when ``[server.tls]`` names a certificate (unix sockets stay
    plaintext, see :mod:`kvcoord.service.tls`).

    Raises:
        RuntimeError: a listener could not be bound.
        MarkerError: the state directory's lease marker cannot be read.
        ValueError: a TLS file is unreadable or invalid.
    """
    st = cfg.server
    sessions = SessionTable(clock, st.session_lease_seconds, st.max_session_lease_seconds)
    grace_until = clock() + st.startup_grace_seconds
    if st.state_dir:
        marker = LeaseMarker(st.state_dir, st.max_session_lease_seconds, wall_clock)
        previous = marker.previous_leases_end()
        if previous is not None and previous > wall_clock():
            wait = previous - wall_clock()
            grace_until = max(grace_until, clock() + wait)
            logger.warning(
                "leases granted by the previous instance may run for another %.1f s: no session may "
                "attach (and so no block is handed out) until then",
                wait,
            )
        sessions.on_lease = lambda s: marker.cover(s.lease_seconds)
    registry = PoolRegistry(
        cfg.limits,
        sessions,
        IdempotencyStore(clock, st.idempotency_window_seconds, st.idempotency_max_bytes),
        instance_id,
        grace_until,
        clock,
    )
    servicer = AllocatorServicer(registry, observer)
    for decl in cfg.pools:
        handle, _ = registry.create(decl.name, decl.config)
        servicer.observer.pool_created(handle)
    chain = list(interceptors)
    if cfg.server.auth_tokens:
        chain.insert(0, TokenAuthInterceptor(cfg.server.auth_tokens))
    server = grpc.aio.server(options=_options(cfg), interceptors=chain)
    add_servicer(servicer, server)
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
        if credentials is not None and not unix:
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        logger.info("gRPC listener %s: %s", address, "plaintext" if unix else tls.describe())
        if cfg.server.auth_tokens and not unix and credentials is None:
            logger.warning(
                "gRPC listener %s is plaintext: bearer tokens cross the network unencrypted", address
            )
        if port == 0:
            raise RuntimeError(f"cannot listen on {address}")
        if address.startswith("unix:"):
            addresses.append(address)
        else:
            host = address.rsplit(":", 1)[0]
            addresses.append(f"{host}:{port}")
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reaper = asyncio.get_running_loop().create_task(_reap(servicer, reap_interval))
    return RunningServer(server, servicer, health_servicer, addresses, cfg.server.grace_seconds, reaper)
