"""What a ``[[kv_events]]`` publisher hands its sockets (kv_event_feed.follow), read from
a server's pool as a subscriber would apply it: no hash the pool does not cache, and
no other tenant's events.

The publisher here is a stand-in that keeps each batch of engine events (the sockets
and vLLM's encoding are tests/with_vllm/test_kv_events.py's); ``follow`` runs on the
server's loop against its registry, as ``kvcoord serve`` runs it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers import attach, hashes, new_request
from kvcoord.client import KVCoordClient
from kvcoord.engine import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.service.kv_event_feed import follow
from kvcoord.service.kv_publisher import KVEventsDecl
from kvcoord.service.pool_service import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb

POOL = """
[[pools]]
name = "p"
num_blocks = 13
hash_block_size = 4
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true
max_model_len = 128

[[pools.groups]]
type = "full"
block_size = 4
"""

ROOT, T1 = "root-token", "t1-token"
TENANTS = f"""
[server]
auth_tokens = ["{ROOT}"]

[tenants.t1]
tokens = ["{T1}"]
grants = [{{ pools = ["p"], roles = ["use", "observe"] }}]
"""


class Batches:
    """The publisher's stand-in: the batches it was handed, in order."""

    def __init__(self, pool: str, tenant: str = "") -> None:
        self.decl = KVEventsDecl(pool=pool, tenant=tenant)
        self.batches: list[list[KVCacheEvent]] = []
        self.gaps: list[str] = []

    def submit(self, events: list[KVCacheEvent], profile: str) -> None:
        self.batches.append(list(events))

    def follow_profile(self, profile: str) -> None:
        pass

    def index(self) -> set[bytes]:
        """What a subscriber applying every batch holds: each hash cached."""
        held: set[bytes] = set()
        for batch in self.batches:
            for e in batch:
                if isinstance(e, AllBlocksCleared):
                    held.clear()
                elif isinstance(e, BlockStored):
                    held.update(e.block_hashes)
                elif isinstance(e, BlockRemoved):
                    held.difference_update(e.block_hashes)
        return held


@pytest.fixture
def following() -> Iterator[Callable[[InProcessServer, Batches], None]]:
    """Start ``follow`` for a stand-in publisher on a server's loop (stopped after)."""
    tasks: list[tuple[InProcessServer, Any]] = []

    def start(server: InProcessServer, publisher: Batches) -> None:
        registry = server.running.servicer.registry  # type: ignore[union-attr]
        coro = follow(registry, publisher, 0.02, publisher.gaps.append)  # type: ignore[arg-type]
        tasks.append((server, asyncio.run_coroutine_threadsafe(coro, server.loop)))  # type: ignore[arg-type]
        time.sleep(0.2)  # (its first look at the pool)

    yield start
    for _, task in tasks:
        task.cancel()


def _cached(server: InProcessServer) -> set[bytes]:
    """The hashes the pool caches now (the default namespace's keys are the hashes)."""
    engine = server.running.servicer.registry.pools["p"].engine  # type: ignore[union-attr]
    return {h for h in engine.block_pool.cached_block_hash_to_block.first[0]}


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(9)]  # two full blocks and a token: 3 blocks


def test_events_dropped_before_the_publisher_read_them_are_announced_as_a_clear(
    make_server: Callable[..., InProcessServer], following: Callable[[InProcessServer, Batches], None]
) -> None:
    """One Step makes more events than the pool's buffer keeps, among them the removal
    of hashes the subscriber was sent before: were the kept rest sent as they are, the
    subscriber would keep those hashes forever (the pool no longer caches them, and
    vLLM's format has no gap flag). A clear goes first, and the gap is counted."""
    server = make_server(POOL, limits=Limits(event_buffer=4))
    publisher = Batches("p")
    following(server, publisher)
    with KVCoordClient(server.address, timeout=10) as client:
        sid, fence = attach(client)
        first = [pb.Operation(allocate=pb.AllocateOp(request=new_request(f"a{i}", _prompt(i)), num_new_tokens=9))
                 for i in range(4)]  # fmt: skip
        assert not any(r.status_code for r in client.step("p", first, sid, fence).results)
        client.step("p", [pb.Operation(free=pb.FreeOp(request_id=f"a{i}")) for i in range(4)], sid, fence)
        time.sleep(0.3)  # (the subscriber has every a-hash)
        assert publisher.index() == {h for i in range(4) for h in hashes(_prompt(i))}
        assert not publisher.gaps
        # 4 new prompts need 12 of the 13 blocks: 8 cached blocks evicted in one Step,
        # 12 events where the buffer keeps 4
        second = [pb.Operation(allocate=pb.AllocateOp(request=new_request(f"b{i}", _prompt(10 + i)), num_new_tokens=9))
                  for i in range(4)]  # fmt: skip
        assert not any(r.status_code for r in client.step("p", second, sid, fence).results)
    time.sleep(0.3)
    assert publisher.gaps == ["p"]
    assert publisher.index() <= _cached(server)  # nothing the pool does not cache
    assert publisher.index()  # (what followed the clear)


def test_a_tenants_publisher_sends_no_other_namespace(
    make_server: Callable[..., InProcessServer], following: Callable[[InProcessServer, Batches], None]
) -> None:
    """A publisher for tenant t1 sends t1's cache namespace only: nothing but clears
    before t1's first session (its namespace does not exist yet), then t1's own blocks,
    never the shared cache's (the full-access tenant's prompts and token ids)."""
    server = make_server(TENANTS + POOL)
    publisher = Batches("p", tenant="t1")
    following(server, publisher)
    shared = _prompt(1)
    with KVCoordClient(server.address, timeout=10, token=ROOT) as root:
        sid, fence = attach(root)
        op = pb.AllocateOp(request=new_request("root-req", shared), num_new_tokens=9)
        assert not root.step("p", [pb.Operation(allocate=op)], sid, fence).results[0].status_code
    time.sleep(0.3)
    assert not [e for b in publisher.batches for e in b if not isinstance(e, AllBlocksCleared)]
    with KVCoordClient(server.address, timeout=10, token=T1) as t1:
        sid, fence = attach(t1)
        op = pb.AllocateOp(request=new_request("t1-req", _prompt(2)), num_new_tokens=9)
        assert not t1.step("p", [pb.Operation(allocate=op)], sid, fence).results[0].status_code
    time.sleep(0.3)
    stored = [e for b in publisher.batches for e in b if isinstance(e, BlockStored)]
    assert [tuple(e.token_ids) for e in stored] == [tuple(_prompt(2)[:8])]
    assert publisher.index() == set(hashes(_prompt(2)))


def _count_index(batches: list[list[KVCacheEvent]]) -> dict[bytes, int]:
    """docs/routing.md's apply(): a count of cached blocks per hash (KeyError on a
    removal of a hash it holds no block of, as there)."""
    index: dict[bytes, int] = {}
    for batch in batches:
        for e in batch:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    index[h] = index.get(h, 0) + 1
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    index[h] -= 1
                    if not index[h]:
                        del index[h]
            else:
                index.clear()
    return index


def test_after_a_gaps_clear_no_block_stored_before_it_is_removed(
    make_server: Callable[..., InProcessServer], following: Callable[[InProcessServer, Batches], None]
) -> None:
    """The events kept after a gap still remove blocks stored before its clear, which
    the subscriber dropped with it: docs/routing.md's count index raised KeyError on
    them (a Counter went negative, and hid the hash once stored again). Those removals
    are left out; the count index holds no block the pool does not cache, each hash
    at most as many times as the pool caches it."""
    server = make_server(POOL, limits=Limits(event_buffer=4))
    publisher = Batches("p")
    following(server, publisher)

    def alloc(rid: str, i: int) -> pb.Operation:
        return pb.Operation(allocate=pb.AllocateOp(request=new_request(rid, _prompt(i)), num_new_tokens=9))

    def free(rid: str) -> pb.Operation:
        return pb.Operation(free=pb.FreeOp(request_id=rid))

    with KVCoordClient(server.address, timeout=10) as client:
        sid, fence = attach(client)

        def step(ops: list[pb.Operation]) -> None:
            assert not any(r.status_code for r in client.step("p", ops, sid, fence).results)
            time.sleep(0.3)  # (the publisher has read the Step's events)

        step([alloc(f"a{i}", i) for i in range(2)])  # 4 cached blocks, sent
        step([free("a0"), free("a1")])
        step([alloc(f"b{i}", 10 + i) for i in range(3)])  # more events than kept: a gap
        assert publisher.gaps == ["p"]
        step([free(f"b{i}") for i in range(3)])
        for i in range(3):  # evicts the a-blocks left, one Step at a time (no gap)
            step([alloc(f"c{i}", 20 + i), free(f"c{i}")])
    assert publisher.gaps == ["p"]
    engine = server.running.servicer.registry.pools["p"].engine  # type: ignore[union-attr]
    cached: dict[bytes, int] = {}
    for key, ids in engine.block_pool.cached_block_hash_to_block.items():
        cached[key[:-4]] = cached.get(key[:-4], 0) + len(ids)  # (a key: the hash, then its group)
    index = _count_index(publisher.batches)
    assert all(0 < n <= cached.get(h, 0) for h, n in index.items()), (index, cached)
    assert index


def test_a_first_look_at_a_pool_whose_oldest_events_were_dropped_removes_no_unsent_block(
    make_server: Callable[..., InProcessServer], following: Callable[[InProcessServer, Batches], None]
) -> None:
    """The publisher first looks at a pool whose event buffer already dropped its oldest
    events (a restart, a pool that came to this replica or was created and used within
    the publisher's poll): the kept events it sends remove blocks stored before them,
    which no subscriber was sent by this publisher (docs/routing.md's count index
    raised KeyError on them: tests/cluster/test_kv_events_moved.py meets it over real
    replicas). The batch starts with a clear, those removals are left out, and the
    count index holds exactly the pool's map here (every block still cached was stored
    within the kept events)."""
    server = make_server(POOL, limits=Limits(event_buffer=8))
    with KVCoordClient(server.address, timeout=10) as client:
        sid, fence = attach(client)

        def step(ops: list[pb.Operation]) -> None:
            assert not any(r.status_code for r in client.step("p", ops, sid, fence).results)

        step([pb.Operation(allocate=pb.AllocateOp(request=new_request(f"a{i}", _prompt(i)), num_new_tokens=9))
              for i in range(4)])  # fmt: skip
        step([pb.Operation(free=pb.FreeOp(request_id=f"a{i}")) for i in range(4)])
        # evicts a0's and a1's blocks: 10 events in all, the buffer keeps the last 8
        step([pb.Operation(allocate=pb.AllocateOp(request=new_request(f"b{i}", _prompt(4 + i)), num_new_tokens=9))
              for i in range(2)])  # fmt: skip
    publisher = Batches("p")
    following(server, publisher)
    time.sleep(0.3)
    engine = server.running.servicer.registry.pools["p"].engine  # type: ignore[union-attr]
    cached: dict[bytes, int] = {}
    for key, ids in engine.block_pool.cached_block_hash_to_block.items():
        cached[key[:-4]] = cached.get(key[:-4], 0) + len(ids)  # (a key: the hash, then its group)
    assert _count_index(publisher.batches) == cached
    assert isinstance(publisher.batches[0][0], AllBlocksCleared)
