"""A reservation is journaled: a server SIGKILLed while one is live recovers every
allocation made around it exactly, then releases it (a restart keeps no reservation)."""

from __future__ import annotations

import random
import time
from pathlib import Path

from durable_server import DurableServer
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb
from support import POOL_TOML

NONE = none_hash("sha256_cbor", "0")
PROMPT = [9000 + i for i in range(41)]


def _hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher("sha256_cbor", 4, NONE).extend(tokens)


def _admit(
    client: KVCoordClient, sid: str, fence: pb.Fence, rid: str, tokens: list[int]
) -> pb.AllocateResult:
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=tokens, append_block_hashes=_hashes(tokens), new_request=True
    )
    op = pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=True)
    return client.allocate("p", op, sid, fence).result


def _view(client: KVCoordClient) -> pb.InspectPoolResponse:
    return client.inspect_pool("p", free_queue_limit=1000, all_requests=True, include_cached_blocks=True)


def test_allocations_around_a_reservation_survive_sigkill(tmp_path: Path) -> None:
    """The prompt is cached and reserved, then allocations fill the pool (their blocks
    depend on the reservation: its blocks are not reused). After SIGKILL the server
    recovers (replaying the reservation, or the recorded answers would differ) with the
    same block tables, free queue and cached blocks; then it releases the reservation
    (GetStats: expired) and the pool's invariants hold."""
    server = DurableServer(tmp_path, POOL_TOML)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=10) as client:
            a = client.attach("p", "sha256_cbor", 4, "0")
            sid, fence = a.session_id, a.fence
            assert not _admit(client, sid, fence, "warm", PROMPT).refused
            client.free("p", ["warm"], session_id=sid, fence=fence)
            prompt = pb.HashedPrompt(
                hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=_hashes(PROMPT)
            )
            r = client.score_pools(len(PROMPT), [prompt], reserve_seconds=30.0)
            assert r.reservation.hit_tokens == 40
            rnd = random.Random(3)
            for i in range(40):
                tokens = [rnd.randrange(1000) for _ in range(rnd.randint(8, 30))]
                if _admit(client, sid, fence, f"r{i}", tokens).refused:
                    client.free("p", [f"r{i}"], session_id=sid, fence=fence)
                    break
            else:
                raise AssertionError("the pool never filled up")
            before = _view(client)
            assert client.get_stats("p").reservations.live == 1
        server.kill()
        server.start()
        with KVCoordClient(server.address, timeout=10) as client:
            after = _view(client)
            assert list(after.requests) == list(before.requests)
            assert list(after.cached_block_ids) == list(before.cached_block_ids)
            stats = client.get_stats("p").reservations
            for _ in range(100):  # the reaper runs every second
                if stats.live == 0:
                    break
                time.sleep(0.1)
                stats = client.get_stats("p").reservations
            assert (stats.live, stats.made, stats.expired) == (0, 1, 1)
            assert client.check_pool("p").violations == []
            assert client.find_longest_cache_hit("p", _hashes(PROMPT), len(PROMPT)).hit.num_tokens == 40
    finally:
        server.stop()
