"""What every ``kvcoord`` command shares: exit statuses, one-line failures, the
connection options (target, token, timeout, TLS, --json) and output helpers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NoReturn, TypeVar

import click
import grpc
from google.protobuf import json_format

from .client import KVCoordClient
from .errors import KVCoordError, NotFoundError, PermissionDeniedError, UnavailableError
from .retry import RetryPolicy
from .tls import TLSOptions

__all__ = [
    "CLI_RETRY",
    "EXIT_CODES_HELP",
    "EXIT_FAILED_CHECK",
    "EXIT_NOT_FOUND",
    "EXIT_REFUSED",
    "EXIT_UNAUTHORIZED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "CliFailure",
    "Connection",
    "connection_options",
    "emit_json",
    "fail_from",
    "msg_dict",
    "one_line",
    "text_table",
    "tls_flags",
    "tls_from",
]

EXIT_FAILED_CHECK = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 6
EXIT_UNAUTHORIZED = 7
EXIT_NOT_FOUND = 8
EXIT_REFUSED = 9
#: Ctrl-C (SIGINT), as shells report a command it ended: 128 + 2
EXIT_INTERRUPTED = 130

EXIT_CODES_HELP = (
    "Exit status: 0 done; 1 the answer reports a problem (check violations, health not "
    "SERVING); 2 usage or an unreadable file; 6 server unreachable; 7 credential refused; "
    "8 pool unknown; 9 other refusal by the server; 130 interrupted (Ctrl-C). serve: 2 bad config, 3 cannot start "
    "(port in use, data directory), 4 journal write failed, 5 journal lost."
)

#: how often ``events --follow`` tries to resume a lost stream
FOLLOW_RETRY_SECONDS = 1.0

#: a few quick retries of read calls (a server restarting); never the default 30 s
CLI_RETRY = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=2.0, max_attempts=3)

_F = TypeVar("_F", bound=Callable[..., Any])


# -- errors ---------------------------------------------------------------------------


class CliFailure(click.ClickException):
    """One line on stderr and a documented exit status."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        click.echo(f"kvcoord: {self.format_message()}", err=True)


def _exit_for(err: KVCoordError) -> tuple[int, str]:
    if isinstance(err, UnavailableError) or err.code in (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ):
        return EXIT_UNREACHABLE, "server unreachable"
    if isinstance(err, PermissionDeniedError):
        if err.code == grpc.StatusCode.UNAUTHENTICATED:
            return EXIT_UNAUTHORIZED, "credential refused"
        return EXIT_UNAUTHORIZED, "permission denied"
    if isinstance(err, NotFoundError):
        return EXIT_NOT_FOUND, "not found"
    if err.code == grpc.StatusCode.UNIMPLEMENTED:
        return EXIT_REFUSED, "the server is older than this command"
    return EXIT_REFUSED, "refused"


def one_line(text: str) -> str:
    return " ".join(text.split())


def fail_from(err: KVCoordError, target: str) -> NoReturn:
    code, what = _exit_for(err)
    raise CliFailure(f"{what} ({target}): {one_line(err.message) or err.code.name}", code) from None


# -- connection options -------------------------------------------------------------


@dataclasses.dataclass
class Connection:
    """What every client command connects with (from the shared options)."""

    target: str
    token: str | None
    timeout: float
    tls: TLSOptions | None
    as_json: bool
    cluster: str = ""

    def open(self, **kw: Any) -> KVCoordClient:
        """A client of the target (``kw``: more of its arguments); a bad TLS file or
        cluster name is a usage failure."""
        try:
            return KVCoordClient(
                self.target, timeout=self.timeout, token=self.token, tls=self.tls, cluster=self.cluster, **kw
            )
        except ValueError as exc:
            raise CliFailure(str(exc), EXIT_USAGE) from None

    def show(self, value: Any, text: str) -> None:
        """A command's answer, the one printer: ``value`` as JSON with --json, else ``text``."""
        if self.as_json:
            emit_json(value)
        else:
            click.echo(text)

    @contextmanager
    def client(self) -> Iterator[KVCoordClient]:
        """A client; a server error inside becomes a one-line failure."""
        try:
            with self.open(retry=CLI_RETRY) as c:
                yield c
        except KVCoordError as err:
            fail_from(err, self.target)


def tls_from(
    tls: bool, ca: str | None, cert: str | None, key: str | None, name: str | None
) -> TLSOptions | None:
    if not (tls or ca or cert or key or name):
        return None
    return TLSOptions(ca_file=ca, cert_file=cert, key_file=key, server_name_override=name)


def tls_flags() -> list[Callable[[_F], _F]]:
    """--tls, --tls-ca, --tls-cert, --tls-key and --tls-server-name (:func:`tls_from`
    turns them into :class:`TLSOptions`)."""
    return [
        click.option("--tls", is_flag=True, help="use TLS, verifying the server with the system roots"),
        click.option("--tls-ca", metavar="FILE", help="PEM CA certificates that verify the server"),
        click.option("--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS"),
        click.option("--tls-key", metavar="FILE", help="unencrypted PEM key of --tls-cert"),
        click.option("--tls-server-name", metavar="NAME", help="verify the server certificate for NAME"),
    ]


def connection_options(default_timeout: float = 5.0) -> Callable[[_F], _F]:
    """--target, --token, --timeout, the TLS flags and --json on a command; the
    command receives them as one ``conn`` argument."""

    def decorate(func: _F) -> _F:
        options = [
            click.option(
                "--target",
                default="127.0.0.1:50051",
                show_default=True,
                envvar="KVCOORD_TARGET",
                metavar="HOST:PORT",
                help=(
                    "the server (host:port or unix:/path), or a cluster's replicas (comma-separated, "
                    "or a DNS name resolving to them); env KVCOORD_TARGET"
                ),
            ),
            click.option(
                "--cluster",
                default="",
                envvar="KVCOORD_CLUSTER",
                metavar="NAME",
                help=(
                    "the [cluster] name of the replicas --target names: a server of another cluster, or "
                    "of none, at one of those addresses refuses every call; env KVCOORD_CLUSTER"
                ),
            ),
            click.option(
                "--token",
                envvar="KVCOORD_TOKEN",
                help="bearer token, when the server sets auth_tokens; env KVCOORD_TOKEN",
            ),
            click.option(
                "--timeout",
                type=float,
                default=default_timeout,
                show_default=True,
                help="deadline per RPC in seconds",
            ),
            *tls_flags(),
            click.option("--json", "as_json", is_flag=True, help="machine-readable JSON output"),
        ]

        def wrapper(**kw: Any) -> Any:
            try:
                tls = tls_from(
                    *(kw.pop(k) for k in ("tls", "tls_ca", "tls_cert", "tls_key", "tls_server_name"))
                )
            except ValueError as exc:
                raise CliFailure(str(exc), EXIT_USAGE) from None
            conn = Connection(
                kw.pop("target"),
                kw.pop("token"),
                kw.pop("timeout"),
                tls,
                kw.pop("as_json"),
                kw.pop("cluster"),
            )
            return func(conn=conn, **kw)

        wrapper.__name__ = func.__name__
        wrapper.__doc__ = func.__doc__
        out: Any = wrapper
        for opt in reversed(options):
            out = opt(out)
        return out  # type: ignore[no-any-return]

    return decorate


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def msg_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """The first ``left`` columns left-aligned, the rest (numbers) right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])
