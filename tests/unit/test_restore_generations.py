"""JournalPositions generations: every proven restore begins one, an instance tags
under the key of the generation it started in, and an instance the journal does not
know proves a restore only with a tag of this journal's generation or a later one (a
lost instance of a restore proven already never fences again; one of a new restore
does; tests/reliability/test_restore_lost_restart.py shows it end to end)."""

from __future__ import annotations

import pytest
from kvcoord.service.errors import ServiceError
from kvcoord.service.fences import Fence
from kvcoord.service.positions import JournalPositions

KEY = b"k" * 32


def _journal() -> JournalPositions:
    p = JournalPositions()
    p.key = KEY
    p.started("copied", 1)
    return p


def _proves(p: JournalPositions, fence: Fence) -> bool:
    told: list[str] = []
    p.on_behind = told.append
    try:
        p.check_unknown(fence)
    except ServiceError:
        return bool(told)
    return False


def test_a_lost_instance_of_a_restore_proven_already_proves_nothing_and_a_new_restores_does() -> None:
    lost = _journal()  # the lost history: two instances the copy never heard of
    lost.started("lost-1", 5)
    lost.started("lost-2", 9)
    first = Fence("lost-1", 1, position=8, position_tag=lost.tag("lost-1", 8))
    second = Fence("lost-2", 1, position=12, position_tag=lost.tag("lost-2", 12))
    copy = _journal()
    assert _proves(copy, second)
    copy.voided(keep="serving")
    assert copy.next_generation() == 1
    assert not _proves(copy, first)  # a straggler of the same lost history, after the fencing
    later_copy = copy.export()  # a copy of the journal after its restored record
    copy.started("after", 20)  # started in generation 1: its own key
    assert copy.tag("after", 21) != lost.tag("after", 21)
    again = Fence("after", 1, position=30, position_tag=copy.tag("after", 30))
    newer = _journal()  # that copy restored, "after" lost with the history after it
    newer.restore(later_copy)
    assert newer.generation == 1 and _proves(newer, again)
    older = _journal()  # a copy from before the fencing (generation 0) proves it too
    assert _proves(older, again)


def test_a_generation_travels_with_snapshots_and_tags_stay_as_told() -> None:
    p = _journal()
    p.next_generation()
    p.started("g1", 4)
    told = p.tag("g1", 6)
    q = JournalPositions()
    q.key = KEY
    q.restore(p.export())
    assert q.generation == 1 and q.tag("g1", 6) == told and q.key_of("g1") == p.key_of("g1") != KEY
    q.started("g1-next", 8)
    with pytest.raises(ServiceError):  # a known instance's position above its end still proves
        q.check(Fence("g1", 1, position=9, position_tag=p.tag("g1", 9)))


def _loaded(state: dict[str, object], writer: str) -> JournalPositions:
    """A journal recovering from a snapshot of ``state`` written by ``writer``."""
    q = JournalPositions()
    q.key = KEY
    q.restore({**state, "latest": writer})
    q.snapshot_loaded(writer)
    return q


def test_a_snapshot_that_names_no_generation_for_its_writer_is_decided_by_its_first_tagged_answer() -> None:
    """A kvcoord before 863d21c snapshotted an instance's start record before setting
    its generation; an instance serving when a restore was proven tags under generation
    0's key. Both snapshots read alike: the replayed answer's tag decides, under
    either key, and a tag of neither key is refused (mutations.py finds no digest)."""
    p = _journal()
    p.voided(keep="x")
    p.next_generation()
    state = p.export()  # names no generation for "x"
    started_after = _loaded(state, "x")  # "x" started after the restore: its generation's key
    told = p.tag("x", 7, generation=1)
    assert started_after.replay_tags("x", 7) == [p.tag("x", 7), told, b""]
    assert started_after.replay_tags("other", 7) == [p.tag("other", 7), b""]
    started_after.told_with("x", 7, told)
    assert started_after.undecided is None
    assert started_after.replay_tags("x", 8) == [p.tag("x", 8, generation=1), b""]
    serving = _loaded(state, "x")  # "x" served when the restore was proven: generation 0's
    serving.told_with("x", 7, p.tag("x", 7))
    assert serving.undecided is None and serving.key_of("x") == KEY != started_after.key_of("x")
    assert serving.replay_tags("x", 8) == [p.tag("x", 8), b""]
    named = _journal()  # a snapshot that names it (this kvcoord's): nothing to decide
    named.next_generation()
    named.started("x", 3)
    assert _loaded(named.export(), "x").undecided is None
    assert _loaded(_journal().export(), "copied").undecided is None  # no restore proven
