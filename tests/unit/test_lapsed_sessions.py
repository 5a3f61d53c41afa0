"""Sessions whose lease ran out but which no reaper ended yet (the server's reaper runs
about once a second; these nodes have none): the next Attach of their pool, or a
call naming one, ends them exactly as the reaper would (requests freed, journaled as
expired, counted), so a lapsed exclusive session never holds its pool. The servicer's
handlers are called directly (no gRPC); a restart replays the journal."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcoord.client import _requests as rq
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.errors import ErrorReason, ServiceError, Status
from kvcoord.service.observers import NullObserver
from kvcoord.service.sessions import Session, SessionTable
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op
from test_journal import NONE, Aborted, Node, _pool_config, state_of


class Counted(NullObserver):
    def __init__(self) -> None:
        self.expired: list[str] = []
        self.detached_pools: list[str] = []

    def session_expired(self, pool: str) -> None:
        self.expired.append(pool)

    def detached(self, pool: str) -> None:
        self.detached_pools.append(pool)


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _attach(node: Node, exclusive: bool = True) -> pb.AttachResponse:
    return node.call("Attach", rq.attach("p", "sha256_cbor", 4, "0", "engine-0", 5, exclusive=exclusive))


def _allocate(node: Node, att: pb.AttachResponse, rid: str) -> None:
    tokens = list(range(12))
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=tokens, new_request=True,
        append_block_hashes=BlockHasher("sha256_cbor", 4, NONE).extend(tokens),
    )  # fmt: skip
    node.call("Step", rq.step("p", [pb.Operation(allocate=allocate_op(sync, 12))], att.session_id, att.fence))


def _lapsed_node(loop: asyncio.AbstractEventLoop, tmp_path: Path) -> tuple[Node, Counted, pb.AttachResponse]:
    """A node whose pool "p" has an exclusive session holding request "r", whose lease ran out."""
    node = Node(loop, tmp_path)
    observer = Counted()
    node.servicer.observer = observer
    node.call("CreatePool", pb.CreatePoolRequest(name="p", config=_pool_config()))
    old = _attach(node)
    _allocate(node, old, "r")
    node.clock.advance(6)  # past the 5 s lease; nothing reaps
    return node, observer, old


def test_a_lapsed_exclusive_session_does_not_refuse_the_next_attach(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """The next exclusive Attach ends the lapsed holder as expired (its request freed,
    counted, journaled: a restart holds the same state), then attaches."""
    node, observer, old = _lapsed_node(loop, tmp_path)
    pool = node.registry.pools["p"]
    held = pool.engine.num_free_blocks
    assert old.session_id in node.registry.sessions.sessions  # not reaped yet
    new = _attach(node)
    assert new.exclusive and new.session_id != old.session_id
    assert old.session_id not in node.registry.sessions.sessions
    assert "r" not in pool.engine.requests and pool.engine.num_free_blocks == held + 3
    assert observer.expired == ["p"] and observer.detached_pools == ["p"]
    node.settle()
    before = state_of(node)
    node.crash()
    again = Node(loop, tmp_path)
    assert state_of(again) == before
    assert list(again.registry.sessions.sessions) == [new.session_id]


def test_only_the_attached_pools_lapsed_sessions_end() -> None:
    """An Attach ends its own pool's lapsed sessions; other pools' wait for the reaper."""
    clock = ManualClock()
    table = SessionTable(clock, 5.0, 5.0)
    a, b = table.open("p", "a", 5), table.open("q", "b", 5)
    clock.advance(6)
    assert table.expired("p") == [a]
    assert list(table.sessions) == [b.session_id]
    assert table.ran_out(b.session_id) is b and not table.sessions


class CountedClock(ManualClock):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return super().__call__()


def _refused(table: SessionTable, session_id: str, pool: str | None = None) -> ServiceError:
    with pytest.raises(ServiceError) as err:
        table.get(session_id, pool)
    return err.value


def test_get_finds_a_session_in_one_lookup_and_one_clock_read() -> None:
    """SessionTable.get (every keyed call): a live session is returned as it is; one whose
    lease ran out (to the second: ``expires_at`` now) is told SESSION_EXPIRED, ended
    first through ``on_lapsed`` (taken out of the table, given once) when there is one and
    left to the reaper when there is none; an unknown one SESSION_EXPIRED, another pool's
    DENIED, none INVALID. Each reads the clock once (old code: twice, the second read
    deciding alone when ``on_lapsed`` was unset)."""
    clock = CountedClock()
    table = SessionTable(clock, 5.0, 10.0)
    a, b = table.open("p", "a", 5), table.open("p", "b", 6)
    ended: list[Session] = []
    for lapsed in (None, ended.append):
        table.on_lapsed = lapsed
        clock.reads = 0
        assert table.get(a.session_id, "p") is a and table.get(b.session_id) is b
        assert clock.reads == 2
        refused = _refused(table, a.session_id, "q")
        assert refused.status is Status.DENIED and a.session_id in table.sessions
        assert _refused(table, "").status is Status.INVALID
        unknown = _refused(table, "nobody")
        assert unknown.status is Status.NOT_FOUND and unknown.reason is ErrorReason.SESSION_EXPIRED
        assert clock.reads == 3 and not ended
    table.on_lapsed = None
    clock.advance(5)  # a's lease ends now; b's in a second
    clock.reads = 0
    told = _refused(table, a.session_id, "p")
    assert told.status is Status.NOT_FOUND and told.reason is ErrorReason.SESSION_EXPIRED
    assert clock.reads == 1 and a.session_id in table.sessions  # (left to the reaper)
    table.on_lapsed = ended.append
    told = _refused(table, a.session_id, "p")
    assert told.status is Status.NOT_FOUND and told.reason is ErrorReason.SESSION_EXPIRED
    assert clock.reads == 2 and ended == [a] and list(table.sessions) == [b.session_id]
    assert _refused(table, a.session_id).reason is ErrorReason.SESSION_EXPIRED and ended == [a]
    assert table.get(b.session_id, "p") is b and clock.reads == 3


def test_detaching_a_lapsed_session_ends_it_as_expired(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """Detach of a lapsed session is told SESSION_EXPIRED (its requests went with its
    lease) and ends it as the reaper would: it no longer holds the pool."""
    node, observer, old = _lapsed_node(loop, tmp_path)
    with pytest.raises(Aborted) as err:
        node.call("Detach", pb.DetachRequest(session_id=old.session_id, fence=old.fence))
    assert "lease ran out" in str(err.value)
    assert not node.registry.sessions.sessions
    assert "r" not in node.registry.pools["p"].engine.requests
    assert observer.expired == ["p"]
    node.settle()
    before = state_of(node)
    node.crash()
    assert state_of(Node(loop, tmp_path)) == before


def test_a_step_told_its_session_expired_finds_it_ended_after_a_crash(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    """A Step (a keyed call: its session checked by PoolService.session) of a lapsed,
    unreaped session is told SESSION_EXPIRED ("its requests were freed") only once that
    is true and journaled: the session ends as the reaper would end it, and a crash
    right after the answer restarts without it (it came back on a fresh lease, its
    request held and its exclusive pool refusing every Attach, until the reaper ran).
    The Step holds its pool while it checks the session: the end runs after it, in a
    task of its own, and the answer waits for it."""
    node, observer, old = _lapsed_node(loop, tmp_path)
    with pytest.raises(Aborted) as err:
        _allocate(node, old, "r2")
    assert "lease ran out" in str(err.value)
    assert old.session_id not in node.registry.sessions.sessions
    assert not node.registry.pools["p"].engine.requests
    assert observer.expired == ["p"]
    before = state_of(node)
    node.crash()  # (no settle: the answer waited for the end's record)
    again = Node(loop, tmp_path)
    assert state_of(again) == before
    assert not again.registry.sessions.sessions and not again.registry.pools["p"].engine.requests
    assert _attach(again).exclusive  # (nothing holds the pool)
