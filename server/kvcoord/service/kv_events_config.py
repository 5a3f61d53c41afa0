"""The ``[[kv_events]]`` tables (a pool's publisher settings, vLLM's ``KVEventsConfig``
keys) and the batch-number reservation that makes a publisher's numbers go on across
restarts (kv_publisher.py publishes; this module holds what config.py loads and what a
data directory keeps, so neither needs pyzmq)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "CLOCK_NUMBERS",
    "RESERVE_SEQUENCES",
    "KVEventsDecl",
    "SequenceReservation",
    "clock_floor",
    "kv_events_from_list",
    "reservation_path",
]


@dataclasses.dataclass(frozen=True, slots=True)
class KVEventsDecl:
    """One ``[[kv_events]]`` table: a pool's publisher, vLLM's ``KVEventsConfig`` keys.

    Args:
        pool: the pool whose events are published.
        endpoint: PUB address; bound when it contains ``*``, ``::`` or is ``ipc://`` /
            ``inproc://`` (e.g. ``tcp://*:5557``), else connected (vLLM's rule).
        replay_endpoint: ROUTER address for replays (bound), or "" for none.
        topic: the first frame of every message.
        buffer_steps: batches kept for replay (a number of batches, not of bytes).
        hwm: the PUB socket's high-water mark (messages queued per subscriber).
        tenant: publish this tenant's cache namespace ("" = the shared cache).
        int_hashes: hashes as 64-bit integers, the last 8 bytes of each (vLLM's
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default in vLLM 0.16 and 0.33
            alike, so on here too); false: the raw hash bytes.
        data_parallel_rank: the rank field of every batch.
    """

    pool: str
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str = ""
    topic: str = ""
    buffer_steps: int = 10_000
    hwm: int = 100_000
    tenant: str = ""
    int_hashes: bool = True
    data_parallel_rank: int = 0


def kv_events_from_list(tables: Any, pools: Sequence[str] = ()) -> tuple[KVEventsDecl, ...]:
    """The ``[[kv_events]]`` tables.

    Raises:
        ValueError: naming the key: not a list of tables, an unknown key, a value of
            the wrong type, a pool given twice.
    """
    if not isinstance(tables, list):
        raise ValueError("kv_events: must be an array of tables ([[kv_events]])")
    fields = {f.name: f for f in dataclasses.fields(KVEventsDecl)}
    out: list[KVEventsDecl] = []
    for i, t in enumerate(tables):
        where = f"kv_events[{i}]"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: must be a table")
        unknown = set(t) - set(fields)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)} (known: {sorted(fields)})")
        if not isinstance(t.get("pool"), str) or not t["pool"]:
            raise ValueError(f"{where}.pool: required (the pool whose events are published)")
        for key, value in t.items():
            want: type = {"int": int, "bool": bool, "str": str}[str(fields[key].type)]
            if type(value) is not want or (isinstance(value, int) and value < 0):
                raise ValueError(f"{where}.{key}: must be a{'n' if want is int else ''} {fields[key].type}")
        decl = KVEventsDecl(**t)
        if decl.buffer_steps < 1 or decl.hwm < 1:
            raise ValueError(f"{where}: buffer_steps and hwm must be >= 1")
        if any(d.pool == decl.pool for d in out):
            raise ValueError(f"{where}.pool: {decl.pool!r} has a publisher already")
        out.append(decl)
    return tuple(out)


#: batch numbers reserved ahead at once (one synced write of the reservation file)
RESERVE_SEQUENCES = 4096
#: a restarted publisher's numbers start past this many a second of the wall clock
#: (:func:`clock_floor`)
CLOCK_NUMBERS = 1_000_000


def clock_floor(wall_clock: Callable[[], float] = time.time) -> int:
    """The least number a restarted publisher starts at (:class:`SequenceReservation`):
    the wall clock in microseconds since the epoch."""
    return int(wall_clock() * CLOCK_NUMBERS)


class SequenceReservation:
    """Batch numbers that survive a restart: numbers are used only below a ceiling
    stored in ``path`` (written, synced and renamed into place before any number under
    it is used), and a new reservation starts at the stored ceiling. A crash can skip
    numbers but never use one twice.

    ``floor``: a restart (the file exists) starts at it at least. The publisher passes
    the wall clock in microseconds (:func:`clock_floor`): the file may be a restored
    copy (a volume snapshot, a backup) whose ceiling is below numbers the lost history
    published since, which a subscriber would drop as batches it has seen; no earlier
    process's numbers reach the clock's (it would have had to publish a million batches
    a second since it started). A restart is a gap to subscribers anyway (they ask the
    replay socket); a first start (no file) counts from 0.

    Args:
        path: the reservation file (its directory is created).
        pool: the pool's name, kept in the file for whoever reads it.
        floor: the least number a restart starts at.

    Raises:
        ValueError: the file exists but is not a reservation (names the file).
    """

    def __init__(self, path: Path, pool: str, floor: int = 0) -> None:
        self.path = path
        self.pool = pool
        self.ceiling = 0
        if path.exists():
            try:
                value = json.loads(path.read_text())
                ceiling = value["ceiling"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}: not a KV event sequence reservation ({exc})") from None
            if type(ceiling) is not int or ceiling < 0:
                raise ValueError(f"{path}: ceiling must be a non-negative integer, got {ceiling!r}")
            self.ceiling = ceiling
        #: the first number this process may use (after a restart, ``floor`` at least)
        self.start = max(self.ceiling, floor) if path.exists() else 0

    def allow(self, seq: int) -> None:
        """Make ``seq`` usable: raise the stored ceiling past it first when needed."""
        if seq < self.ceiling:
            return
        ceiling = seq + RESERVE_SEQUENCES
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            json.dump({"pool": self.pool, "ceiling": ceiling}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.ceiling = ceiling


def reservation_path(data_dir: str | Path, pool: str) -> Path:
    """The reservation file of ``pool``'s publisher in ``data_dir``."""
    digest = hashlib.sha256(pool.encode()).hexdigest()[:16]
    return Path(data_dir) / "kv_events" / f"{digest}.json"
