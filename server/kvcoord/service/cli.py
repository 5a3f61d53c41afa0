"""The ``kvcoord`` command: the client's operator commands (:mod:`kvcoord.client.cli`:
status, pools, events, score, health) plus ``serve`` and ``conformance``, which need
the server's modules (imported only when they run)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import click
from kvcoord.client.cli import EXIT_USAGE, CliFailure, _tls_from, cli, run

__all__ = ["cli", "main"]


def _tls_options(func: Any) -> Any:
    for opt in reversed(
        [
            click.option("--tls", is_flag=True, help="use TLS, verifying the server with the system roots"),
            click.option("--tls-ca", metavar="FILE", help="PEM CA certificates that verify the server"),
            click.option("--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS"),
            click.option("--tls-key", metavar="FILE", help="unencrypted PEM key of --tls-cert"),
            click.option("--tls-server-name", metavar="NAME", help="verify the server certificate for NAME"),
        ]
    ):
        func = opt(func)
    return func


@cli.command()
@click.argument("files", nargs=-1, required=True, metavar="FILE...")
@click.option("--target", metavar="HOST:PORT", help="replay through the gRPC client against a server")
@click.option("--token", help="bearer token for the server, if it requires one")
@click.option("--timeout", type=float, default=10.0, show_default=True, help="deadline per RPC in seconds")
@_tls_options
def conformance(
    files: tuple[str, ...],
    target: str | None,
    token: str | None,
    timeout: float,
    tls: bool,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    tls_server_name: str | None,
) -> None:
    """Replay vLLM conformance traces and compare every answer.

    Each trace (.jsonl) runs against a fresh pool (in-process by default, or a server
    with --target); one line per trace and a closing 'N passed, M failed' line. Exits 1
    on any failure.
    """
    from kvcoord.conformance import LocalTarget, TraceFormatError, load_trace, replay

    try:
        options = _tls_from(tls, tls_ca, tls_cert, tls_key, tls_server_name)
    except ValueError as exc:
        raise CliFailure(f"conformance: {exc}", EXIT_USAGE) from None
    target_factory: Any = LocalTarget
    if target:
        from kvcoord.conformance.remote import RemoteTarget

        def target_factory() -> RemoteTarget:
            return RemoteTarget(target, token=token, timeout=timeout, tls=options)

    passed = failed = 0
    for path in files:
        try:
            trace = load_trace(path)
        except (OSError, TraceFormatError) as exc:
            click.echo(f"FAIL {path}: cannot read trace: {exc}")
            failed += 1
            continue
        result = replay(trace, target_factory())
        if result.passed:
            passed += 1
            click.echo(f"PASS {trace.name} ({result.ops} ops)")
        else:
            failed += 1
            click.echo(f"FAIL {trace.name}: {result.mismatch}")
    click.echo(f"{passed} passed, {failed} failed")
    raise SystemExit(0 if failed == 0 and passed > 0 else 1)


@cli.command()
@click.option("--config", metavar="FILE", help="TOML config file (default: the embedded default)")
@click.option(
    "--listen", multiple=True, metavar="ADDR", help="override listeners (host:port or unix:/path); repeatable"
)
@click.option(
    "--metrics-listen", metavar="HOST:PORT", help="override the Prometheus /metrics address ('' disables)"
)
@click.option(
    "--start-empty",
    is_flag=True,
    help=(
        "accept a lost journal (missing or empty while journal.progress names committed records): "
        "move the evidence aside, start empty and hand out no block for max_session_lease_seconds"
    ),
)
@click.option(
    "--restored",
    is_flag=True,
    help=(
        "the data directory was restored from a copy (a volume snapshot, cp -a): end every "
        "session and fence it holds, empty the prefix caches and hand out no block for "
        "max_session_lease_seconds (a grace that survives restarts)"
    ),
)
@click.option(
    "--replicas",
    metavar="N",
    help=(
        "run N replica processes of one cluster on this host ('0' or 'auto': one per core), "
        "supervised; each listens on the configured port plus its index and keeps its own data "
        "directory (<data_dir>/replica-<i>). Needs [cluster] (the etcd endpoints)"
    ),
)
@click.option("--print-default-config", is_flag=True, help="print the embedded default config and exit")
def serve(**options: Any) -> None:
    """Run the kvcoord gRPC server until SIGTERM or SIGINT.

    Exit status: 0 after a clean stop; 2 a bad config; 3 cannot start (a port that
    cannot be bound, the data directory, the journal); 4 a journal write failed while
    serving; 5 the journal is lost (see --start-empty).
    """
    from kvcoord.service.main import serve_from_cli

    options["listen"] = list(options["listen"]) or None
    raise SystemExit(serve_from_cli(argparse.Namespace(**options)))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcoord`` console script; returns the exit status."""
    return run(cli, argv)


if __name__ == "__main__":
    sys.exit(main())
