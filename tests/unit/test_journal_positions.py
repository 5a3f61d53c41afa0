"""JournalPositions.replayed: a pool rebuilt from the cluster store raises the end of an
earlier instance of this journal to the records it brought, and nothing else.

A replica killed between the store's commit of a record and its own journal's comes
back with the store ahead; the record's kept answer then names a position its journal
lacks (tests/cluster/test_store_ahead_of_journal.py). Raising the end must not weaken
what proves a restored data directory: only this journal's instances (its key), only
upwards, never an instance a restore voided, and a position above what was rebuilt
still proves the journal behind.
"""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ServiceError
from kvcoord.service.fences import Fence
from kvcoord.service.positions import JournalPositions

KEY = b"k" * 32


def _positions() -> JournalPositions:
    p = JournalPositions()
    p.key = KEY
    p.started("old", 1)
    p.started("now", 10)  # "old" wrote records 1..9
    return p


def _told(p: JournalPositions, position: int) -> Fence:
    return Fence("old", 1, position=position, position_tag=p.tag("old", position))


def test_records_of_an_earlier_instance_of_this_journal_raise_its_end() -> None:
    p = _positions()
    assert p.replayed("old", 12, KEY) == {"old": 12}
    assert p.ends == {"old": 12}
    p.check(_told(p, 12))  # held: no restore
    behind: list[str] = []
    p.on_behind = behind.append
    with pytest.raises(ServiceError, match="restored from an older copy"):
        p.check(_told(p, 13))  # above what was rebuilt: still proof
    assert behind


@pytest.mark.parametrize(
    ("instance", "position", "key"),
    [
        ("old", 12, b"x" * 32),  # another journal's key
        ("old", 12, None),  # a stream written before tags
        ("other", 12, KEY),  # an instance this journal does not name
        ("old", 8, KEY),  # held already
    ],
)
def test_nothing_else_raises_an_end(instance: str, position: int, key: bytes | None) -> None:
    p = _positions()
    assert p.replayed(instance, position, key) == {}
    assert p.ends == {"old": 9}


def test_no_end_comes_back_after_a_restore_voided_them() -> None:
    p = _positions()
    p.voided()
    assert p.replayed("old", 12, KEY) == {}
    p.held({"old": 12})  # an adopt record replayed after the restore's
    assert p.ends == {}
