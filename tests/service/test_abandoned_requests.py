"""A session that ends holding requests (Detach, a lease that ran out) over real gRPC:
its requests are freed as abandoned. Their last allocations cached the hashes of blocks
their worker was to compute, and a worker that stopped (died, shut down with a step in
flight, lost its session) never wrote them: the pool must not hand them out as hits to
another session's request, which would read KV nobody wrote (on a shared pool, the
engines sharing it read each other's cache). The cache entries of the blocks no other
live request holds are dropped (BlockRemoved told); blocks another session's request
holds keep theirs; block ids and free counts are those of a plain free. A restart on
the journal replays the same end."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from durable_server import small_pool
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate

POOL = small_pool(64).replace("enable_caching = true", "enable_caching = true\nenable_kv_cache_events = true")
PROMPT = [9000 + i for i in range(41)]  # 10 full blocks of 4
HASHES = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(PROMPT)


def _hit(c: KVCoordClient, tokens: list[int] = PROMPT) -> int:
    """The tokens of ``tokens`` a new request would hit (read only)."""
    hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(tokens)
    prompt = pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes)
    return c.score_pools(len(tokens), [prompt]).scores[0].hit_tokens


def _removed(c: KVCoordClient) -> list[bytes]:
    """The block hashes the pool's BlockRemoved events named (WatchEvents from the
    start, until it waits)."""
    removed: list[bytes] = []
    try:
        for e in c.watch_events("p", timeout=1.0):
            if e.event.WhichOneof("event") == "block_removed":
                removed.extend(e.event.block_removed.block_hashes)
    except Exception:  # noqa: BLE001 - the stream's deadline ends the read
        pass
    return removed


def _end(how: str, c: KVCoordClient, server: InProcessServer, clock: ManualClock, s: Any) -> None:
    if how == "detach":
        c.detach(s.session_id, s.fence)
    else:
        clock.advance(s.lease_seconds + 1)
        assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("how", ["detach", "expiry"])
def test_a_session_ending_with_requests_leaves_no_hit_on_blocks_only_they_held(
    make_server: Callable[..., InProcessServer], clock: ManualClock, how: str
) -> None:
    """Worker A allocated its prompt (10 full blocks cached as it was to compute them)
    and ends holding the request; worker B's request shares the first 4 blocks (it hit
    them). After A's end a new request hits those 4 blocks only: the 6 only A held are
    no longer cached (the old code kept all 10: 40 tokens of KV A may never have
    written), and their 6 hashes were told removed. The free count is a plain free's."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        a = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=10)
        b = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=1000)
        free0 = c.get_stats("p").num_free_blocks
        got = c.allocate("p", allocate("a", PROMPT, len(PROMPT)).allocate, a.session_id, a.fence)
        assert not got.result.refused
        shared = PROMPT[:16] + [1, 2, 3]
        op = allocate("b", shared, len(shared), lookup=True).allocate
        assert c.allocate("p", op, b.session_id, b.fence).result.hit.num_tokens == 16  # its hit
        assert _hit(c) == 40 and _removed(c) == []
        _end(how, c, server, clock, a)
        assert c.get_stats("p").num_free_blocks == free0 - 5  # b's 4 shared + 1 own block
        assert _hit(c) == 16
        assert sorted(_removed(c)) == sorted(HASHES[4:10])
        assert list(c.check_pool("p").violations) == []
        # b's own worker goes on: its blocks stay cached, and freed they stay hits
        c.free("p", ["b"], session_id=b.session_id, fence=b.fence)
        assert _hit(c) == 16 and _hit(c, shared) == 16


def test_requests_of_one_ending_session_sharing_blocks_drop_them_with_the_last(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Two requests of the ending session share their first blocks (the second hit the
    first's): nobody outside the session holds them, so none stays a hit, whichever
    request is freed first."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        a = c.attach("p", "sha256_cbor", 4, "0")
        c.allocate("p", allocate("a1", PROMPT, len(PROMPT)).allocate, a.session_id, a.fence)
        op = allocate("a2", PROMPT[:20] + [5], 21, lookup=True).allocate
        assert c.allocate("p", op, a.session_id, a.fence).result.hit.num_tokens == 20
        c.detach(a.session_id, a.fence)
        assert _hit(c) == 0
        assert list(c.check_pool("p").violations) == []


def test_a_restart_on_the_journal_replays_the_abandoning_end(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """The Detach's journal record says its requests were freed as abandoned: the
    server restarted on the journal has the same cache (a later call's hit, acknowledged
    to a worker, names the same blocks), and the same hit for the prompt."""
    data = str(tmp_path / "data")
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        a = c.attach("p", "sha256_cbor", 4, "0")
        b = c.attach("p", "sha256_cbor", 4, "0")
        c.allocate("p", allocate("a", PROMPT, len(PROMPT)).allocate, a.session_id, a.fence)
        shared = PROMPT[:16] + [1, 2, 3]
        c.allocate("p", allocate("b", shared, len(shared), lookup=True).allocate, b.session_id, b.fence)
        c.detach(a.session_id, a.fence)
        cached = list(c.inspect_pool("p", include_cached_blocks=True).cached_block_ids)
        assert _hit(c) == 16
    server.stop(snapshot=False)  # the restart replays the journal's records
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        assert list(c.inspect_pool("p", include_cached_blocks=True).cached_block_ids) == cached
        assert _hit(c) == 16


@pytest.mark.parametrize("how", ["detach", "expiry"])
def test_a_reservation_keeps_no_hit_on_blocks_an_ending_session_never_wrote(
    make_server: Callable[..., InProcessServer], clock: ManualClock, tmp_path: Path, how: str
) -> None:
    """Worker A allocated its prompt (10 full blocks cached as it was to compute them),
    a router reserved that prompt's hit (40 tokens), and A's session ends holding the
    request. The reservation reads nothing: the 10 blocks lose their entries as if A
    alone held them (told removed), the prompt hits nothing, and the request of the
    prompt that then arrives computes them, adopting the reservation with a short hit
    (was: the reservation kept all 10 cached, and that request was handed 40 tokens of
    KV A may never have written). A restart on the journal replays the same end: the
    same cache and the same tables."""
    data = str(tmp_path / "data")
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        a = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=20)
        got = c.allocate("p", allocate("a", PROMPT, len(PROMPT)).allocate, a.session_id, a.fence)
        assert not got.result.refused
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=HASHES
        )
        assert c.score_pools(len(PROMPT), [prompt], reserve_seconds=30.0).reservation.hit_tokens == 40
        _end(how, c, server, clock, a)
        assert _hit(c) == 0
        assert sorted(_removed(c)) == sorted(HASHES[:10])
        assert list(c.check_pool("p").violations) == []
        b = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=1000)
        op = allocate("b", PROMPT, len(PROMPT), lookup=True).allocate
        assert c.allocate("p", op, b.session_id, b.fence).result.hit.num_tokens == 0
        r = c.get_stats("p").reservations
        assert (r.live, r.adopted, r.short_hits) == (0, 1, 1)
        state = _cache_and_tables(c)
    server.stop(snapshot=False)  # the restart replays the journal's records
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        assert _cache_and_tables(c) == state


def _cache_and_tables(c: KVCoordClient) -> tuple[list[int], dict[str, list[int]], int]:
    """The pool's cached blocks, each request's group-0 table and the free count."""
    inspected = c.inspect_pool("p", include_cached_blocks=True, all_requests=True)
    tables = {r.request_id: list(r.groups[0].block_ids) for r in inspected.requests}
    return list(inspected.cached_block_ids), tables, c.get_stats("p").num_free_blocks
