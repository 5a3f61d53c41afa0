"""The event journal: every reader learns of every gap, wherever its cursor is."""

from __future__ import annotations

from kvcoord.engine import AllBlocksCleared
from kvcoord.service.events import EventJournal


def test_missed_is_right_for_every_cursor() -> None:
    """A cursor behind the oldest kept event has missed some; one at or after it has not."""
    j = EventJournal(capacity=3)
    j.publish(AllBlocksCleared() for _ in range(5))  # keeps 3, 4, 5
    assert j.oldest_sequence == 3
    assert [j.missed(c) for c in range(6)] == [True, True, False, False, False, False]
    assert [seq for seq, _ in j.since(1)] == [3, 4, 5]
    j.publish([AllBlocksCleared()] * 3)  # keeps 6, 7, 8: a reader at 4 missed 5
    assert j.missed(4) and not j.missed(5) and not j.missed(8)
