"""RemoteKVCacheManager, the waiting mode, over real gRPC: every answer is the
server's (each call that needs one costs one Step), identical to the in-process
engine call for call, on a shared pool and on a pool it attached exclusively."""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any

import grpc
import pytest
import support
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb

BS = 4
NONE = none_hash("sha256_cbor", "0")


@dataclasses.dataclass
class Req(support.Req):
    """support's Req with its block hashes kept up to date, as vLLM's Request does."""

    block_hashes: list[bytes] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self._hasher = BlockHasher("sha256_cbor", BS, NONE)
        self.rehash()

    def rehash(self) -> None:
        have = len(self._hasher.token_ids)
        self._hasher.extend(self.all_token_ids[have:])
        self.block_hashes = list(self._hasher.block_hashes)


def pool_config(num_blocks: int, sliding: bool = False) -> pb.PoolConfig:
    groups = [pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))]
    if sliding:
        groups.append(
            pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=BS, sliding_window=16))
        )
    return pb.PoolConfig(num_blocks=num_blocks, hash_block_size=BS, hash_algo="sha256_cbor", hash_seed="0",
                         enable_caching=True, max_model_len=512, groups=groups, enable_kv_cache_events=True)  # fmt: skip


def local_pool(num_blocks: int, sliding: bool = False) -> KVCachePool:
    groups: tuple[Any, ...] = (FullAttentionSpec(BS),)
    if sliding:
        groups += (SlidingWindowSpec(BS, 16),)
    return KVCachePool(KVCacheConfig(num_blocks=num_blocks, groups=groups, hash_block_size=BS,
                                     max_model_len=512, enable_kv_cache_events=True))  # fmt: skip


@pytest.mark.parametrize("exclusive", [False, True], ids=["shared", "exclusive"])
@pytest.mark.parametrize("sliding", [False, True], ids=["full", "full+sliding"])
def test_every_answer_is_the_servers_and_equals_the_engine(
    client: KVCoordClient, exclusive: bool, sliding: bool
) -> None:
    """120 steps under memory pressure: each lookup and allocation costs exactly one
    Step (an exclusive session answers nothing ahead either), and every hit, refusal,
    block id, table and usage equals the in-process engine's."""
    name = f"waiting-{exclusive}-{sliding}"
    client.create_pool(name, pool_config(40, sliding))
    m = RemoteKVCacheManager(client, name, hash_seed="0", exclusive=exclusive)
    local = local_pool(40, sliding)
    rnd = random.Random(5)
    shared = [rnd.randrange(100) for _ in range(12)]
    running: list[Req] = []
    calls = 0
    try:
        for step in range(120):
            if len(running) < 6:
                r = Req(
                    f"r{step}",
                    shared[: rnd.randint(0, 12)] + [rnd.randrange(100) for _ in range(rnd.randint(1, 20))],
                )
                local.add_request(r.request_id, r.all_token_ids, list(r.block_hashes))
                trips = m.round_trips
                admitted = support.admit_on_both(m, local, r)
                assert m.round_trips == trips + 2
                calls += 2
                if admitted:
                    r.num_computed_tokens = len(r.all_token_ids)
                    running.append(r)
            for r in list(running):  # decode one token each; a refusal preempts the request
                r.all_token_ids.append(rnd.randrange(100))
                r.rehash()
                local.update_request(r.request_id, num_computed_tokens=r.num_computed_tokens,
                                     append_token_ids=r.all_token_ids[-1:],
                                     append_block_hashes=r.block_hashes[len(local.requests[r.request_id].block_hashes):])  # fmt: skip
                trips = m.round_trips
                got = m.allocate_slots(r, 1)
                exp = local.allocate_slots(r.request_id, 1)
                assert m.round_trips == trips + 1  # waited for, never promised
                calls += 1
                assert (got is None) == (exp is None)
                if got is None:
                    running.remove(r)
                    m.free(r)
                    local.free(r.request_id)
                    continue
                assert got.block_ids == tuple(list(g) for g in exp)
                r.num_computed_tokens += 1
            if running and rnd.random() < 0.3:
                done = running.pop(0)
                assert m.get_block_ids(done.request_id) == tuple(
                    list(g) for g in local.get_block_ids(done.request_id)
                )
                m.free(done)
                local.free(done.request_id)
            assert m.usage == pytest.approx(local.usage)
        assert m.lost_requests == 0 and calls > 300
    finally:
        m.close()


class _SlowSteps(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Holds every Step answer back ``delay`` seconds before the caller sees it."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.steps = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        answer = continuation(details, request)
        if details.method.endswith("/Step"):
            self.steps += 1
            time.sleep(self.delay)
        return answer


def test_round_trip_seconds_count_the_time_spent_waiting_on_steps(server: InProcessServer) -> None:
    """``round_trip_seconds`` grows by the wait of each Step round trip (here each
    answer is held back 50 ms), and ``round_trips`` counts every Step sent."""
    slow = _SlowSteps(0.05)
    with KVCoordClient(
        server.address, timeout=10, interceptors=[slow], step_stream=False
    ) as c:  # (unary Steps)
        c.create_pool("timed", pool_config(64))
        m = RemoteKVCacheManager(c, "timed", hash_seed="0", exclusive=True)
        try:
            r = Req("t0", list(range(40)))
            assert m.allocate_slots(r, 40) is not None
            r.num_computed_tokens = 40
            assert slow.steps == m.round_trips == 1
            assert m.round_trip_seconds >= 0.05
            waited = m.round_trip_seconds
            r.all_token_ids.append(7)
            r.rehash()
            assert m.allocate_slots(r, 1) is not None
            assert slow.steps == m.round_trips == 2
            assert m.round_trip_seconds >= waited + 0.05
        finally:
            m.close()


def test_evicted_blocks_are_reported_in_the_callers_order(client: KVCoordClient) -> None:
    """vLLM's block pool evicts the blocks of the set it is given in the set's iteration
    order, and their BlockRemoved events follow it: the manager keeps that order."""
    client.create_pool("evict-order", pool_config(40))
    m = RemoteKVCacheManager(client, "evict-order", hash_seed="0", exclusive=True)
    local = local_pool(40)
    try:
        for i in range(6):
            r = Req(f"e{i}", [i * 50 + j for j in range(8)])
            local.add_request(r.request_id, r.all_token_ids, r.block_hashes)
            assert m.allocate_slots(r, 8).block_ids == tuple(
                list(g) for g in local.allocate_slots(r.request_id, 8)
            )
        m.take_events()
        local.take_events()
        ids = {9, 2}
        assert list(ids) != sorted(ids)  # the set's order is not ascending
        local.evict_blocks(ids)
        m.evict_blocks(ids)
        m.flush()
        want = [e.block_hashes[0] for e in local.take_events()]
        got = [e.block_removed.block_hashes[0] for e in m.take_events()]
        assert len(want) == 2 and got == want
    finally:
        m.close()
