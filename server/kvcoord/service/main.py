"""`kvcoord serve`: run the server until SIGTERM/SIGINT, then shut down gracefully."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import signal
import sys

from .config import ConfigFileError, ServerConfig, default_config_text, load_config
from .journal import JournalError
from .lease_marker import MarkerError
from .logs import LIFECYCLE, AccessLogInterceptor, configure, ids
from .server import ClusterError, ListenError, start_server
from .startup import DataDirError, JournalLostError

__all__ = ["EXIT_CANNOT_START", "EXIT_JOURNAL_FAILED", "EXIT_JOURNAL_LOST", "run", "serve_from_cli"]

logger = logging.getLogger("kvcoord")
lifecycle = logging.getLogger(LIFECYCLE)

#: Exit status when the journal, the lease marker or the data directory cannot be used
#: at start (the message names the file).
EXIT_CANNOT_START = 3
#: Exit status after a journal or lease-marker write failed while serving (disk full,
#: I/O error), or a journal commit or lease marker write did not return within
#: server.journal_stall_seconds (a hung disk): the process stops so that its supervisor
#: restarts it from the committed journal.
EXIT_JOURNAL_FAILED = 4
#: Exit status when the journal is missing or empty while journal.progress names
#: committed records: restore the data directory, or start once with --start-empty.
EXIT_JOURNAL_LOST = 5
#: At most this long (and at most grace_seconds) for in-flight calls after such a failure.
JOURNAL_FAILURE_DRAIN_SECONDS = 2.0


async def run(cfg: ServerConfig, start_empty: bool = False, restored: bool = False) -> int:
    """Serve until a termination signal or a journal write failure; returns the exit status
    (0 after a clean stop, :data:`EXIT_JOURNAL_FAILED` after a failed journal write)."""
    from .metrics import Metrics

    metrics = Metrics()
    running = await start_server(
        cfg,
        observer=metrics,
        interceptors=[metrics.interceptor(), *([AccessLogInterceptor()] if cfg.server.access_log else [])],
        start_empty=start_empty,
        restored=restored,
    )
    metrics.bind(running.servicer, asyncio.get_running_loop())
    journal = getattr(running.servicer.registry.recorder, "journal", None)
    if journal is not None:  # durability "journal": its commit latency is exported
        journal.on_commit_seconds.append(metrics.journal_committed)
    metrics_addr = ""
    if cfg.server.metrics_listen:
        try:
            metrics_addr = metrics.start_http(cfg.server.metrics_listen, cfg.server.metrics_tls)
        except OSError as exc:
            await running.stop(0, snapshot=False)
            raise ListenError(
                f"cannot serve metrics on {cfg.server.metrics_listen}: {exc.strerror or exc}"
            ) from None
    pool_names = sorted(running.servicer.registry.pools)
    pools = ", ".join(pool_names) or "none"
    st = cfg.server
    if st.journaled:
        rec = running.recovery
        found = (
            f"recovered {rec.snapshot_seq + rec.records} journaled operations"
            if rec and rec.recovered
            else "new"
        )
        if rec and rec.restored:
            found += (
                f"; behind what clients were told ({rec.restored}): sessions fenced, grace period applies"
            )
        lifecycle.info(
            "kvcoord data directory %s (durability journal, synchronous %s; %s)",
            st.data_dir,
            st.synchronous,
            found,
            extra=ids(data_dir=st.data_dir, durability="journal", synchronous=st.synchronous),
        )
    else:
        lifecycle.info(
            "kvcoord durability none: a restart loses every pool and allocation", extra=ids(durability="none")
        )
    startup = running.startup
    if startup is not None and startup.grace_until > startup.clock():
        left = startup.grace_until - startup.clock()
        lifecycle.info(
            "kvcoord grace period: no block is handed out for %.1f s (%s)",
            left,
            startup.reason or "leases of an earlier instance",
            extra=ids(grace_seconds=round(left, 1)),
        )
    # tests and client.testing find the port a server bound (listen port 0) in this line
    lifecycle.info(
        "kvcoord serving gRPC on %s; pools: %s; %s",
        ", ".join(running.addresses),
        pools,
        cfg.server.tls.describe(),
        extra=ids(grpc=list(running.addresses), pools=pool_names, tls=cfg.server.tls.describe()),
    )
    if metrics_addr:
        scheme = "https" if cfg.server.metrics_tls.enabled else "http"
        url = f"{scheme}://{metrics_addr}/metrics"
        lifecycle.info(
            "kvcoord metrics on %s (%s)",
            url,
            cfg.server.metrics_tls.describe(),
            extra=ids(metrics=url, tls=cfg.server.metrics_tls.describe()),
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waits = [loop.create_task(stop.wait()), loop.create_task(running.journal_failed.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if running.journal_failed.is_set():
        # Health is NOT_SERVING and every call is refused: let in-flight calls get
        # their UNAVAILABLE, then exit non-zero so the supervisor restarts the server.
        drain = min(cfg.server.grace_seconds, JOURNAL_FAILURE_DRAIN_SECONDS)
        logger.critical("journal write failed: stopping (drain %.1fs), exit %d", drain, EXIT_JOURNAL_FAILED)
        await running.stop(drain)
        metrics.stop_http()
        lifecycle.info(
            "kvcoord stopped: the journal or lease marker cannot be written (exit %d)",
            EXIT_JOURNAL_FAILED,
            extra=ids(exit=EXIT_JOURNAL_FAILED),
        )
        marker = running.startup.marker if running.startup is not None else None
        if (journal is not None and journal.hung) or (marker is not None and marker.hung):
            _exit_now(EXIT_JOURNAL_FAILED)
        return EXIT_JOURNAL_FAILED
    logger.info("shutting down (grace %.1fs)", cfg.server.grace_seconds)
    await running.stop()
    metrics.stop_http()
    lifecycle.info("kvcoord stopped")
    return 0


def _exit_now(status: int) -> None:  # pragma: no cover - ends the process
    """End the process at once: a journal commit or lease marker write never returned,
    and a normal exit would wait for its writer thread (concurrent.futures joins it; the
    marker's threads are not daemons) for ever."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _supervise(cfg: ServerConfig, args: argparse.Namespace) -> int:
    """``kvcoord serve --replicas N`` (replicas.py)."""
    from .replicas import child_argv, replica_count, supervise

    try:
        count = replica_count(args.replicas)
    except ValueError as exc:
        print(f"kvcoord: --replicas: {exc}", file=sys.stderr)
        return 2
    if not cfg.cluster.enabled:
        print(
            "kvcoord: --replicas needs [cluster] endpoints (or KVCOORD_CLUSTER_ENDPOINTS): the replicas "
            "share their pools through the cluster store",
            file=sys.stderr,
        )
        return 2
    extra = [flag for flag, on in (("--start-empty", args.start_empty), ("--restored", args.restored)) if on]
    return supervise(cfg, count, child_argv(args.config or os.environ.get("KVCOORD_CONFIG"), extra))


def serve_from_cli(args: argparse.Namespace) -> int:
    """The ``kvcoord serve`` subcommand."""
    if args.print_default_config:
        sys.stdout.write(default_config_text())
        return 0
    try:
        cfg = load_config(args.config)
    except ConfigFileError as exc:
        print(f"kvcoord: {exc}", file=sys.stderr)
        return 2
    overrides: dict[str, object] = {}
    if args.listen:
        overrides["listen"] = tuple(args.listen)
    if args.metrics_listen is not None:
        overrides["metrics_listen"] = args.metrics_listen
    if overrides:
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **overrides))  # type: ignore[arg-type]
    if cfg.server.data_dir:
        data_dir = os.path.abspath(cfg.server.data_dir)
        cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, data_dir=data_dir))
    configure(cfg.server.log_level, cfg.server.log_format, cfg.server.access_log)
    if getattr(args, "replicas", None):
        return _supervise(cfg, args)
    try:
        return asyncio.run(
            run(
                cfg,
                start_empty=bool(getattr(args, "start_empty", False)),
                restored=bool(getattr(args, "restored", False)),
            )
        )
    except JournalLostError as exc:
        lifecycle.critical("kvcoord: cannot start: %s", exc)
        return EXIT_JOURNAL_LOST
    except (JournalError, MarkerError, DataDirError, ListenError, ClusterError) as exc:
        lifecycle.critical("kvcoord: cannot start: %s", exc)
        return EXIT_CANNOT_START
