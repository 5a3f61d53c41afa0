"""The operator commands of ``kvcoord``: status, pools, events, score and health.

They talk to a server through :class:`KVCoordClient` only, so this module needs the
client library and click, never the server's modules. Installed distributions add
commands through the entry-point group ``kvcoord.commands`` (:class:`CommandGroup`):
the server's ``serve``, the trace replayer's ``conformance``.

Exit statuses (the ``EXIT_*`` constants; ``kvcoord --help`` lists them):

== =======================================================================
0  done
1  the answer reports a problem (check found violations, health not SERVING)
2  usage: a bad option, an unreadable file (prompt, state, TLS, config)
6  the server is unreachable (UNAVAILABLE, DEADLINE_EXCEEDED)
7  the credential was refused (UNAUTHENTICATED, PERMISSION_DENIED)
8  the pool (or another named thing) is unknown (NOT_FOUND)
9  any other refusal by the server (INVALID_ARGUMENT, ALREADY_EXISTS, ...)
== =======================================================================

``kvcoord serve`` keeps its own (2 config, 3 cannot start: a port that cannot be
bound included, 4 journal write failed, 5 journal lost).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import click
import grpc
from google.protobuf import json_format
from kvcoord.engine import BlockRemoved, BlockStored
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import event_from_pb

from .client import KVCoordClient
from .errors import KVCoordError, NotFoundError, PermissionDeniedError, UnavailableError
from .retry import RetryPolicy
from .routing import PoolRouter
from .tls import TLSOptions

__all__ = [
    "EXIT_FAILED_CHECK",
    "EXIT_NOT_FOUND",
    "EXIT_REFUSED",
    "EXIT_UNAUTHORIZED",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "cli",
    "client_commands",
]

EXIT_FAILED_CHECK = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 6
EXIT_UNAUTHORIZED = 7
EXIT_NOT_FOUND = 8
EXIT_REFUSED = 9

EXIT_CODES_HELP = (
    "Exit status: 0 done; 1 the answer reports a problem (check violations, health not "
    "SERVING); 2 usage or an unreadable file; 6 server unreachable; 7 credential refused; "
    "8 pool unknown; 9 other refusal by the server. serve: 2 bad config, 3 cannot start "
    "(port in use, data directory), 4 journal write failed, 5 journal lost."
)

#: how often ``events --follow`` tries to resume a lost stream
FOLLOW_RETRY_SECONDS = 1.0

#: a few quick retries of read calls (a server restarting); never the default 30 s
CLI_RETRY = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=2.0, max_attempts=3)

_F = TypeVar("_F", bound=Callable[..., Any])


def _version() -> str:
    try:
        return metadata.version("kvcoord")
    except metadata.PackageNotFoundError:  # run from a source tree
        return "0.1.0+source"


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


def _one_line(text: str) -> str:
    return " ".join(text.split())


def fail_from(err: KVCoordError, target: str) -> NoReturn:
    code, what = _exit_for(err)
    raise CliFailure(f"{what} ({target}): {_one_line(err.message) or err.code.name}", code) from None


# -- connection options -------------------------------------------------------------


@dataclasses.dataclass
class Connection:
    """What every client command connects with (from the shared options)."""

    target: str
    token: str | None
    timeout: float
    tls: TLSOptions | None
    as_json: bool

    @contextmanager
    def client(self) -> Iterator[KVCoordClient]:
        """A client; a server error inside becomes a one-line failure."""
        try:
            c = KVCoordClient(
                self.target, timeout=self.timeout, token=self.token, tls=self.tls, retry=CLI_RETRY
            )
        except ValueError as exc:
            raise CliFailure(str(exc), EXIT_USAGE) from None
        try:
            with c:
                yield c
        except KVCoordError as err:
            fail_from(err, self.target)


def _tls_from(
    tls: bool, ca: str | None, cert: str | None, key: str | None, name: str | None
) -> TLSOptions | None:
    if not (tls or ca or cert or key or name):
        return None
    return TLSOptions(ca_file=ca, cert_file=cert, key_file=key, server_name_override=name)


def tls_flags() -> list[Callable[[_F], _F]]:
    """--tls, --tls-ca, --tls-cert, --tls-key and --tls-server-name (:func:`_tls_from`
    turns them into :class:`TLSOptions`)."""
    return [
        click.option("--tls", is_flag=True, help="use TLS, verifying the server with the system roots"),
        click.option("--tls-ca", metavar="FILE", help="PEM CA certificates that verify the server"),
        click.option("--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS"),
        click.option("--tls-key", metavar="FILE", help="unencrypted PEM key of --tls-cert"),
        click.option("--tls-server-name", metavar="NAME", help="verify the server certificate for NAME"),
    ]


def connection_options(default_timeout: float = 5.0, json_flag: bool = True) -> Callable[[_F], _F]:
    """--target, --token, --timeout, the TLS flags (and --json) on a command; the
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
        ]
        if json_flag:
            options.append(
                click.option("--json", "as_json", is_flag=True, help="machine-readable JSON output")
            )

        def wrapper(**kw: Any) -> Any:
            try:
                tls = _tls_from(
                    kw.pop("tls"),
                    kw.pop("tls_ca"),
                    kw.pop("tls_cert"),
                    kw.pop("tls_key"),
                    kw.pop("tls_server_name"),
                )
            except ValueError as exc:
                raise CliFailure(str(exc), EXIT_USAGE) from None
            conn = Connection(
                kw.pop("target"), kw.pop("token"), kw.pop("timeout"), tls, kw.pop("as_json", False)
            )
            return func(conn=conn, **kw)

        wrapper.__name__ = func.__name__
        wrapper.__doc__ = func.__doc__
        out: Any = wrapper
        for opt in reversed(options):
            out = opt(out)
        return out  # type: ignore[no-any-return]

    return decorate


def _emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


def _msg_dict(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 2) -> str:
    """The first ``left`` columns left-aligned, the rest (numbers) right-aligned."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)])


# -- status -----------------------------------------------------------------------------


def pool_status(info: pb.PoolInfo, stats: pb.GetStatsResponse) -> dict[str, Any]:
    """One row of ``kvcoord status`` as plain values (the --json form)."""
    total = stats.num_total_blocks
    p = stats.prefix_cache_stats
    return {
        "pool": info.name,
        "replica": info.replica,
        "coordinator": info.coordinator,
        "groups": len(info.config.groups),
        "blocks_used": total - stats.num_free_blocks,
        "blocks_total": total,
        "usage": stats.usage,
        "prefix_queries_tokens": p.queries,
        "prefix_hits_tokens": p.hits,
        "hit_rate": (p.hits / p.queries) if p.queries else None,
        "live_requests": stats.num_requests,
        "sessions": stats.num_sessions,
        "reservations_live": stats.reservations.live,
        "fence": {"instance_id": stats.fence.instance_id, "incarnation": stats.fence.incarnation},
    }


def status_table(rows: Sequence[dict[str, Any]]) -> str:
    headers = ["POOL", "LAYOUT", "BLOCKS USED/TOTAL", "USAGE", "HIT RATE", "REQUESTS", "SESSIONS"]
    sharded = any(r.get("replica") for r in rows)  # a single node has no REPLICA column
    cells = [
        [
            r["pool"],
            f"{r['coordinator']} ({r['groups']} group{'s' if r['groups'] != 1 else ''})",
            *(
                ["?"] * 5
                if r.get("unreadable")
                else [
                    f"{r['blocks_used']}/{r['blocks_total']}",
                    f"{100 * r['usage']:.1f}%",
                    "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%",
                    str(r["live_requests"]),
                    str(r["sessions"]),
                ]
            ),
            *([r.get("replica") or "?"] if sharded else []),
        ]
        for r in rows
    ]
    if sharded:
        headers.append("REPLICA")
    table = _table(headers, cells)
    if any(r.get("unreadable") for r in rows):
        table += "\n? no observe role on this pool: its statistics are not yours to read"
    return table


@click.command()
@connection_options()
def status(conn: Connection) -> None:
    """A table of the pools you may see.

    Per pool: LAYOUT (the coordinator: no_prefix_cache, unitary or hybrid, and its
    KV cache groups), BLOCKS USED/TOTAL (usable blocks, the null block not counted),
    USAGE, HIT RATE (prefix-cache hit tokens over queried tokens since the pool was
    created; '-' before any lookup), REQUESTS (live requests), SESSIONS (live
    sessions attached to it) and, when pools are sharded over replicas, REPLICA (the
    replica serving it). Give every replica (--target a:50051,b:50051,c:50051, or a
    DNS name resolving to them all) to see every pool: each replica lists the pools
    it serves.
    """
    with conn.client() as c:
        pools = sorted(c.list_pools().pools, key=lambda p: p.name)
        rows = []
        for info in pools:
            try:
                stats = c.get_stats(info.name)
            except NotFoundError:  # deleted between the two calls
                continue
            except PermissionDeniedError as err:  # a tenant with only the use role on it
                rows.append(
                    {
                        "pool": info.name,
                        "replica": info.replica,
                        "coordinator": info.coordinator,
                        "groups": len(info.config.groups),
                        "unreadable": _one_line(err.message),
                    }
                )
                continue
            rows.append(pool_status(info, stats))
    if conn.as_json:
        _emit_json({"target": conn.target, "pools": rows})
    elif rows:
        click.echo(status_table(rows))
    else:
        click.echo(f"no pools on {conn.target}")


# -- pools ------------------------------------------------------------------------------


@click.group()
def pools() -> None:
    """Create, delete, inspect and check pools (administrators)."""


def _pool_config(
    config_file: str | None,
    num_blocks: int | None,
    block_size: int,
    hash_algo: str,
    hash_seed: str,
    caching: bool,
    max_model_len: int,
) -> pb.PoolConfig:
    if config_file:
        try:
            text = Path(config_file).read_text()
            return json_format.Parse(text, pb.PoolConfig())
        except (OSError, json_format.ParseError) as exc:
            raise CliFailure(
                f"cannot read pool config {config_file}: {_one_line(str(exc))}", EXIT_USAGE
            ) from None
    if num_blocks is None:
        raise click.UsageError("give --num-blocks (or --config FILE)")
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=block_size))],
        hash_block_size=block_size,
        enable_caching=caching,
        enable_kv_cache_events=caching,
        hash_algo=hash_algo if caching else "",
        hash_seed=hash_seed if caching else "",
        max_model_len=max_model_len,
    )


@pools.command("create")
@click.argument("name")
@click.option("--config", "config_file", metavar="FILE", help="the whole PoolConfig as protobuf JSON")
@click.option("--num-blocks", type=click.IntRange(min=2), help="physical blocks, the null block included")
@click.option(
    "--block-size", type=click.IntRange(min=1), default=16, show_default=True, help="tokens per block"
)
@click.option(
    "--hash-algo",
    type=click.Choice(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]),
    default="sha256_cbor",
    show_default=True,
)
@click.option("--hash-seed", default="0", show_default=True, help="the engines' PYTHONHASHSEED")
@click.option("--caching/--no-caching", default=True, show_default=True, help="prefix caching")
@click.option("--max-model-len", type=click.IntRange(min=0), default=0, help="0: the server's limit")
@connection_options()
def pools_create(conn: Connection, name: str, config_file: str | None, **flags: Any) -> None:
    """Create pool NAME: one full-attention group from the flags, or any layout from
    --config (a PoolConfig in protobuf JSON). Creating an identical pool again is a no-op."""
    cfg = _pool_config(config_file, **flags)
    with conn.client() as c:
        info = c.create_pool(name, cfg).pool
    if conn.as_json:
        _emit_json(_msg_dict(info))
    else:
        click.echo(f"pool {info.name}: {info.coordinator}, {info.config.num_blocks - 1} usable blocks")


@pools.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask (scripts; --json does not ask either)")
@connection_options()
def pools_delete(conn: Connection, name: str, yes: bool) -> None:
    """Delete pool NAME, its sessions and requests (their block ids become void)."""
    if not yes and not conn.as_json:
        click.confirm(f"delete pool {name} and every request in it?", abort=True)
    with conn.client() as c:
        c.delete_pool(name)
    if conn.as_json:
        _emit_json({"deleted": name})
    else:
        click.echo(f"deleted pool {name}")


@pools.command("inspect")
@click.argument("name")
@click.option("--requests/--no-requests", default=True, show_default=True, help="every request's block table")
@click.option("--free-queue", type=click.IntRange(min=0), default=0, help="free-queue entries from the head")
@click.option("--cached-blocks", is_flag=True, help="ids of the blocks that hold a prefix-cache hash")
@connection_options()
def pools_inspect(conn: Connection, name: str, requests: bool, free_queue: int, cached_blocks: bool) -> None:
    """The configuration of pool NAME and its block tables, read in one consistent step."""
    with conn.client() as c:
        info = c.get_pool(name).pool
        state = c.inspect_pool(name, free_queue, all_requests=requests, include_cached_blocks=cached_blocks)
    if conn.as_json:
        _emit_json({"pool": _msg_dict(info), "state": _msg_dict(state)})
        return
    cfg = info.config
    click.echo(f"pool {info.name}: {info.coordinator}")
    click.echo(
        f"  blocks: {cfg.num_blocks - 1 - state.num_free_blocks}/{cfg.num_blocks - 1} used "
        f"({100 * state.usage:.1f}%), hash {cfg.hash_algo or '-'} block {cfg.hash_block_size} "
        f"seed {cfg.hash_seed or '-'}, caching {'on' if cfg.enable_caching else 'off'}"
    )
    for i, g in enumerate(cfg.groups):
        kind = g.WhichOneof("spec") or "?"
        click.echo(f"  group {i}: {kind} block_size {getattr(g, kind).block_size}")
    click.echo(f"  fence: {info.fence.instance_id}:{info.fence.incarnation}")
    if free_queue:
        click.echo(f"  free queue head: {' '.join(map(str, state.free_queue_head)) or '(empty)'}")
    if cached_blocks:
        click.echo(f"  cached blocks: {len(state.cached_block_ids)}")
    if requests:
        click.echo(f"  requests: {len(state.requests)}")
        for r in state.requests:
            tables = " | ".join(" ".join(map(str, g.block_ids)) for g in r.groups)
            click.echo(f"    {r.request_id}: {r.num_computed_tokens}/{r.num_tokens} tokens, blocks {tables}")


@pools.command("check")
@click.argument("name")
@connection_options(default_timeout=60.0)
def pools_check(conn: Connection, name: str) -> None:
    """Check pool NAME's invariants (exit 1 when any is violated)."""
    with conn.client() as c:
        result = c.check_pool(name)
    if conn.as_json:
        _emit_json({"pool": name, "ok": not result.violations, **_msg_dict(result)})
    else:
        click.echo(
            f"pool {name}: {result.num_blocks_checked} blocks, {result.num_requests_checked} requests, "
            f"{result.num_cached_blocks} cached blocks checked: "
            + ("OK" if not result.violations else f"{len(result.violations)} violation(s)")
        )
        for v in result.violations:
            click.echo(f"  {v}")
    if result.violations:
        raise SystemExit(EXIT_FAILED_CHECK)


# -- sessions ---------------------------------------------------------------------------


def session_rows(response: pb.ListSessionsResponse) -> list[dict[str, Any]]:
    """``kvcoord sessions`` as plain values (the --json form)."""
    return [
        {
            "session_id": s.session_id,
            "client_name": s.client_name,
            "tenant": s.tenant,
            "exclusive": s.exclusive,
            "lease_seconds": s.lease_seconds,
            "expires_in_seconds": s.expires_in_seconds,
            "num_requests": s.num_requests,
        }
        for s in response.sessions
    ]


def sessions_table(rows: Sequence[dict[str, Any]]) -> str:
    cells = [
        [
            r["session_id"],
            r["client_name"] or "-",
            r["tenant"] or "(full access)",
            str(r["num_requests"]),
            f"{r['expires_in_seconds']:.1f}s" if r["expires_in_seconds"] > 0 else "expired",
            "yes" if r["exclusive"] else "",
        ]
        for r in rows
    ]
    return _table(["SESSION", "CLIENT", "TENANT", "REQUESTS", "LEASE LEFT", "EXCLUSIVE"], cells, left=3)


@click.command()
@click.option("--pool", required=True, help="the pool whose sessions to list")
@connection_options()
def sessions(conn: Connection, pool: str) -> None:
    """The live sessions attached to a pool, every tenant's (administrators):
    the client name, the tenant, the requests each holds and the lease left."""
    with conn.client() as c:
        rows = session_rows(c.list_sessions(pool))
    if conn.as_json:
        _emit_json({"pool": pool, "sessions": rows})
    elif rows:
        click.echo(sessions_table(rows))
    else:
        click.echo(f"no sessions on pool {pool}")


# -- events -----------------------------------------------------------------------------


def _parse_fence(text: str | None) -> pb.Fence | None:
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError
        return pb.Fence(
            instance_id=parts[0], incarnation=int(parts[1]), position=int(parts[2]) if len(parts) == 3 else 0
        )
    except ValueError:
        raise click.BadParameter(f"{text!r} is not INSTANCE:INCARNATION", param_hint="--fence") from None


def _fence_text(f: pb.Fence) -> str:
    return f"{f.instance_id}:{f.incarnation}"


def _read_state(path: Path, pool: str) -> tuple[int, pb.Fence | None]:
    if not path.exists():
        return 0, None
    try:
        state = json.loads(path.read_text())
        if state["pool"] != pool:
            raise CliFailure(f"state file {path} follows pool {state['pool']!r}, not {pool!r}", EXIT_USAGE)
        return int(state["after_sequence"]), _parse_fence(state.get("fence") or None)
    except (OSError, ValueError, KeyError, TypeError, click.BadParameter) as exc:
        raise CliFailure(f"cannot read state file {path}: {_one_line(str(exc))}", EXIT_USAGE) from None


def _write_state(path: Path, pool: str, after: int, fence: pb.Fence) -> None:
    """Replace the state file atomically (a crash leaves the old or the new one)."""
    body = json.dumps({"pool": pool, "after_sequence": after, "fence": _fence_text(fence)})
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent or ".")
    with os.fdopen(fd, "w") as f:
        f.write(body + "\n")
    os.replace(tmp, path)


def event_dict(msg: pb.WatchEventsResponse) -> dict[str, Any]:
    """One streamed event as plain values (the --json line)."""
    kind = msg.event.WhichOneof("event") or "unknown"
    out: dict[str, Any] = {
        "sequence": msg.sequence,
        "type": kind,
        "gap": msg.gap,
        "reset": msg.reset,
        "fence": _fence_text(msg.fence),
    }
    if kind == "unknown":  # an event kind newer than this client
        return out
    event = event_from_pb(msg.event)
    if isinstance(event, BlockStored):
        out["block_hashes"] = [h.hex() for h in event.block_hashes]
        out["parent_block_hash"] = None if event.parent_block_hash is None else event.parent_block_hash.hex()
        out["num_tokens"] = len(event.token_ids)
        out["block_size"] = event.block_size
        if event.lora_name is not None:
            out["lora_name"] = event.lora_name
    elif isinstance(event, BlockRemoved):
        out["block_hashes"] = [h.hex() for h in event.block_hashes]
    return out


def event_lines(msg: pb.WatchEventsResponse, after: int) -> list[str]:
    """The text lines for one streamed event: a RESET or GAP line first when it has one."""
    d = event_dict(msg)
    lines = []
    if msg.reset:
        lines.append(
            f"RESET: another history ({d['fence']}); what was read before belongs to the old one: "
            "start over from here"
        )
    if msg.gap:
        missed = f"{after + 1}..{msg.sequence - 1}" if msg.sequence - 1 > after and not msg.reset else "some"
        lines.append(f"GAP: events {missed} are no longer buffered: resynchronise")
    hashes = d.get("block_hashes", [])
    short = " ".join(h[-16:] for h in hashes[:4]) + (" ..." if len(hashes) > 4 else "")
    if d["type"] == "block_stored":
        detail = f"{len(hashes)} block(s) {short} ({d['num_tokens']} tokens)"
    elif d["type"] == "block_removed":
        detail = f"{len(hashes)} block(s) {short}"
    else:
        detail = ""
    lines.append(f"{msg.sequence:>8}  {d['type']:<18} {detail}".rstrip())
    return lines


@click.command()
@click.option("--pool", required=True, help="the pool whose KV events to read")
@click.option("--after", type=click.IntRange(min=0), default=None, help="resume after this sequence number")
@click.option("--fence", "fence_text", metavar="INSTANCE:INCARNATION", help="the history --after belongs to")
@click.option(
    "--state-file",
    type=click.Path(dir_okay=False),
    help="read --after/--fence from FILE and write them back after every event (resumable)",
)
@click.option("--follow", "-f", is_flag=True, help="keep streaming until interrupted")
@click.option(
    "--seconds",
    type=click.FloatRange(min=0.1),
    default=2.0,
    show_default=True,
    help="without --follow: stream this long",
)
@click.option("--limit", type=click.IntRange(min=1), help="stop after this many events")
@connection_options()
def events(
    conn: Connection,
    pool: str,
    after: int | None,
    fence_text: str | None,
    state_file: str | None,
    follow: bool,
    seconds: float,
    limit: int | None,
) -> None:
    """Stream a pool's KV events (BlockStored, BlockRemoved, AllBlocksCleared).

    Each line names its sequence number. A GAP line says events were dropped from the
    server's buffer before they were read (resynchronise); a RESET line says the server
    or the pool is not the one --fence (or the state file) names: what was read before
    belongs to another history. Resume with --after N --fence INSTANCE:INCARNATION (the
    last line's, printed at the end) or let --state-file keep them. With --follow a
    stream lost to a server restart is resumed after the last event read (a journaled
    pool's history goes on across restarts; a server that lost it answers with a RESET).
    """
    fence = _parse_fence(fence_text)
    state_path = Path(state_file) if state_file else None
    if state_path is not None and after is None and fence is None:
        after, fence = _read_state(state_path, pool)
    position = after or 0
    last_fence = fence
    count = 0
    lost = False
    with conn.client() as c:
        c.get_pool(pool)  # an unknown pool is one error line, not a silent empty stream
        while True:
            stream = c.watch_events(pool, position, timeout=None if follow else seconds, fence=last_fence)
            try:
                for msg in stream:
                    if lost:
                        click.echo("kvcoord: stream resumed", err=True)
                        lost = False
                    if conn.as_json:
                        click.echo(json.dumps(event_dict(msg), sort_keys=True))
                    else:
                        for line in event_lines(msg, position):
                            click.echo(line)
                    position, last_fence = msg.sequence, msg.fence
                    if state_path is not None:
                        _write_state(state_path, pool, position, msg.fence)
                    count += 1
                    if limit is not None and count >= limit:
                        break
                if not follow or (limit is not None and count >= limit):
                    break
                # --follow: the server ended the stream (it is stopping): resume
                lost = _lost(lost, "the server ended the stream")
            except UnavailableError as err:
                if not follow:
                    raise
                lost = _lost(lost, _one_line(err.message))
            except KeyboardInterrupt:
                break
            finally:
                getattr(stream, "close", lambda: None)()  # ends the call (a generator)
            try:
                time.sleep(FOLLOW_RETRY_SECONDS)
            except KeyboardInterrupt:
                break
    if not conn.as_json:
        where = f" --after {position} --fence {_fence_text(last_fence)}" if last_fence is not None else ""
        click.echo(f"{count} event(s); resume with{where or ' --after ' + str(position)}", err=True)


def _lost(already: bool, why: str) -> bool:
    """Say once per outage that --follow lost the stream and keeps trying."""
    if not already:
        click.echo(f"kvcoord: stream lost ({why}); resuming every {FOLLOW_RETRY_SECONDS:g} s", err=True)
    return True


# -- score ------------------------------------------------------------------------------


def read_prompt(path: str) -> tuple[list[int], dict[str, Any]]:
    """Token ids from a prompt file: JSON (a list of ints, or an object with
    ``token_ids`` and optional ``lora_name`` and ``cache_salt``), or text (integers
    separated by spaces, commas or newlines)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliFailure(f"cannot read prompt {path}: {_one_line(str(exc))}", EXIT_USAGE) from None
    extra: dict[str, Any] = {}
    try:
        value: Any = json.loads(text)
    except ValueError:
        value = None
        try:
            tokens = [int(t) for t in text.replace(",", " ").split()]
        except ValueError:
            raise CliFailure(
                f"prompt {path} is neither JSON nor whitespace-separated token ids", EXIT_USAGE
            ) from None
    if value is not None:
        if isinstance(value, dict):
            extra = {k: value[k] for k in ("lora_name", "cache_salt") if value.get(k)}
            value = value.get("token_ids")
        if not isinstance(value, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in value
        ):
            raise CliFailure(f"prompt {path}: expected a JSON list of token ids (integers)", EXIT_USAGE)
        tokens = value
    if not tokens:
        raise CliFailure(f"prompt {path} has no tokens", EXIT_USAGE)
    if any(t < 0 for t in tokens):
        raise CliFailure(f"prompt {path}: token ids must not be negative", EXIT_USAGE)
    return tokens, extra


@click.command()
@click.argument("prompt_file", metavar="PROMPT_FILE", type=click.Path(dir_okay=False, allow_dash=True))
@click.option("--pool", "pools_", multiple=True, help="score only these pools (repeatable; default: all)")
@click.option("--lora-name", help="the request's LoRA adapter name (part of every block hash)")
@click.option("--cache-salt", help="the request's cache salt (part of the first block's hash)")
@connection_options()
def score(
    conn: Connection, prompt_file: str, pools_: tuple[str, ...], lora_name: str | None, cache_salt: str | None
) -> None:
    """Score a prompt against the pools: the prefix-cache hit each would give it.

    PROMPT_FILE ('-': stdin) holds token ids, as a JSON list, a JSON object
    {"token_ids": [...], "lora_name": ..., "cache_salt": ...}, or text (integers
    separated by spaces, commas or newlines); no tokenizer is applied. The prompt is
    hashed with each pool's hash settings (kvcoord.client.routing) and scored with
    ScorePools, best first: the longest hit, then the most free blocks. Read-only.
    """
    tokens, extra = read_prompt(prompt_file)
    lora_name = lora_name or extra.get("lora_name")
    cache_salt = cache_salt or extra.get("cache_salt")
    with conn.client() as c:
        response = PoolRouter(c).score(tokens, list(pools_), lora_name=lora_name, cache_salt=cache_salt)
    scores = [
        {
            "pool": s.pool,
            "hit_tokens": s.hit_tokens,
            "hit_fraction": s.hit_tokens / len(tokens),
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "usage": s.usage,
        }
        for s in response.scores
    ]
    unscored = [{"pool": u.pool, "reason": u.reason, "message": u.message} for u in response.unscored]
    if conn.as_json:
        _emit_json({"num_tokens": len(tokens), "scores": scores, "unscored": unscored})
        return
    click.echo(f"prompt: {len(tokens)} tokens")
    if scores:
        rows = [
            [
                s.pool,
                "*" if i == 0 else "",
                f"{s.hit_tokens} ({100 * s.hit_tokens / len(tokens):.0f}%)",
                f"{s.num_free_blocks}/{s.num_total_blocks}",
                f"{100 * s.usage:.1f}%",
            ]
            for i, s in enumerate(response.scores)
        ]
        click.echo(_table(["POOL", "BEST", "HIT TOKENS", "FREE BLOCKS", "USAGE"], rows))
    for u in unscored:
        click.echo(f"not scored: {u['pool']}: {u['reason']} ({u['message']})")


# -- health -----------------------------------------------------------------------------


@click.command()
@click.option("--service", default="", help="service name (default: the whole server)")
@connection_options(default_timeout=3.0)
def health(conn: Connection, service: str) -> None:
    """Check a server's gRPC health: prints the status, exit 0 when SERVING, 1 otherwise
    (an unreachable server included)."""
    try:
        c = KVCoordClient(conn.target, timeout=conn.timeout, token=conn.token, tls=conn.tls)
    except ValueError as exc:
        raise CliFailure(str(exc), EXIT_USAGE) from None
    with c:
        try:
            state = c.health(service)
        except KVCoordError as exc:
            click.echo(f"kvcoord health: {_one_line(str(exc))}", err=True)
            if conn.as_json:
                _emit_json({"target": conn.target, "status": "UNREACHABLE", "error": _one_line(exc.message)})
            raise SystemExit(EXIT_FAILED_CHECK) from None
    click.echo(json.dumps({"target": conn.target, "status": state}) if conn.as_json else state)
    if state != "SERVING":
        raise SystemExit(EXIT_FAILED_CHECK)


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
    except click.exceptions.Abort:
        click.echo("kvcoord: aborted", err=True)
        return 1
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
