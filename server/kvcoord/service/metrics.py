"""Prometheus metrics: pool gauges and counters read at scrape time, gRPC server series
from an interceptor, and the /metrics HTTP endpoint. prometheus-client lives only here.

Every metric is listed in docs/metrics.md with its vLLM counterpart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import platform
import socket
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import grpc
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    make_wsgi_app,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from .handover_parts import REASONS as HANDOVER_REASONS
from .intercept import WrappedHandlers, observed, status_name
from .lease_clock import LeaseClock
from .observers import NullObserver
from .pool_service import PoolService
from .tls import TLSFiles

if TYPE_CHECKING:
    from .servicer import AllocatorServicer

__all__ = ["LATENCY_BUCKETS", "Metrics"]

VERSION = "0.1.0"

#: The event streams a reader can be told of a gap on: WatchEvents, and the events a
#: Step with include_state takes for its session.
EVENT_STREAMS = ("watch", "step", "zmq")

#: Fine enough for sub-millisecond unary calls, up to 10 s for long streams.
LATENCY_BUCKETS = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.0075,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class _PoolCollector(Collector):
    """Reads every pool's engine counters at scrape time (no cost on the hot path)."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        """Read on the server's event loop, so a scrape sees one consistent state
        (the HTTP thread never walks tables the loop is changing)."""
        loop = self.metrics.loop
        if loop is None or not loop.is_running() or _on_loop(loop):
            yield from self._families()
            return
        try:
            families = asyncio.run_coroutine_threadsafe(self._read(), loop).result(timeout=10)
        except (TimeoutError, concurrent.futures.TimeoutError, RuntimeError):
            return  # the loop is stuck or stopping: export nothing rather than a torn view
        yield from families

    async def _read(self) -> list[Any]:
        servicer = self.metrics.servicer
        if servicer is not None:  # never half a Step applied in slices (pool_locks.py)
            await servicer.registry.locks.wait_all()
        return list(self._families())

    def _families(self) -> Iterator[Any]:
        """Pool counters carry the pool's creation time as ``_created``: a pool deleted
        and created again under the same name starts at 0 with a new one."""
        servicer = self.metrics.servicer
        pools = sorted(servicer.registry.pools.values(), key=lambda h: h.name) if servicer else []
        usage = GaugeMetricFamily(
            "kvcoord_kv_cache_usage_ratio", "Fraction of usable KV blocks in use (0..1).", labels=["pool"]
        )
        free = GaugeMetricFamily(
            "kvcoord_blocks_free", "Free KV blocks (cached-but-unreferenced count as free).", labels=["pool"]
        )
        total = GaugeMetricFamily(
            "kvcoord_blocks_usable", "Usable KV blocks (num_blocks - 1).", labels=["pool"]
        )
        live = GaugeMetricFamily("kvcoord_requests", "Requests the pool tracks.", labels=["pool"])
        sessions = GaugeMetricFamily("kvcoord_attached_clients", "Live client sessions.", labels=["pool"])
        lookups = CounterMetricFamily(
            "kvcoord_prefix_cache_lookups", "Prefix-cache lookups.", labels=["pool"]
        )
        queries = CounterMetricFamily(
            "kvcoord_prefix_cache_queries_tokens",
            "Tokens of requests looked up in the prefix cache.",
            labels=["pool"],
        )
        hits = CounterMetricFamily(
            "kvcoord_prefix_cache_hits_tokens", "Tokens found in the prefix cache.", labels=["pool"]
        )
        group_hits = CounterMetricFamily(
            "kvcoord_prefix_cache_group_hits_tokens",
            "Tokens each KV cache group's hit covered (hybrid pools).",
            labels=["pool", "group", "type"],
        )
        short = CounterMetricFamily(
            "kvcoord_prefix_cache_short_lookups",
            "Lookups too short for any hit (fewer tokens than one aligned block).",
            labels=["pool"],
        )
        evictions = CounterMetricFamily(
            "kvcoord_block_evictions",
            "Cached blocks that lost their hash (reused or evicted).",
            labels=["pool"],
        )
        refusals = CounterMetricFamily(
            "kvcoord_allocation_refusals",
            "allocate_slots calls refused for lack of free blocks.",
            labels=["pool"],
        )
        allocated = CounterMetricFamily(
            "kvcoord_blocks_allocated", "Blocks taken from the free queue.", labels=["pool"]
        )
        freed = CounterMetricFamily(
            "kvcoord_blocks_freed", "Blocks returned to the free queue.", labels=["pool"]
        )
        events = CounterMetricFamily("kvcoord_kv_events_published", "KV events published.", labels=["pool"])
        owned = GaugeMetricFamily(
            "kvcoord_pool_owned",
            "1 when this replica serves the pool (holds its ownership claim), 0 while it holds its state "
            "without serving it (handing it over); replica is the cluster replica id (empty on a single node).",
            labels=["pool", "replica"],
        )
        placement = servicer.registry.placement if servicer is not None else None
        reservations = _reservation_families()
        session_counts: dict[str, int] = {}
        if servicer is not None:
            for s in servicer.registry.sessions.sessions.values():
                session_counts[s.pool] = session_counts.get(s.pool, 0) + 1
        for h in pools:
            c = h.counters()
            n = [h.name]
            usage.add_metric(n, c.usage)
            free.add_metric(n, c.num_free_blocks)
            total.add_metric(n, h.config.num_blocks - 1)
            live.add_metric(n, c.num_requests)
            sessions.add_metric(n, session_counts.get(h.name, 0))
            lookups.add_metric(n, c.lookups, created=h.created_at)
            queries.add_metric(n, c.queries, created=h.created_at)
            hits.add_metric(n, c.hits, created=h.created_at)
            short.add_metric(n, c.short_lookups, created=h.created_at)
            for g, tokens in enumerate(c.group_hit_tokens):
                group_hits.add_metric(
                    [h.name, str(g), type(h.config.groups[g]).__name__], tokens, created=h.created_at
                )
            evictions.add_metric(n, c.evictions, created=h.created_at)
            refusals.add_metric(n, c.refusals, created=h.created_at)
            allocated.add_metric(n, c.allocated, created=h.created_at)
            freed.add_metric(n, c.freed, created=h.created_at)
            events.add_metric(n, h.events.last_sequence, created=h.created_at)
            if placement is not None:
                owned.add_metric([h.name, placement.replica_id], 1 if placement.serves(h.name) else 0)
            _add_reservations(reservations, h)
        yield from (usage, free, total, live, sessions, lookups, queries, hits, group_hits, short, evictions,
                    refusals, allocated, freed, events, owned)  # fmt: skip
        yield from reservations.values()
        # a cluster replica's failed handovers; a single node's zeros (it hands nothing over,
        # and a dashboard's query finds the series everywhere)
        handovers = getattr(getattr(placement, "cluster", None), "handovers", None)
        failed = CounterMetricFamily(
            "kvcoord_handovers_failed",
            "Handovers of a pool from this replica that failed (the pool stays here), by why: peer_release "
            "(the peer's earlier release takes no state in parts and this one does not fit a message), "
            "peer_limit (the peer refused it RESOURCE_EXHAUSTED), other.",
            labels=["reason"],
        )
        counts = handovers.failures if handovers is not None else dict.fromkeys(HANDOVER_REASONS, 0)
        for reason, failures in counts.items():
            failed.add_metric([reason], failures)
        yield failed
        clock = servicer.registry.sessions.clock if servicer is not None else None
        if isinstance(clock, LeaseClock):  # (its counts are read, not the clock: no read is a gap)
            yield CounterMetricFamily(
                "kvcoord_server_pauses",
                "Times the server did not run for over the lease clock's gap (0.5 s): a stopped process or VM, "
                "or its event loop held; leases, reservations and kept answers were not counted down meanwhile.",
                value=clock.pauses,
            )
            yield CounterMetricFamily(
                "kvcoord_server_paused_seconds",
                "Seconds of those pauses left out of leases, reservations and kept answers.",
                value=clock.paused,
            )


def _reservation_families() -> dict[str, Any]:
    """ScorePools reservations (score and reserve): live, their ends, promised vs got."""
    return {
        "live": GaugeMetricFamily(
            "kvcoord_reservations", "Prefix hits held against eviction for a router.", labels=["pool"]
        ),
        "made": CounterMetricFamily("kvcoord_reservations_made", "Reservations made.", labels=["pool"]),
        "adopted": CounterMetricFamily(
            "kvcoord_reservations_adopted",
            "Reservations ended by a request's first allocation.",
            labels=["pool"],
        ),
        "released": CounterMetricFamily(
            "kvcoord_reservations_expired", "Reservations ended by their time running out.", labels=["pool"]
        ),
        "promised_tokens": CounterMetricFamily(
            "kvcoord_reservation_promised_tokens",
            "Hit tokens adopted reservations promised.",
            labels=["pool"],
        ),
        "got_tokens": CounterMetricFamily(
            "kvcoord_reservation_got_tokens",
            "Hit tokens the requests that adopted a reservation got.",
            labels=["pool"],
        ),
        "short_hits": CounterMetricFamily(
            "kvcoord_reservation_short_hits",
            "Adopted reservations whose request got a shorter hit than promised.",
            labels=["pool"],
        ),
    }


def _add_reservations(families: dict[str, Any], service: PoolService) -> None:
    r = service.reservations
    n = [service.name]
    families["live"].add_metric(n, len(r.live))
    c = r.counters
    for key, family in families.items():
        if key != "live":
            family.add_metric(n, getattr(c, key), created=service.created_at)


#: A scraper must finish the TLS handshake and send its request within this many seconds.
TLS_HANDSHAKE_SECONDS = 10.0


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class _HTTPSServer(ThreadingWSGIServer):
    """/metrics over HTTPS, handshaking in each connection's own thread with a deadline.

    prometheus-client's ``start_http_server`` wraps the listening socket, so its accept
    loop runs every handshake: one peer that connects and sends nothing stalls all
    scrapes. Here the accept loop only accepts.
    """

    ssl_context: ssl.SSLContext

    def finish_request(self, request: Any, client_address: Any) -> None:
        request.settimeout(TLS_HANDSHAKE_SECONDS)
        try:
            conn = self.ssl_context.wrap_socket(request, server_side=True)
        except OSError:  # a failed or stalled handshake (ssl.SSLError, TimeoutError) ends here
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def _start_https(address: tuple[str, int], tls: TLSFiles, registry: CollectorRegistry) -> ThreadingWSGIServer:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.mutual:
        ctx.load_verify_locations(tls.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED
    host, port = address
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class Server(_HTTPSServer):
        address_family = family

    Server.ssl_context = ctx
    server = make_server(host, port, make_wsgi_app(registry), Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="kvcoord-metrics", daemon=True).start()
    return server


class _RpcInterceptor(grpc.aio.ServerInterceptor):
    """The standard gRPC server series, per method and status code."""

    def __init__(self, metrics: Metrics) -> None:
        self.m = metrics
        self._wrapped = WrappedHandlers()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None:
            return handler
        return self._wrapped.get(details.method, handler, lambda: self._wrap(details.method, handler))

    def _wrap(self, path: str, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """``handler`` counted under its method's series (their children resolved once
        per method and kind; per status code as each first occurs)."""
        service, _, method = path.lstrip("/").partition("/")
        m = self.m
        started: dict[str, Any] = {}
        latency: dict[str, Any] = {}
        handled: dict[tuple[str, str], Any] = {}

        def begin(kind: str) -> None:
            child = started.get(kind)
            if child is None:
                child = started[kind] = m.started.labels(service, method, kind)
            child.inc()

        def end(kind: str, _request: Any, context: grpc.aio.ServicerContext, ok: bool, t0: float) -> None:
            code = status_name(context, ok)
            child = handled.get((kind, code))
            if child is None:
                child = handled[(kind, code)] = m.handled.labels(service, method, kind, code)
            child.inc()
            timer = latency.get(kind)
            if timer is None:
                timer = latency[kind] = m.latency.labels(service, method, kind)
            timer.observe(time.perf_counter() - t0)

        return observed(handler, begin, end)


class Metrics(NullObserver):
    """kvcoord's Prometheus registry; also the servicer's operation observer."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.servicer: AllocatorServicer | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.started = Counter(
            "grpc_server_started", "RPCs started on the server.", ["grpc_service", "grpc_method", "grpc_type"],
            registry=self.registry,
        )  # fmt: skip
        self.handled = Counter(
            "grpc_server_handled", "RPCs completed on the server, by status code.",
            ["grpc_service", "grpc_method", "grpc_type", "grpc_code"], registry=self.registry,
        )  # fmt: skip
        self.latency = Histogram(
            "grpc_server_handling_seconds", "Time to handle an RPC, until its last response.",
            ["grpc_service", "grpc_method", "grpc_type"], buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.journal_commits = Histogram(
            "kvcoord_journal_commit_seconds",
            "Time to write and sync one group commit of journal records (what an acknowledged mutation waits for).",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.handshake_refusals = Counter(
            "kvcoord_hash_handshake_refusals", "Attach calls refused because the client hashes differently.",
            ["pool"], registry=self.registry,
        )  # fmt: skip
        self.sessions_expired = Counter(
            "kvcoord_sessions_expired", "Sessions whose lease ran out unrenewed (their requests were freed).",
            ["pool"], registry=self.registry,
        )  # fmt: skip
        self.step_engine = Histogram(
            "kvcoord_step_engine_seconds",
            "Time the engine took to apply one Step's operations (no gRPC, decoding, answer or journal commit).",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.step_operations = Counter(
            "kvcoord_step_operations", "Operations Step calls applied (a run's entries and an Admit's requests each count).",
            ["pool"], registry=self.registry,
        )  # fmt: skip
        self.event_gaps = Counter(
            "kvcoord_event_gaps",
            "KV event readers told of a gap: events dropped from the pool's buffer before they read them.",
            ["pool", "stream"], registry=self.registry,
        )  # fmt: skip
        #: step_operations' child per pool, resolved once (labels() per Step cost more
        #: than the count); dropped with the pool's series
        self._step_operations: dict[str, Any] = {}
        build = Gauge(
            "kvcoord_build_info",
            "Build information (always 1).",
            ["version", "python", "grpc"],
            registry=self.registry,
        )
        build.labels(VERSION, platform.python_version(), grpc.__version__).set(1)
        self.registry.register(_PoolCollector(self))
        # process_cpu_seconds_total, process_resident_memory_bytes, ...: every pool of a
        # replica runs on its one event loop, so its CPU is what saturates first
        ProcessCollector(registry=self.registry)
        self._http: Any = None

    def bind(self, servicer: AllocatorServicer, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Read ``servicer``'s pools, on ``loop`` (the server's) when scraped from another thread."""
        self.servicer = servicer
        self.loop = loop

    def interceptor(self) -> grpc.aio.ServerInterceptor:
        return _RpcInterceptor(self)

    def journal_committed(self, seconds: float) -> None:
        """A journal commit of records took ``seconds`` (Journal.on_commit_seconds)."""
        self.journal_commits.observe(seconds)

    # -- OperationObserver (the rest is inherited as no-ops) -------------------------
    def pool_created(self, service: PoolService) -> None:
        for counter in self._pool_counters():
            counter.labels(service.name)  # export the series at 0
        for stream in EVENT_STREAMS:
            self.event_gaps.labels(service.name, stream)

    def pool_deleted(self, service: PoolService) -> None:
        # A deleted pool's series go with it (the collector's are read live).
        self._step_operations.pop(service.name, None)
        for counter in self._pool_counters():
            with contextlib.suppress(KeyError):
                counter.remove(service.name)
        for stream in EVENT_STREAMS:
            with contextlib.suppress(KeyError):
                self.event_gaps.remove(service.name, stream)

    def _pool_counters(self) -> tuple[Counter, ...]:
        return (self.handshake_refusals, self.sessions_expired, self.step_operations)

    def handshake_refused(self, pool: str) -> None:
        self.handshake_refusals.labels(pool).inc()

    def session_expired(self, pool: str) -> None:
        self.sessions_expired.labels(pool).inc()

    def step_applied(self, pool: str, operations: int, seconds: float) -> None:
        child = self._step_operations.get(pool)
        if child is None:
            child = self._step_operations[pool] = self.step_operations.labels(pool)
        child.inc(operations)
        self.step_engine.observe(seconds)

    def events_gap(self, pool: str, stream: str) -> None:
        self.event_gaps.labels(pool, stream).inc()

    # -- HTTP ------------------------------------------------------------------------
    def start_http(self, address: str, tls: TLSFiles | None = None) -> str:
        """Serve /metrics on ``host:port`` (port 0 picks one); returns the bound address.

        With ``tls`` enabled the endpoint is HTTPS only, and with its client CA scrapers
        must present a certificate signed by it.
        """
        host, _, port = address.rpartition(":")
        host = host or "0.0.0.0"
        if tls is not None and tls.enabled:
            server: Any = _start_https((host, int(port)), tls, self.registry)
        else:
            server, _thread = start_http_server(int(port), addr=host, registry=self.registry)
        self._http = server
        return f"{host}:{server.server_port}"

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def _on_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
