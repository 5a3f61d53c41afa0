"""The pure helpers of bench/replicas.py: its failover check must be able to fail, its
placement must spread pools evenly, its recovery time must be read from the right
Steps. (The benchmark itself is not a test: nothing here is timed.)"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
from kvcoord.service.ownership import Member, owner_of

BENCH = str(Path(__file__).resolve().parents[2] / "bench")
sys.path.insert(0, BENCH)  # the bench's modules, for this import only (their names are generic)
try:
    from replicas import back_after, compare_pool, placed_pools
finally:
    sys.path.remove(BENCH)


def test_the_failover_check_passes_only_an_exact_pool() -> None:
    acked = {"a": [1, 2, 3], "b": [4]}
    assert compare_pool(acked, set(), {"a": [1, 2, 3], "b": [4]}) == []
    # a request whose outcome is unknown may be there or not
    assert compare_pool(acked, {"u"}, {"a": [1, 2, 3], "b": [4], "u": [5]}) == []
    assert compare_pool(acked, {"u"}, {"a": [1, 2, 3], "b": [4]}) == []

    lost = compare_pool(acked, set(), {"a": [1, 2, 3]})
    assert len(lost) == 1 and lost[0].startswith("b:")
    shorter = compare_pool(acked, set(), {"a": [1, 2], "b": [4]})
    assert len(shorter) == 1 and shorter[0].startswith("a:")
    extra = compare_pool(acked, set(), {"a": [1, 2, 3], "b": [4], "x": [9]})
    assert extra == ["x: present, never acknowledged"]
    twice = compare_pool({"a": [1, 2], "b": [4]}, {"u"}, {"a": [1, 2], "b": [4], "u": [2]})
    assert twice == ["block 2 held by 2 requests"]


def test_pools_are_placed_evenly_by_the_clusters_rule() -> None:
    ids = ["r0", "r1", "r2", "r3"]
    names = placed_pools("p", ids, 8)
    assert len(set(names)) == 8
    members = [Member(r, "") for r in ids]
    owners = [owner_of(n, members).replica_id for n in names]  # type: ignore[union-attr]
    assert owners == [ids[i % 4] for i in range(8)]
    assert set(Counter(owners).values()) == {2}


def test_recovery_is_read_from_the_first_answer_after_the_kill() -> None:
    kill = 10.0
    steps = [
        (9.0, 9.1, "ok", 1),
        (9.9, 15.0, "ok", 7),  # in flight at the kill, retried until the new owner answered
        (15.0, 15.25, "ok", 1),
        (15.3, 15.4, "operation SYNC_MISMATCH", 1),  # not acknowledged: not an answer
    ]
    again, longest, at = back_after(steps, kill)  # type: ignore[misc]
    assert again == pytest.approx(5.0) and longest == pytest.approx(5.1) and at == pytest.approx(5.0)
    # a Step in flight at the kill but answered at once came from the old owner: the
    # pool answers again with the next one
    answered_before = [(9.95, 10.01, "ok", 1), (10.01, 14.0, "ok", 9), (14.0, 14.1, "ok", 1)]
    again, longest, at = back_after(answered_before, kill)  # type: ignore[misc]
    assert again == pytest.approx(4.0) and longest == pytest.approx(3.99) and at == pytest.approx(4.0)
    # answered after the kill, but only by Steps the old owner had answered at once
    assert back_after(answered_before[:1], kill)[0] is None  # type: ignore[index]
    assert back_after(steps[:1], kill) is None
    assert back_after([(9.9, 12.0, "UnavailableError", 3)], kill) is None
