"""The end of a large session whose blocks are cached (Detach, a lease running out) does
not hold the event loop with its KV events (a real server over real gRPC).

The requests are freed a slice at a time (test_session_end_slices.py, a pool without
caching), but a session's unfinished requests are freed as abandoned: each cached
block is evicted, one BlockRemoved event each, and every event of the session's end was
moved into the pool's event journal at once, after the last slice. With a million
cached blocks that one move held the loop ~200-300 ms here (2 cores), every other
pool's calls and lease renewals waiting; it grows with the session (a million requests
of 16 blocks: seconds). The events are moved with each slice now (the journal keeps
the same events whether they come at once or not: the replay, unsliced, agrees).
Bound as test_session_end_slices.py's: 100 ms, ten times the sliced figure."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from loop_monitor import LoopMonitor
from support import pool_toml
from test_session_end_slices import BLOCKS, MAX_STALL, N_REQ, fill


def _all_free_once(client: KVCoordClient) -> None:
    assert list(client.check_pool("big").violations) == []
    info = next(p for p in client.list_pools().pools if p.name == "big")
    assert (info.num_free_blocks, info.num_requests) == (BLOCKS - 1, 0)  # (the null block)


@pytest.mark.timeout(900)  # (fill: ~10 s of CPU, minutes at load 15-20 on 2 cores)
@pytest.mark.parametrize("ended_by", ["detach", "reaper"])
def test_a_large_cached_session_end_moves_its_events_in_slices(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, ended_by: str
) -> None:
    data = str(tmp_path / "data")
    server = make_server(pool_toml("big", BLOCKS, max_model_len=None), data_dir=data, synchronous="NORMAL")
    with KVCoordClient(server.address, timeout=60) as client:
        r = client.attach("big", "sha256_cbor", 4, "0", lease_seconds=20)  # (above the 10 s stall bound)
        fill(client, r.session_id, r.fence, cached=True)
        last = server.running.servicer.registry.pools["big"].events.last_sequence  # type: ignore[union-attr]
        assert last == N_REQ  # a BlockStored per request (its 16 blocks)
        monitor = LoopMonitor(server)
        time.sleep(0.1)
        monitor.reset()
        if ended_by == "detach":
            assert client.detach(r.session_id, r.fence).num_freed_requests == N_REQ
        else:
            clock.advance(21)
            assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
            server.settle()
        stall = monitor.stop()
        events = server.running.servicer.registry.pools["big"].events  # type: ignore[union-attr]
        assert events.last_sequence == last + N_REQ * 16  # a BlockRemoved per evicted block
        assert stall < MAX_STALL, f"one session's end held the event loop {stall * 1000:.0f} ms"
        _all_free_once(client)
        kept = (events.oldest_sequence, events.kept()[:2], events.kept()[-2:])
    if ended_by == "reaper":
        return  # (the replay of a session's end: once is enough, below)
    server.stop(snapshot=False)
    again = make_server(pool_toml("big", BLOCKS, max_model_len=None), data_dir=data, synchronous="NORMAL")
    replayed = again.running.servicer.registry.pools["big"].events  # type: ignore[union-attr]
    # moved in slices live, at once on replay: the same journal
    assert replayed.last_sequence == last + N_REQ * 16
    assert (replayed.oldest_sequence, replayed.kept()[:2], replayed.kept()[-2:]) == kept
