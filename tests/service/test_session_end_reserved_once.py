"""A session that ends holding many requests while routers' reservations are live (over
real gRPC): the blocks the reservations hold are read once per slice of the session's end (once a
slice, the pool held between slices: registry.END_SLICE_REQUESTS requests), not once
per request freed (engine ``free_abandoned``: a session of N requests and R reserved
blocks cost N passes over R), and the end is the same: every block only the session's
requests and the reservation held loses its cache entry."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from durable_server import small_pool
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine.reservations import Reservations
from kvcoord.service.registry import END_SLICE_REQUESTS
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate

POOL = small_pool(256)
REQUESTS = 40
HASHER_ARGS = ("sha256_cbor", 4)


def _hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher(*HASHER_ARGS, none_hash("sha256_cbor", "0")).extend(tokens)


def test_a_session_end_reads_the_reserved_blocks_once_a_slice(
    make_server: Callable[..., InProcessServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[int] = []
    plain = Reservations.held_blocks

    def counted(self: Reservations) -> dict[int, int]:
        reads.append(1)
        return plain(self)

    monkeypatch.setattr(Reservations, "held_blocks", counted)
    server = make_server(POOL)
    prompts = [[1000 * n + i for i in range(9)] for n in range(REQUESTS)]  # 2 full blocks each
    with KVCoordClient(server.address, timeout=10) as c:
        a = c.attach("p", "sha256_cbor", 4, "0", lease_seconds=20)
        for n, tokens in enumerate(prompts):
            got = c.allocate("p", allocate(f"a{n}", tokens, len(tokens)).allocate, a.session_id, a.fence)
            assert not got.result.refused
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=_hashes(prompts[0])
        )
        assert c.score_pools(9, [prompt], reserve_seconds=30.0).reservation.hit_tokens == 8
        reads.clear()
        c.detach(a.session_id, a.fence)
        slices = -(-REQUESTS // END_SLICE_REQUESTS)
        assert 1 <= len(reads) <= slices, (
            f"the reserved blocks were read {len(reads)} times for {REQUESTS} requests"
        )
        inspected = c.inspect_pool("p", include_cached_blocks=True)
        assert list(inspected.cached_block_ids) == []  # (the reservation kept none: it reads nothing)
        assert list(c.check_pool("p").violations) == []
