"""Rebuilding a pool from its journal in the cluster store (``[cluster] journal =
"store"``; the streams' layout is store_journal.py's): the complete records under the
pool's prefix (:func:`stream_rows`), then its state as a handover carries it
(:func:`rebuild`). Cluster.recover (cluster.py) does this for a pool whose owner is gone."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import cbor2

__all__ = ["HELD_WRITERS", "rebuild", "stream_rows"]

#: the most writers whose last records a pool keeps (``PoolService.held``; the one
#: added first goes first): a replica restarted daily rebuilds its pools each time and
#: would add one forever. One dropped matters only to a client told of its records that
#: has not called since (its next answer replaces its fence) while its pool was rebuilt
#: that many times, and then as a restore detected (loud), never as a block given twice
HELD_WRITERS = 64


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
    pool was never acknowledged anything). The state's pool holds (``held``, with what
    its base held already) the writer's highest position replayed and that position's
    tag under the writer's key: the writer may be an earlier instance of the journal of
    the replica that loads the pool, or of one it is handed over to later, whose own
    copy lacks those records (JournalPositions.brought).

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
        if tail:  # the writer's records the pool holds, and their tag (positions.py, brought)
            last = max(int(position) for position, _ in tail)
            held = registry.pools[pool].held
            if last > held.get(writer, [0])[0]:
                held.pop(writer, None)
                held[writer] = [last, registry.positions.tag(writer, last)]
                for oldest in list(held)[:-HELD_WRITERS]:
                    del held[oldest]
        return dump_pool(registry, pool), term, len(tail)
    return None
