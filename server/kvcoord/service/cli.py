"""``kvcoord serve``: the server's one command.

The ``kvcoord`` console script belongs to kvcoord-client (:mod:`kvcoord.client.cli`);
it finds ``serve`` through the entry-point group ``kvcoord.commands``, which this
distribution's pyproject.toml fills, so nothing here imports the client.
``python -m kvcoord.service.cli serve`` runs it from a source tree.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import click

__all__ = ["main", "serve"]


@click.command()
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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def _server_commands() -> None:
    """kvcoord's server commands (the `kvcoord` command of kvcoord-client has them all)."""


_server_commands.add_command(serve)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvcoord.service.cli serve ...``; returns the exit status."""
    try:
        _server_commands.main(args=list(argv) if argv is not None else None, prog_name="kvcoord")
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
