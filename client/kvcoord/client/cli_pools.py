"""``kvcoord status``, ``kvcoord pools ...`` and ``kvcoord sessions``: the pools and
sessions a server holds, and their administration."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
from google.protobuf import json_format
from kvcoord.v1 import allocator_pb2 as pb

from .cli_common import (
    EXIT_FAILED_CHECK,
    EXIT_USAGE,
    CliFailure,
    Connection,
    connection_options,
    emit_json,
    msg_dict,
    one_line,
    text_table,
)
from .errors import NotFoundError, PermissionDeniedError

# -- status -----------------------------------------------------------------------------


def _pool_row(info: pb.PoolInfo) -> dict[str, Any]:
    """What ``kvcoord status`` shows of a pool whatever its statistics."""
    return {
        "pool": info.name,
        "replica": info.replica,
        "coordinator": info.coordinator,
        "groups": len(info.config.groups),
    }


def pool_status(info: pb.PoolInfo, stats: pb.GetStatsResponse) -> dict[str, Any]:
    """One row of ``kvcoord status`` as plain values (the --json form)."""
    total = stats.num_total_blocks
    p = stats.prefix_cache_stats
    return {
        **_pool_row(info),
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
    table = text_table(headers, cells)
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
                rows.append({**_pool_row(info), "unreadable": one_line(err.message)})
                continue
            rows.append(pool_status(info, stats))
    conn.show(
        {"target": conn.target, "pools": rows}, status_table(rows) if rows else f"no pools on {conn.target}"
    )


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
                f"cannot read pool config {config_file}: {one_line(str(exc))}", EXIT_USAGE
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
    conn.show(
        msg_dict(info), f"pool {info.name}: {info.coordinator}, {info.config.num_blocks - 1} usable blocks"
    )


@pools.command("delete")
@click.argument("name")
@click.option("--yes", is_flag=True, help="do not ask (scripts; --json does not ask either)")
@click.option(
    "--force",
    is_flag=True,
    help="delete even while an exclusive session (a running engine) holds the pool; refused otherwise",
)
@click.option(
    "--incarnation",
    type=click.IntRange(min=0),
    default=0,
    help="delete only this incarnation (pools inspect: fence INSTANCE:INCARNATION); another is refused",
)
@connection_options()
def pools_delete(conn: Connection, name: str, yes: bool, force: bool, incarnation: int) -> None:
    """Delete pool NAME, its sessions and requests (their block ids become void). A pool
    an exclusive session holds is deleted only with --force (its engine loses every
    request at its next step). With --incarnation, a pool made again since (a delete
    sent again after its outcome was unknown) is refused instead."""
    if not yes and not conn.as_json:
        click.confirm(f"delete pool {name} and every request in it?", abort=True)
    with conn.client() as c:
        c.delete_pool(name, force=force, incarnation=incarnation)
    conn.show({"deleted": name}, f"deleted pool {name}")


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
        emit_json({"pool": msg_dict(info), "state": msg_dict(state)})
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
    summary = (
        f"pool {name}: {result.num_blocks_checked} blocks, {result.num_requests_checked} requests, "
        f"{result.num_cached_blocks} cached blocks checked: "
        + ("OK" if not result.violations else f"{len(result.violations)} violation(s)")
    )
    conn.show(
        {"pool": name, "ok": not result.violations, **msg_dict(result)},
        "\n".join([summary, *(f"  {v}" for v in result.violations)]),
    )
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
    return text_table(["SESSION", "CLIENT", "TENANT", "REQUESTS", "LEASE LEFT", "EXCLUSIVE"], cells, left=3)


@click.command()
@click.option("--pool", required=True, help="the pool whose sessions to list")
@connection_options()
def sessions(conn: Connection, pool: str) -> None:
    """The live sessions attached to a pool, every tenant's (administrators):
    the client name, the tenant, the requests each holds and the lease left."""
    with conn.client() as c:
        rows = session_rows(c.list_sessions(pool))
    conn.show(
        {"pool": pool, "sessions": rows}, sessions_table(rows) if rows else f"no sessions on pool {pool}"
    )
