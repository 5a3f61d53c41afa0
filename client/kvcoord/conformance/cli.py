"""``kvcoord conformance``: replay traces in-process or against a server.

The ``kvcoord`` console script finds this command through the entry-point group
``kvcoord.commands`` (kvcoord-client's pyproject.toml); ``python -m kvcoord.conformance``
runs it from a source tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
from kvcoord.client.cli import run
from kvcoord.client.cli_common import EXIT_USAGE, CliFailure, tls_flags, tls_from

from .replay import replay
from .target import LocalTarget
from .trace import TraceFormatError, load_trace

__all__ = ["conformance", "main"]


def _tls_options(func: Any) -> Any:
    for opt in reversed(tls_flags()):
        func = opt(func)
    return func


@click.command()
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
    try:
        options = tls_from(tls, tls_ca, tls_cert, tls_key, tls_server_name)
    except ValueError as exc:
        raise CliFailure(f"conformance: {exc}", EXIT_USAGE) from None
    target_factory: Any = LocalTarget
    if target:
        from .remote import RemoteTarget

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


def main(argv: Sequence[str] | None = None) -> int:
    """``kvcoord conformance`` alone (``python -m kvcoord.conformance FILE...``)."""
    return run(conformance, argv, prog_name="kvcoord conformance")
