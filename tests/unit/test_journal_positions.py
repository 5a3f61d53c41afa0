"""JournalPositions.brought: a pool loaded here (rebuilt from the cluster store, or
handed over by the replica that rebuilt it) that holds records of an earlier instance of
this journal raises that instance's end to them, and nothing else does.

A replica killed between the store's commit of a record and its own journal's comes
back with the store ahead; the record's kept answer then names a position its journal
lacks (tests/cluster/test_store_ahead_of_journal.py, and with the pool answered by
another replica and handed back, tests/cluster/test_store_ahead_handed_back.py).
Raising the end must not weaken what proves a restored data directory: only this
journal's instances, only positions it tagged (its key), only upwards, never an
instance a restore voided, and a position above what was brought still proves the
journal behind.
"""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ServiceError
from kvcoord.service.fences import Fence
from kvcoord.service.positions import JournalPositions

KEY = b"k" * 32


def _positions(key: bytes | None = KEY) -> JournalPositions:
    p = JournalPositions()
    p.key = key
    p.started("old", 1)
    p.started("now", 10)  # "old" wrote records 1..9
    return p


def _told(p: JournalPositions, position: int) -> Fence:
    return Fence("old", 1, position=position, position_tag=p.tag("old", position))


def test_records_of_an_earlier_instance_of_this_journal_raise_its_end() -> None:
    p = _positions()
    assert p.brought({"old": [12, p.tag("old", 12)]}) == {"old": 12}
    assert p.ends == {"old": 12}
    p.check(_told(p, 12))  # held: no restore
    behind: list[str] = []
    p.on_behind = behind.append
    with pytest.raises(ServiceError, match="restored from an older copy"):
        p.check(_told(p, 13))  # above what was brought: still proof
    assert behind


def test_other_journals_instances_are_passed_over() -> None:
    """A pool handed over holds records of the instances of every replica that wrote
    it: only this journal's named instance counts."""
    p = _positions()
    other = _positions(b"o" * 32)
    held = {"old": [12, p.tag("old", 12)], "theirs": [40, other.tag("theirs", 40)]}
    assert p.brought(held) == {"old": 12}
    assert p.ends == {"old": 12}


@pytest.mark.parametrize(
    ("instance", "position", "tag"),
    [
        ("old", 12, _positions(b"x" * 32).tag("old", 12)),  # another journal's key
        ("old", 12, b""),  # a stream written before tags
        ("old", 12, _positions().tag("old", 11)),  # a tag of another position
        ("old", 12, _positions().tag("now", 12)),  # a tag of another instance
        ("other", 12, _positions().tag("other", 12)),  # an instance this journal does not name
        ("old", 8, _positions().tag("old", 8)),  # held already
    ],
)
def test_nothing_else_raises_an_end(instance: str, position: int, tag: bytes) -> None:
    p = _positions()
    assert p.brought({instance: [position, tag]}) == {}
    assert p.ends == {"old": 9}


def test_a_journal_without_a_key_raises_nothing() -> None:
    p = _positions(None)
    assert p.brought({"old": [12, _positions().tag("old", 12)]}) == {}
    assert p.ends == {"old": 9}


def test_no_end_comes_back_after_a_restore_voided_them() -> None:
    p = _positions()
    tag = p.tag("old", 12)
    p.voided()
    assert p.brought({"old": [12, tag]}) == {}
    p.held({"old": 12})  # an adopt record replayed after the restore's
    assert p.ends == {}
