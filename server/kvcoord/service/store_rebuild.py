"""Rebuilding a pool from its journal in the cluster store (``[cluster] journal =
"store"``; the streams' layout is store_journal.py's): the complete records under the
pool's prefix (:func:`stream_rows`), then its state as a handover carries it
(:func:`rebuild`). Cluster.recover (cluster.py) does this for a pool whose owner is gone,
on a thread of its own (:func:`rebuilt_apart`).

**Off the loop.** Decoding a large pool's records, replaying them and dumping the
result takes CPU time that grows with the pool (65,536 blocks: 0.2 s on an idle core,
seconds under a CPU quota). Done on the event loop it held the replica's keep-alive,
its watch and every call of its other pools: a rebuild longer than ``lease_seconds``
lost the replica's lease and with it the claim the rebuild was for, which was found
unclaimed again, claimed and rebuilt again (seen: 11 claims in 2 minutes at a 6 % CPU
quota, the pool never served). So it runs in a forked child (state_export.py: the
records read are in its copy-on-write image; it sends back the rebuilt state as CBOR
and exits) while the loop goes on; the loop stands still for the fork and for
decoding the state sent back (one call of cbor2's C decoder). A thread was not
enough: the rebuild holds the GIL between switches, and a loaded machine that
preempts it while it holds the GIL holds the loop (seen: 0.6 s at a time, and a 2 s
lease lost). Where the process may not fork (gRPC's fork handlers on) or the fork
fails (a pids limit, memory), it runs on a thread of its own: the loop still takes the
GIL at every switch interval. The thread touches only what it makes: the records it
is given, a scratch registry of its own per rebuild (whose clocks are read without
counting anything: :meth:`.lease_clock.LeaseClock.peek`), and the state it returns;
the loop sees nothing of it before it is whole. A rebuild whose waiter is cancelled
(the replica stops) ends at once (the child is killed) or at the thread's next record
(a daemon thread: it never holds the process's exit)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import cbor2

__all__ = ["HELD_WRITERS", "RebuildStopped", "rebuild", "rebuilt_apart", "stream_rows"]

#: what :func:`rebuild` returns: the pool's state, the term and the records replayed
Rebuilt = tuple[dict[str, Any], int, int]
#: what :func:`rebuilt_apart` returns: the pool's state as a value (rebuilt on a thread)
#: or as its CBOR (in a forked child), the term and the records replayed
RebuiltApart = tuple[dict[str, Any] | None, bytes | None, int, int]

#: the most writers whose last records a pool keeps (``PoolService.held``; the one
#: added first goes first): a replica restarted daily rebuilds its pools each time and
#: would add one forever. One dropped matters only to a client told of its records that
#: has not called since (its next answer replaces its fence) while its pool was rebuilt
#: that many times, and then as a restore detected (loud), never as a block given twice
HELD_WRITERS = 64


class RebuildStopped(Exception):
    """The rebuild was given up by its waiter (the replica stops): nothing is served."""


def _never() -> bool:
    return False


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
    streams: dict[int, dict[int, list[Any]]],
    make_registry: Callable[[str], Any],
    pool: str,
    stopped: Callable[[], bool] = _never,
) -> Rebuilt | None:
    """The pool's state from its streams, as :func:`~.registry_state.dump_pool` makes it, and
    the term and number of records it came from; None when no stream has a base (the
    pool was never acknowledged anything). The state's pool holds (``held``, with what
    its base held already) the writer's highest position replayed and that position's
    tag under the writer's key: the writer may be an earlier instance of the journal of
    the replica that loads the pool, or of one it is handed over to later, whose own
    copy lacks those records (JournalPositions.brought).

    ``stopped`` is asked before each record replayed.

    Raises:
        ValueError: a record cannot be replayed as its client was told.
        RebuildStopped: ``stopped()`` said so.
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
            if stopped():
                raise RebuildStopped(f"the rebuild of pool {pool[:200]!r} was given up")
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


async def rebuilt_apart(
    rows: Any, pool_prefix: bytes, make_registry: Callable[[str], Any], pool: str
) -> RebuiltApart | None:
    """:func:`rebuild` of :func:`stream_rows` of ``rows`` in a forked child, else on a
    thread of its own (see the module docstring); the loop goes on meanwhile.
    ``make_registry`` is called there. A cancellation of the caller stops it. The
    state comes back as the child encoded it (decoding it is pool_load.py's, off the
    loop too: ``cbor2.loads`` of a large pool held the loop for seconds), or as the
    thread made it.

    Raises:
        ValueError: as :func:`rebuild` (and a record that is not CBOR); in a child,
            anything the rebuild raised, named in the message.
        ExportError: the child failed or was killed (state_export.py).
    """
    from .pool_load import on_thread
    from .state_export import collect, started_apart

    stop = threading.Event()

    def work() -> Rebuilt | None:
        return rebuild(stream_rows(rows, pool_prefix), make_registry, pool, stop.is_set)

    forked = started_apart(lambda: _outcome(work))
    try:
        if forked is not None:
            kind, *got = cbor2.loads(await collect(*forked))  # (the state inside is one bytes string)
            if kind == "failed":
                raise ValueError(got[0])
            return None if got[0] is None else (None, bytes(got[0][0]), int(got[0][1]), int(got[0][2]))
        rebuilt = await on_thread(work, "kvcoord-rebuild")
        return None if rebuilt is None else (rebuilt[0], None, rebuilt[1], rebuilt[2])
    finally:
        stop.set()  # (done: changes nothing; cancelled: the thread ends at its next record)


def _outcome(work: Callable[[], Rebuilt | None]) -> bytes:
    """In the forked child: ``work()``'s outcome as CBOR, the state encoded apart (a
    bytes string in it), or what it raised, named. It logs nothing: its registry is a
    scratch one, and the parent's log handlers may write to descriptors the child
    closed (durability.leave_parent)."""
    logging.disable(logging.CRITICAL)
    try:
        rebuilt = work()
        if rebuilt is None:
            return cbor2.dumps(["rebuilt", None])
        return cbor2.dumps(["rebuilt", [cbor2.dumps(rebuilt[0]), rebuilt[1], rebuilt[2]]])
    except Exception as exc:  # noqa: BLE001 - a journal that cannot be replayed: logged by the parent
        return cbor2.dumps(["failed", f"{type(exc).__name__}: {exc}"])
