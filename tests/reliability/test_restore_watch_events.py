"""A KV router resuming WatchEvents on a restored data directory nobody proved yet.

Real server process, real files. The data directory of a live server is copied (`cp
-a`), the pool makes more events (a router reads them), the server is SIGKILLed and the
copy restored; the server starts on it (nothing at start can tell). A new worker
attaches and makes more events than the lost history did, so the router's cursor is
within the new history's numbers. The router resumes with its cursor and the fence of
the last message it read.

Before, WatchEvents checked only that the fence named an instance the journal knows
and that the cursor was not past the newest event: the router was handed the new
history's events as the continuation of the old one, and the events it had read of the
lost history (never retracted) stayed in its index: a silently wrong index. Now every
message's fence carries the journal position it was durable at, with its tag (as every
other answer's): a reader's fence told of a record the restored journal lacks proves
the restore (as a worker's call does: every session ends, the grace begins) and the
stream starts over from the oldest kept event with ``reset`` set.

The control: the same router across a plain SIGKILL and restart (no restore) resumes
where it was, with no reset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from durable_server import (
    DurableServer,
    attach,
    copy_volume,
    leased_server,
    restore_volume,
    step_allocate,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, SessionExpiredError
from kvcoord.v1 import allocator_pb2 as pb


def _read_all(c: KVCoordClient, after: int, fence: pb.Fence | None) -> list[pb.WatchEventsResponse]:
    """Every message a router is sent now (the stream ends at its deadline once it has
    nothing more to send: events are delivered as soon as they are committed)."""
    return list(c.watch_events("p", after, timeout=2.0, fence=fence))


def _server(tmp: Path, lease: float) -> DurableServer:
    """One pool ``p`` of 64 blocks that publishes KV events."""
    server = leased_server(tmp, lease, num_blocks=64)
    text = server.config.read_text()
    server.config.write_text(
        text.replace("enable_caching = true\n", "enable_caching = true\nenable_kv_cache_events = true\n")
    )
    return server


def _copy_fence(f: pb.Fence) -> pb.Fence:
    out = pb.Fence()
    out.CopyFrom(f)
    return out


def test_a_router_resuming_on_a_restored_volume_is_reset_not_continued(tmp_path: Path) -> None:
    lease = 4.0
    server = _server(tmp_path, lease)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 16)
            copy_volume(server, copy)
            step_allocate(c, a, "a2", 16)  # the lost history: events the copy lacks
            seen = _read_all(c, 0, None)
        assert seen, "no event was made"
        cursor, fence = seen[-1].sequence, _copy_fence(seen[-1].fence)
        lost = {m.sequence for m in seen if m.event.WhichOneof("event") == "block_stored"}
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            # nobody proved the restore yet: a new worker attaches, and the new history
            # numbers its events past the router's cursor
            d = attach(c, "worker-d", lease)
            for i in range(3):  # one event each (BlockStored)
                step_allocate(c, d, f"d{i}", 8)
            resumed = _read_all(c, cursor, fence)
            assert resumed, "the resumed stream was sent nothing"
            first = resumed[0]
            # what the router read after the copy belongs to a lost history: it is told
            # to start over, never handed the new history as its continuation
            assert first.reset is True, (
                f"resumed after {cursor} (events {sorted(lost)} read before the restore) and was "
                f"sent sequence {first.sequence} with reset={first.reset}"
            )
            assert first.fence.instance_id != fence.instance_id
            # the router's fence proved the restore: the copy's session and the one
            # attached since ended, and no session attaches inside the grace
            with pytest.raises((SessionExpiredError, FencedError)):
                c.heartbeat(d.session_id, d.fence)
            with pytest.raises(GracePeriodError):
                attach(c, "worker-e", lease)
            # a router that reads on with the reset stream's fence is not reset again
            again = _read_all(c, resumed[-1].sequence, resumed[-1].fence)
            assert not any(m.reset for m in again)
    finally:
        server.stop()


def test_a_router_resuming_after_a_plain_restart_goes_on(tmp_path: Path) -> None:
    lease = 4.0
    server = _server(tmp_path, lease)
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            a: Any = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 16)
            seen = _read_all(c, 0, None)
        assert seen and seen[-1].fence.position > 0
        server.kill()
        server.start()
        with KVCoordClient(server.address) as c:
            a2 = attach(c, "worker-b", lease)
            step_allocate(c, a2, "b1", 16)
            resumed = _read_all(c, seen[-1].sequence, seen[-1].fence)
            assert resumed and resumed[0].reset is False
            assert resumed[0].sequence == seen[-1].sequence + 1
    finally:
        server.stop()
