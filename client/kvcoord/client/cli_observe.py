"""``kvcoord events``, ``kvcoord score`` and ``kvcoord health``: reading a pool's KV
events, scoring a prompt against pools' caches, and the server's health."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click
from kvcoord.engine import BlockRemoved, BlockStored
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import event_from_pb

from .cli_common import (
    EXIT_FAILED_CHECK,
    EXIT_INTERRUPTED,
    EXIT_USAGE,
    FOLLOW_RETRY_SECONDS,
    CliFailure,
    Connection,
    connection_options,
    emit_json,
    one_line,
    text_table,
)
from .errors import KVCoordError, UnavailableError
from .routing import PoolRouter

# -- events -----------------------------------------------------------------------------


def _parse_fence(text: str | None) -> pb.Fence | None:
    """INSTANCE:INCARNATION, or with the position and its tag (hex) the server gave with
    it: INSTANCE:INCARNATION:POSITION:TAG (a position alone, INSTANCE:INCARNATION:POSITION,
    is read too: one above what the server's journal holds is refused without its tag)."""
    if not text:
        return None
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3, 4) or not parts[0]:
            raise ValueError
        return pb.Fence(
            instance_id=parts[0],
            incarnation=int(parts[1]),
            position=int(parts[2]) if len(parts) > 2 else 0,
            position_tag=bytes.fromhex(parts[3]) if len(parts) > 3 else b"",
        )
    except ValueError:
        raise click.BadParameter(
            f"{text!r} is not INSTANCE:INCARNATION[:POSITION:TAG]", param_hint="--fence"
        ) from None


def _fence_text(f: pb.Fence) -> str:
    return f"{f.instance_id}:{f.incarnation}"


def _resume_text(f: pb.Fence) -> str:
    """The fence to resume with: its position and tag too, when it has them (they prove a
    restored data directory to the server: the stream then starts over with a RESET)."""
    if not f.position:
        return _fence_text(f)
    return f"{_fence_text(f)}:{f.position}:{f.position_tag.hex()}"


def _read_state(path: Path, pool: str) -> tuple[int, pb.Fence | None]:
    if not path.exists():
        return 0, None
    try:
        state = json.loads(path.read_text())
        if state["pool"] != pool:
            raise CliFailure(f"state file {path} follows pool {state['pool']!r}, not {pool!r}", EXIT_USAGE)
        fence = _parse_fence(state.get("fence") or None)
        if fence is not None and state.get("position"):
            fence.position = int(state["position"])
            fence.position_tag = bytes.fromhex(state.get("position_tag") or "")
        return int(state["after_sequence"]), fence
    except (OSError, ValueError, KeyError, TypeError, click.BadParameter) as exc:
        raise CliFailure(f"cannot read state file {path}: {one_line(str(exc))}", EXIT_USAGE) from None


def _write_state(path: Path, pool: str, after: int, fence: pb.Fence) -> None:
    """Replace the state file atomically (a crash leaves the old or the new one)."""
    state: dict[str, Any] = {"pool": pool, "after_sequence": after, "fence": _fence_text(fence)}
    if fence.position:  # (what proves a restored data directory: positions.py)
        state.update(position=fence.position, position_tag=fence.position_tag.hex())
    fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent or ".")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(state) + "\n")
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C or a full disk mid-write: the old file stays, no stray temp file
        Path(tmp).unlink(missing_ok=True)
        raise


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
@click.option(
    "--fence",
    "fence_text",
    metavar="INSTANCE:INCARNATION[:POSITION:TAG]",
    help="the history --after belongs to (as the end of a run prints it)",
)
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
    belongs to another history. Resume with --after N --fence INSTANCE:INCARNATION:POSITION:TAG
    (the last event's, printed at the end) or let --state-file keep them. With --follow a
    stream lost to a server restart is resumed after the last event read (a journaled
    pool's history goes on across restarts; a server that lost it answers with a RESET,
    and so does one whose data directory was restored from an older copy: the position
    and tag prove it).
    """
    fence = _parse_fence(fence_text)
    state_path = Path(state_file) if state_file else None
    if state_path is not None and after is None and fence is None:
        after, fence = _read_state(state_path, pool)
    read = _Read(after or 0, fence)
    interrupted = False
    try:
        with conn.client() as c:
            c.get_pool(pool)  # an unknown pool is one error line, not a silent empty stream
            _stream_events(c, conn, pool, read, state_path, follow, seconds, limit)
    except KeyboardInterrupt:
        # Ctrl-C wherever it lands (a stream read, the retry sleep, a resume call, closing
        # the channel): the summary below and status 130, never a loop that goes on
        interrupted = True
    if not conn.as_json:
        resume = f" --fence {_resume_text(read.fence)}" if read.fence is not None else ""
        click.echo(f"{read.count} event(s); resume with --after {read.position}{resume}", err=True)
    if interrupted:
        raise click.exceptions.Exit(EXIT_INTERRUPTED)


class _Read:
    """How far ``events`` has read: the last event's sequence and fence, and how many."""

    def __init__(self, position: int, fence: pb.Fence | None) -> None:
        self.position = position
        self.fence = fence
        self.count = 0


def _stream_events(
    c: Any,
    conn: Connection,
    pool: str,
    read: _Read,
    state_path: Path | None,
    follow: bool,
    seconds: float,
    limit: int | None,
) -> None:
    """Print the pool's events into ``read`` (a KeyboardInterrupt goes to the caller,
    which still knows where the last event left off)."""
    lost = False
    while True:
        stream = c.watch_events(pool, read.position, timeout=None if follow else seconds, fence=read.fence)
        try:
            for msg in stream:
                if lost:
                    click.echo("kvcoord: stream resumed", err=True)
                    lost = False
                if conn.as_json:
                    click.echo(json.dumps(event_dict(msg), sort_keys=True))
                else:
                    for line in event_lines(msg, read.position):
                        click.echo(line)
                read.position, read.fence = msg.sequence, msg.fence
                if state_path is not None:
                    _write_state(state_path, pool, read.position, msg.fence)
                read.count += 1
                if limit is not None and read.count >= limit:
                    return
            if not follow:
                return
            # --follow: the server ended the stream (it is stopping): resume
            lost = _lost(lost, "the server ended the stream")
        except UnavailableError as err:
            if not follow:
                raise
            lost = _lost(lost, one_line(err.message))
        finally:
            getattr(stream, "close", lambda: None)()  # ends the call (a generator)
        time.sleep(FOLLOW_RETRY_SECONDS)


def _lost(already: bool, why: str) -> bool:
    """Say once per outage that --follow lost the stream and keeps trying."""
    if not already:
        click.echo(f"kvcoord: stream lost ({why}); resuming every {FOLLOW_RETRY_SECONDS:g} s", err=True)
    return True


# -- score ------------------------------------------------------------------------------


def read_prompt(path: str) -> tuple[list[int], dict[str, Any]]:
    """Token ids from a prompt file: JSON (a list of ints, or an object with
    ``token_ids`` and optional ``lora_name``, ``lora_path`` and ``cache_salt``), or text (integers
    separated by spaces, commas or newlines)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise CliFailure(f"cannot read prompt {path}: {one_line(str(exc))}", EXIT_USAGE) from None
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
            extra = {k: value[k] for k in ("lora_name", "lora_path", "cache_salt") if value.get(k)}
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
@click.option("--lora-path", help="the LoRA adapter's path (part of the hash in vllm-0.33 pools)")
@click.option("--cache-salt", help="the request's cache salt (part of the first block's hash)")
@connection_options()
def score(
    conn: Connection,
    prompt_file: str,
    pools_: tuple[str, ...],
    lora_name: str | None,
    lora_path: str | None,
    cache_salt: str | None,
) -> None:
    """Score a prompt against the pools: the prefix-cache hit each would give it.

    PROMPT_FILE ('-': stdin) holds token ids, as a JSON list, a JSON object
    {"token_ids": [...], "lora_name": ..., "lora_path": ..., "cache_salt": ...}, or text (integers
    separated by spaces, commas or newlines); no tokenizer is applied. The prompt is
    hashed with each pool's hash settings (kvcoord.client.routing) and scored with
    ScorePools, best first: the longest hit, then the most free blocks. Read-only.
    """
    tokens, extra = read_prompt(prompt_file)
    lora_name = lora_name or extra.get("lora_name")
    lora_path = lora_path or extra.get("lora_path")
    cache_salt = cache_salt or extra.get("cache_salt")
    with conn.client() as c:
        try:
            response = PoolRouter(c).score(
                tokens, list(pools_), lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt
            )
        except ValueError as exc:  # a LoRA without its path for a vllm-0.33 pool
            raise CliFailure(f"cannot hash the prompt: {one_line(str(exc))}", EXIT_USAGE) from None
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
    lines = [f"prompt: {len(tokens)} tokens"]
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
        lines.append(text_table(["POOL", "BEST", "HIT TOKENS", "FREE BLOCKS", "USAGE"], rows))
    lines.extend(f"not scored: {u['pool']}: {u['reason']} ({u['message']})" for u in unscored)
    conn.show({"num_tokens": len(tokens), "scores": scores, "unscored": unscored}, "\n".join(lines))


# -- health -----------------------------------------------------------------------------


@click.command()
@click.option("--service", default="", help="service name (default: the whole server)")
@connection_options(default_timeout=3.0)
def health(conn: Connection, service: str) -> None:
    """Check a server's gRPC health: prints the status, exit 0 when SERVING, 1 otherwise
    (an unreachable server included)."""
    with conn.open() as c:
        try:
            state = c.health(service)
        except KVCoordError as exc:
            click.echo(f"kvcoord health: {one_line(str(exc))}", err=True)
            if conn.as_json:
                emit_json({"target": conn.target, "status": "UNREACHABLE", "error": one_line(exc.message)})
            raise SystemExit(EXIT_FAILED_CHECK) from None
    click.echo(json.dumps({"target": conn.target, "status": state}) if conn.as_json else state)
    if state != "SERVING":
        raise SystemExit(EXIT_FAILED_CHECK)
