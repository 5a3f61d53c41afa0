"""Lists the server bounds by its max_ops_per_step (HUNTPRED3 leads 3 and 4): the waiting
manager's admission, a Free naming many requests, and a Step sent by a caller that
attached through its own client (blocking or asyncio) keep to the bound the Attach told
(old code: refused INVALID_ARGUMENT / RESOURCE_EXHAUSTED whole, at every attempt as long:
the caller never got past it)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvcoord.client import AsyncKVCoordClient, KVCoordClient, RemoteKVCacheManager
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from service.helpers import allocate
from support import NONE, POOL_TOML, Req, wire_pool_config

CAP = 4


def _req(rid: str, tokens: list[int]) -> Any:
    r = Req(rid, tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    return r


def _requests(c: KVCoordClient, pool: str) -> list[str]:
    return sorted(s.request_id for s in c.inspect_pool(pool, all_requests=True).requests)


def test_the_waiting_managers_admission_keeps_the_servers_max_ops_per_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A waiting queue of more short prompts than max_ops_per_step under one large token
    budget is admitted in AdmitOps of at most that many requests, answered as one call
    one by one would be (old code: one AdmitOp of all six, refused INVALID_ARGUMENT
    "ops[0].admit.requests is 6 items long", at every scheduler step)."""
    server = make_server(POOL_TOML, limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        waiting = [_req(f"r{i}", list(range(100 * i, 100 * i + 5))) for i in range(6)]
        got = m.admit(waiting, 1000)
        assert [(hit_tokens, n) for _, hit_tokens, n, _ in got] == [(0, 5)] * 6
        assert all(new is not None for *_, new in got)
        assert _requests(c, "p") == sorted(r.request_id for r in waiting)
        tables = {s.request_id: s for s in c.inspect_pool("p", all_requests=True).requests}
        # each request holds the blocks it was answered, no block held twice
        for r, (_, _, _, new) in zip(waiting, got, strict=True):
            assert new is not None
            assert [list(g.block_ids) for g in tables[r.request_id].groups] == [
                list(b) for b in new.get_block_ids()
            ]
        held = [b for s in tables.values() for g in s.groups for b in g.block_ids if b]
        assert len(held) == len(set(held))
        m.close()


def test_a_free_of_more_requests_than_max_ops_per_step_frees_them_all(
    make_server: Callable[..., InProcessServer],
) -> None:
    """``client.free`` naming six requests on a server taking four per call frees all six
    (sent as two Frees, in order) and answers the free count after both (old code: refused
    INVALID_ARGUMENT "request_ids is 6 items long" whole, at every retry)."""
    server = make_server(POOL_TOML, limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        waiting = [_req(f"r{i}", list(range(100 * i, 100 * i + 5))) for i in range(6)]
        for r in waiting:
            hit, hit_tokens = m.get_computed_blocks(r)
            assert m.allocate_slots(r, 5 - hit_tokens, hit_tokens, hit) is not None
        before = c.get_stats("p").num_free_blocks
        answer = c.free("p", [r.request_id for r in waiting], session_id=m.session_id, fence=m.keeper.fence)
        assert _requests(c, "p") == []
        assert answer.num_free_blocks == c.get_stats("p").num_free_blocks > before
        m.close()


def test_a_step_after_the_callers_own_attach_keeps_max_ops_per_step(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A caller of the blocking client that attaches itself (no manager) and sends a
    Step of six operations to a server taking four: the client learned the bound from
    the Attach and sends two Steps, answered as one (old code: learned only by a
    manager's session keeper; the Step refused RESOURCE_EXHAUSTED whole)."""
    server = make_server("", limits=Limits(max_ops_per_step=CAP))
    with KVCoordClient(server.address, timeout=10) as c:
        c.create_pool("w", wire_pool_config(64))
        s = c.attach("w", "sha256_cbor", 4, "0")
        ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(6)]
        got = c.step("w", ops, s.session_id, s.fence)
        assert [r.status_code for r in got.results] == [0] * 6
        assert len(_requests(c, "w")) == 6


def test_the_asyncio_client_keeps_max_ops_per_step(make_server: Callable[..., InProcessServer]) -> None:
    """The asyncio client learns max_ops_per_step at Attach as the blocking one: a Step
    of six operations and a Free of six requests on a server taking four are each sent
    as two calls and answered as one (old code: its step_piece_ops stayed 0 unless the
    caller set it; the Step refused RESOURCE_EXHAUSTED, the Free INVALID_ARGUMENT)."""
    server = make_server("", limits=Limits(max_ops_per_step=CAP))

    async def main() -> list[str]:
        async with AsyncKVCoordClient(server.address, timeout=10) as c:
            await c.create_pool("w", wire_pool_config(64))
            s = await c.attach("w", "sha256_cbor", 4, "0")
            ops = [allocate(f"r{i}", list(range(100 * i, 100 * i + 9)), 9) for i in range(6)]
            got = await c.step("w", ops, s.session_id, s.fence)
            assert [r.status_code for r in got.results] == [0] * 6
            inspected = await c.inspect_pool("w", all_requests=True)
            assert len(inspected.requests) == 6
            await c.free("w", [f"r{i}" for i in range(6)], session_id=s.session_id, fence=s.fence)
            left = await c.inspect_pool("w", all_requests=True)
            return [r.request_id for r in left.requests]

    assert asyncio.run(main()) == []
