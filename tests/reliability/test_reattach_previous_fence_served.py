"""An Attach naming the fence of the session its worker lost (AttachRequest.previous_fence)
is served whenever nothing was restored: after SIGKILL restarts (the fence names an
earlier instance the journal holds records of, one restart back or two) and after the
pool was deleted and created again (another incarnation, after a restart). Review of 6829e96: the proof
must never refuse the Attach of a worker that was told nothing the journal lacks, nor
begin a grace. Real server process, SIGKILL, the managers' SessionKeeper."""

from __future__ import annotations

from pathlib import Path

from durable_server import leased_server, step_allocate
from kvcoord.client import KVCoordClient
from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb

LEASE = 4.0


def _keeper(c: KVCoordClient, sent: list[pb.Fence | None]) -> SessionKeeper:
    """A worker's session of pool ``p`` kept as the managers keep it; ``sent`` gets each
    Attach's previous_fence."""

    def attach_again(previous: pb.Fence | None) -> pb.AttachResponse:
        sent.append(previous)
        return c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=LEASE, previous_fence=previous)

    return SessionKeeper(c, attach_again, renew=False)


def _told(c: KVCoordClient, keeper: SessionKeeper, rid: str) -> pb.Fence:
    """An allocation, then a Step whose answer's fence (a journal position, its tag) the
    keeper adopts, as the managers do: the fence it now holds."""
    step_allocate(c, keeper, rid, 8)
    keeper.adopt(c.step("p", [], keeper.session_id, keeper.fence).fence)
    assert keeper.fence.position > 0 and keeper.fence.position_tag
    held = pb.Fence()
    held.CopyFrom(keeper.fence)
    return held


def _served_again(
    c: KVCoordClient, keeper: SessionKeeper, sent: list[pb.Fence | None], held: pb.Fence
) -> None:
    """The keeper starts its session again: its Attach names ``held`` and is served (a
    new session)."""
    before = keeper.session_id
    keeper.start_again()
    assert sent[-1] == held
    assert keeper.session_id and keeper.session_id != before


def test_attaching_again_after_restarts_and_a_pool_made_again_is_served(tmp_path: Path) -> None:
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    sent: list[pb.Fence | None] = []
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            keeper = _keeper(c, sent)
            assert sent == [None]
            held = _told(c, keeper, "a1")
            # a normal SIGKILL restart: the fence names the earlier instance, held in full
            server.restart()
            _served_again(c, keeper, sent, held)
            held = _told(c, keeper, "a2")
            # two restarts back: an earlier instance the journal still names
            server.restart()
            server.restart()
            _served_again(c, keeper, sent, held)
            held = _told(c, keeper, "a3")
            # a restart, then the pool deleted and created again: the fence names an
            # earlier instance and the old incarnation
            server.restart()
            config = c.get_pool("p").pool.config
            c.delete_pool("p", force=True)
            c.create_pool("p", config)
            _served_again(c, keeper, sent, held)
            assert keeper.fence.incarnation != held.incarnation
            assert keeper.fence.instance_id != held.instance_id
            step_allocate(c, keeper, "a4", 8)
            # no restore was proven: no grace began, another worker attaches at once
            c.attach("p", "sha256_cbor", 4, "0", "other", lease_seconds=LEASE)
    finally:
        server.stop()
