"""The operator commands of ``kvcoord``: status, pools, events, score and health.

They talk to a server through :class:`KVCoordClient` only, so these modules need the
client library and click, never the server's modules. This one assembles the
``kvcoord`` group; the commands live by group in ``cli_pools`` (status, pools,
sessions) and ``cli_observe`` (events, score, health), what they share in
``cli_common`` (exit statuses, failures, connection options, output). Installed distributions add
commands through the entry-point group ``kvcoord.commands`` (:class:`CommandGroup`):
the server's ``serve``, the trace replayer's ``conformance``.

Exit statuses (the ``EXIT_*`` constants; ``kvcoord --help`` lists them):

=== =======================================================================
0   done
1   the answer reports a problem (check found violations, health not SERVING)
2   usage: a bad option, an unreadable file (prompt, state, TLS, config)
6   the server is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED)
7   the credential was refused (UNAUTHENTICATED, PERMISSION_DENIED)
8   the pool (or another named thing) is unknown (NOT_FOUND)
9   any other refusal by the server (INVALID_ARGUMENT, ALREADY_EXISTS, ...)
130 interrupted by Ctrl-C (SIGINT); ``events --follow`` ends so, after its summary
=== =======================================================================

``kvcoord serve`` keeps its own (2 config, 3 cannot start: a port that cannot be
bound included, 4 journal write failed, 5 journal lost).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from importlib import metadata
from typing import Any

import click

from .cli_common import EXIT_CODES_HELP, EXIT_INTERRUPTED, EXIT_USAGE, CliFailure
from .cli_observe import events, health, score
from .cli_pools import pools, sessions, status

__all__ = ["COMMANDS_GROUP", "CommandGroup", "cli", "client_commands", "main", "run"]


def _version() -> str:
    try:
        return metadata.version("kvcoord")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0+source"


# -- the group ------------------------------------------------------------------------

#: the commands that need only the client library
client_commands: list[click.Command] = [status, pools, sessions, events, score, health]

#: The entry-point group through which installed distributions add commands to
#: ``kvcoord``: the server's ``serve`` (kvcoord), the trace replayer's ``conformance``
#: (kvcoord-client). Each names a click command, ``name = "module:attribute"``.
COMMANDS_GROUP = "kvcoord.commands"


class CommandGroup(click.Group):
    """The client's commands plus those :data:`COMMANDS_GROUP` names, each imported
    only when it runs (help lists them without importing them). A built-in command
    keeps its name; an entry point that cannot be loaded fails loudly when called."""

    def __init__(
        self, *args: Any, entry_points: Sequence[metadata.EntryPoint] | None = None, **kw: Any
    ) -> None:
        super().__init__(*args, **kw)
        self._entry_points = entry_points

    def discovered(self) -> dict[str, metadata.EntryPoint]:
        """The added commands by name (read from installed distributions once)."""
        if self._entry_points is None:
            self._entry_points = list(metadata.entry_points(group=COMMANDS_GROUP))
        return {ep.name: ep for ep in self._entry_points if ep.name not in self.commands}

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *self.discovered()})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        command = self.commands.get(cmd_name)
        if command is not None:
            return command
        ep = self.discovered().get(cmd_name)
        if ep is None:
            return None
        try:
            loaded = ep.load()
        except Exception as exc:  # noqa: BLE001 - named, never swallowed
            raise CliFailure(
                f"command {cmd_name!r} ({ep.value}) cannot be loaded: {exc}", EXIT_USAGE
            ) from exc
        if not isinstance(loaded, click.Command):
            raise CliFailure(f"command {cmd_name!r} ({ep.value}) is not a click command", EXIT_USAGE)
        return loaded

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """The built-in commands with their help; the added ones with where they come
        from (listing them imports nothing)."""
        found = self.discovered()
        rows = []
        for name in self.list_commands(ctx):
            command = self.commands.get(name)
            if command is None:
                ep = found[name]
                origin = ep.dist.name if ep.dist is not None else ep.value
                rows.append((name, f"(from {origin}: kvcoord {name} --help)"))
            elif not command.hidden:
                rows.append((name, command.get_short_help_str(formatter.width - 6 - len(name))))
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(
    cls=CommandGroup, epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(_version(), prog_name="kvcoord")
def cli() -> None:
    """kvcoord: a remote KV-cache block allocator, and the commands that operate it.

    Shell completion (bash, zsh, fish): eval "$(_KVCOORD_COMPLETE=bash_source kvcoord)".
    """


for _cmd in client_commands:
    cli.add_command(_cmd)


def run(group: click.Command, argv: Sequence[str] | None = None, prog_name: str = "kvcoord") -> int:
    """Run ``group`` and return its exit status (never raises SystemExit; click's own
    usage errors print their message and give 2)."""
    try:
        rv = group.main(
            args=list(argv) if argv is not None else None, prog_name=prog_name, standalone_mode=False
        )
    except click.exceptions.Abort as exc:
        if isinstance(exc.__cause__, KeyboardInterrupt):  # click's word for Ctrl-C
            click.echo("kvcoord: interrupted", err=True)
            return EXIT_INTERRUPTED
        click.echo("kvcoord: aborted", err=True)
        return 1
    except KeyboardInterrupt:  # Ctrl-C outside the command (click's own code)
        click.echo("kvcoord: interrupted", err=True)
        return EXIT_INTERRUPTED
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BrokenPipeError:
        return 0
    return rv if isinstance(rv, int) else 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvcoord`` console script; returns the exit status. Commands
    of other distributions are imported only when they run."""
    return run(cli, argv)


if __name__ == "__main__":
    sys.exit(main())
