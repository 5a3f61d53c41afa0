"""A property of the idempotency store under random histories (no gRPC, no engine):
once a numbered keyed call was applied, a copy of it delivered at any later time is
never taken for a new call (lookup returns its answer or refuses it), as long as its
session lives. Histories mix new calls, time passing (windows running out), the byte
budget dropping answers and keys, and the ways a pool's state travels: a session moved
to another store (a handover: export and restore of its entries and numbers), and a
store rebuilt from its last export plus the calls since, each remembered at its own
time as journal replay does (mutations.py, MutationRunner._remember_at; modelled here),
after a downtime."""

from __future__ import annotations

import random

import pytest
from kvcoord.service.errors import ServiceError
from kvcoord.service.idempotency import IdempotencyStore

WINDOW = 10.0
#: (time, session, key, number, answer) of each call applied since the last export
Log = list[tuple[float, str, str, int, bytes]]


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _replayed(clock: _Clock, max_bytes: int, base: tuple[list, dict] | None, log: Log) -> IdempotencyStore:
    """The store rebuilt from ``base`` (an export) and the calls after it, each kept as
    made ``last - when`` seconds of serving time before now (the downtime not counted)."""
    store = IdempotencyStore(clock, WINDOW, max_bytes)
    if base is not None:
        store.restore([tuple(e) for e in base[0]])
        store.restore_sequences(base[1])
    last = log[-1][0] if log else 0.0
    for when, sid, key, n, answer in log:
        at = clock() - max(0.0, last - when)
        store.clock = lambda at=at: at  # type: ignore[misc]
        try:
            store.expire()
            store.remember(sid, "Step", key, b"d", answer, sequence=n)
        finally:
            store.clock = clock
    return store


def _history(seed: int, moves: bool) -> None:
    rnd = random.Random(seed)
    clock = _Clock()
    max_bytes = rnd.choice([3000, 6000, 1 << 20])
    stores = [IdempotencyStore(clock, WINDOW, max_bytes), IdempotencyStore(clock, WINDOW, max_bytes)]
    owner = {"a": 0, "b": 0, "c": 1}
    applied: list[tuple[str, str, int]] = []
    log: Log = []
    base: tuple[list, dict] | None = None
    number = 0
    for step in range(400):
        r = rnd.random()
        if r < 0.5:  # a new call
            sid = rnd.choice(sorted(owner))
            number += 1
            key = f"k{number}"
            store = stores[owner[sid]]
            try:
                assert store.lookup(sid, "Step", key, b"d", number) is None
            except ServiceError:  # the budget is full of keys: not applied
                continue
            answer = b"x" * rnd.choice([0, 10, 500])
            store.remember(sid, "Step", key, b"d", answer, sequence=number)
            applied.append((sid, key, number))
            if owner[sid] == 0:
                log.append((clock.now, sid, key, number, answer))
        elif r < 0.7:
            clock.now += rnd.choice([0.1, 1.0, 3.0, 6.0])
        elif r < 0.85 and applied:  # a copy of an applied call, delivered now
            sid, key, n = rnd.choice(applied)
            try:
                got = stores[owner[sid]].lookup(sid, "Step", key, b"d", n)
            except ServiceError:
                continue  # refused (ANSWER_EVICTED, or the budget): never applied
            assert got is not None, f"seed {seed} step {step}: a copy of {key} (#{n}) would be applied"
        elif moves and r < 0.93:  # a session handed over to the other store
            sid = rnd.choice(sorted(owner))
            src, dst = stores[owner[sid]], stores[1 - owner[sid]]
            dst.restore([e for e in src.export() if e[0] == sid])
            dst.restore_sequences(src.export_sequences({sid}))
            src.drop_session(sid)
            owner[sid] = 1 - owner[sid]
            base, log = None, []  # (the rebuild below models store 0 only while nothing moves)
            moves = False
        elif not moves and r < 0.9:  # store 0 exported (a snapshot, a base record)
            base, log = (stores[0].export(), stores[0].export_sequences()), []
        elif not moves and r < 0.96 and base is not None:  # store 0 rebuilt after a downtime
            clock.now += rnd.choice([0.0, 2.0, 20.0])
            stores[0] = _replayed(clock, max_bytes, base, log)
        else:
            stores[rnd.randrange(2)].expire()


@pytest.mark.parametrize("moves", [False, True], ids=["rebuilt", "moved"])
@pytest.mark.parametrize("seeds", [range(0, 150), range(150, 300)], ids=["a", "b"])
def test_an_applied_calls_copy_is_never_taken_for_a_new_call(moves: bool, seeds: range) -> None:
    for seed in seeds:
        _history(seed, moves)
