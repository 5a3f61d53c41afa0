"""A journaled server shows a WatchEvents reader the BlockRemoved events of a session
that ends holding computed requests as soon as its end is durable: ended by Detach or
by its lease running out (a real server over real gRPC).

Its requests are freed as abandoned, their cached blocks evicted (one BlockRemoved
each). A journaled pool's events reach readers only once a record naming the pool is
committed (nothing a crash could take back). The Detach record named it; the record of
a lapsed session did not, so its events stayed hidden until the pool's next call: a
reader, and ``kvcoord events --follow``, saw nothing of an expiry on an idle pool (and
saw it later, at another call, under load: test_cli.py's follow test met it)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import allocate
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from support import pool_toml

#: a bound on a hang: the events come once the end's record is committed (milliseconds)
WAIT = 60.0


def watch(client: KVCoordClient, after: int, want: int) -> tuple[list[str], threading.Thread]:
    """Read pool p's events after ``after`` on a thread until ``want`` came (or WAIT
    passed): their kinds, filled in as they come."""
    kinds: list[str] = []

    def read() -> None:
        for msg in client.watch_events("p", after, timeout=WAIT):
            kinds.append(msg.event.WhichOneof("event") or "")
            if len(kinds) == want:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return kinds, reader


@pytest.mark.parametrize("ended_by", ["detach", "reaper"])
def test_the_end_of_a_session_holding_cached_blocks_is_shown_to_readers(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, ended_by: str
) -> None:
    server = make_server(pool_toml("p", 32), data_dir=str(tmp_path / "data"), synchronous="NORMAL")
    with KVCoordClient(server.address) as client:
        r = client.attach("p", "sha256_cbor", 4, "0", lease_seconds=20)  # (above the 10 s stall bound)
        client.step("p", [allocate("a", list(range(8)), 8)], r.session_id, r.fence)  # 2 cached blocks
        stored, reader = watch(client, 0, want=1)
        reader.join(WAIT + 10)
        assert stored == ["block_stored"]
        kinds, reader = watch(client, 1, want=2)
        if ended_by == "detach":
            assert client.detach(r.session_id, r.fence).num_freed_requests == 1
        else:
            clock.advance(21)
            assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
        reader.join(WAIT + 10)
        # nothing else is called on the pool meanwhile: the end's own record shows them
        assert kinds == ["block_removed", "block_removed"]
        assert client.get_stats("p").num_requests == 0
