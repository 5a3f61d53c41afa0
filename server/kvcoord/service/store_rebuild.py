"""Rebuilding a pool from its journal in the cluster store (``[cluster] journal =
"store"``; the streams' layout is store_journal.py's): the complete records under the
pool's prefix (:func:`stream_rows`), then its state as a handover carries it
(:func:`rebuild`). Cluster.recover (cluster.py) does this for a pool whose owner is gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cbor2

__all__ = ["rebuild", "stream_rows"]


def stream_rows(rows: Any, pool_prefix: bytes) -> dict[int, dict[int, list[Any]]]:
    """The complete records under a pool's prefix: term -> seq -> [position, record]
    (a record some of whose parts are missing is left out: it was never acknowledged)."""
    parts: dict[tuple[int, int], dict[int, bytes]] = {}
    counts: dict[tuple[int, int], int] = {}
    for kv in rows:
        value = kv.value
        fields = kv.key[len(pool_prefix) :].decode().split("/")
        if len(fields) != 4:
            continue
        term, seq, part, total = (int(f) for f in fields)
        parts.setdefault((term, seq), {})[part] = value
        counts[(term, seq)] = total
    out: dict[int, dict[int, list[Any]]] = {}
    for (term, seq), got in parts.items():
        if len(got) != counts[(term, seq)]:
            continue
        out.setdefault(term, {})[seq] = cbor2.loads(b"".join(got[n] for n in range(len(got))))
    return out


def rebuild(
    streams: dict[int, dict[int, list[Any]]], make_registry: Callable[[str], Any], pool: str
) -> tuple[dict[str, Any], int, int] | None:
    """The pool's state from its streams, as :func:`~.registry_state.dump_pool` makes it, and
    the term and number of records it came from; None when no stream has a base (the
    pool was never acknowledged anything). The state's ``replayed`` names the writer,
    the highest position of its records replayed and the key they were tagged under
    (the loader pops it: JournalPositions.replayed).

    Raises:
        ValueError: a record cannot be replayed as its client was told.
    """
    from .recovery import Replayer
    from .registry_state import adopt_pool, apply_limits, dump_pool, limits_from

    for term in sorted(streams, reverse=True):
        records = streams[term]
        bases = [seq for seq, (_, rec) in records.items() if rec[0] == "base"]
        if not bases:
            continue
        start = max(bases)
        # (the writer's fence key came with kvcoord versions that tag positions)
        _, (_, wall, value, writer, limits, *fence_key) = records[start]
        tail = []
        seq = start + 1
        while seq in records:  # contiguous: a gap ends what was acknowledged
            tail.append(records[seq])
            seq += 1
        registry = make_registry(writer)
        # the writer's answers are rebuilt as they were told, tagged under its key
        registry.positions.key = fence_key[0] if fence_key else None
        apply_limits(registry, limits_from(limits), int(limits.get("max_message_bytes", 0)))
        adopt_pool(registry, value)
        last_wall = tail[-1][1][1] if tail else wall
        replayer = Replayer(registry, float(last_wall), writer)
        for position, record in tail:
            replayer.apply(int(position), record)
        if pool not in registry.pools:  # deleted in its last records
            return None
        value = dump_pool(registry, pool)
        if tail:  # the writer's records it holds (positions.py, JournalPositions.replayed)
            value["replayed"] = [writer, max(int(position) for position, _ in tail), registry.positions.key]
        return value, term, len(tail)
    return None
