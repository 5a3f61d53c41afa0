"""``RemoteKVCacheManager.allocate_with_lookup`` (README: "does both atomically") over real
gRPC answers what ``get_computed_blocks`` then ``allocate_slots`` for ``min(remaining,
max_num_new_tokens)`` answer on a second server fed the same requests: the same hit, the
same tokens scheduled, the same new block ids, the same refusal when the pool is out of
blocks, and the same free count after every call (it had no test: shrink's review)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.testing import InProcessServer
from support import NONE, POOL_TOML, Req


def _req(rid: str, tokens: list[int]) -> Any:
    r = Req(rid, tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    return r


def _blocks(ids: Any) -> list[list[int]] | None:
    return None if ids is None else [list(g) for g in ids.get_block_ids()]


# (request id, prompt, max_num_new_tokens): a first prompt, a second sharing its first
# three blocks, one capped by the budget, one too large for the pool's 64 blocks of 4
# (two groups), then one that fits again
_STEPS = [
    ("a", list(range(20)), 1000),
    ("b", list(range(12)) + list(range(500, 508)), 1000),
    ("c", list(range(16)) + list(range(900, 930)), 10),
    ("big", list(range(2000, 2000 + 4 * 64)), 1000),
    ("d", list(range(8)) + [7, 7, 7], 1000),
]


def test_allocate_with_lookup_answers_as_a_lookup_then_an_allocation(
    make_server: Callable[..., InProcessServer],
) -> None:
    atomic, twostep = make_server(POOL_TOML), make_server(POOL_TOML)
    with KVCoordClient(atomic.address, timeout=10) as ca, KVCoordClient(twostep.address, timeout=10) as cb:
        ma = RemoteKVCacheManager(ca, "p", hash_seed="0", renew=False)
        mb = RemoteKVCacheManager(cb, "p", hash_seed="0", renew=False)
        hits, refused = 0, 0
        for rid, prompt, cap in _STEPS:
            hit, hit_tokens, scheduled, new = ma.allocate_with_lookup(_req(rid, prompt), cap)

            r = _req(rid, prompt)
            ref_hit, ref_tokens = mb.get_computed_blocks(r)
            ref_scheduled = min(len(prompt) - ref_tokens, cap)
            ref_new = mb.allocate_slots(r, ref_scheduled, ref_tokens, ref_hit)

            assert (hit_tokens, scheduled) == (ref_tokens, ref_scheduled), rid
            assert _blocks(hit) == _blocks(ref_hit), rid
            assert _blocks(new) == _blocks(ref_new), rid
            assert ca.get_stats("p").num_free_blocks == cb.get_stats("p").num_free_blocks, rid
            hits += hit_tokens > 0
            refused += new is None
        # the sequence exercised a hit and a refusal, not only fresh prompts
        assert hits >= 2 and refused == 1
        # both servers hold the same tables; the refused request holds no block
        tables = [
            {
                s.request_id: [list(g.block_ids) for g in s.groups]
                for s in c.inspect_pool("p", all_requests=True).requests
            }
            for c in (ca, cb)
        ]
        assert tables[0] == tables[1]
        assert not any(b for g in tables[0].get("big", []) for b in g)
        assert {"a", "b", "c", "d"} <= set(tables[0])
        ma.close()
        mb.close()
