"""Differences the differential run against vLLM 0.33.0 (`bench/vs_vllm.py`, under
vLLM 0.33) found, each reduced to a small scenario on a `vllm-0.33` pool.

The expected answers are vLLM 0.33.0's: the same scenario run on its own
`KVCacheManager` (`tests/with_vllm/test_differential_033.py` runs it there and checks
that vLLM still gives these answers).
"""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.client.hashing import block_hasher, none_hash
from kvcoord.engine import (
    BlockStored,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

PROFILE = "vllm-0.33"

#: vLLM 0.33.0's answers to :func:`lookahead_round_down_scenario` (full16 + swa32 with a
#: 128-token window, 40 blocks, one look-ahead token): the admission's new blocks, per
#: BlockStored its group, hash count and look-ahead tokens, then after the free the
#: free queue's first 12 blocks and the free count
VLLM_LOOKAHEAD_ROUND_DOWN: dict[str, Any] = {
    "new": [[1, 2, 3, 4], [5, 6]],
    "stored": [(0, 3, ((1016,), (1032,), (1048,))), (1, 1, ((1032,),))],
    "free_queue_head": [6, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],
    "num_free": 39,
}


def lookahead_round_down_scenario(delayed: bool = False) -> dict[str, Any]:
    """A 64-token prompt admitted whole on a hybrid with 16-token hash blocks, a
    32-token scheduler block and one look-ahead token: 3 of its 4 blocks have a hash
    (the 4th needs token 64). vLLM rounds the 64 computed tokens down to the scheduler
    block first (64) and then stops at the hashed tokens (48), caching 3 blocks of the
    16-token group; rounding the hashed count down instead caches only 2. ``delayed``:
    the admission does not cache (``delay_cache_blocks``) and a ``cache_blocks`` of the
    64 tokens does (as vLLM's scheduler does after a speculative step's output)."""
    pool = KVCachePool(
        KVCacheConfig(
            num_blocks=40,
            groups=(FullAttentionSpec(16), SlidingWindowSpec(32, 128)),
            hash_block_size=16,
            enable_kv_cache_events=True,
            max_model_len=8192,
            profile=PROFILE,
            num_hash_lookahead_tokens=1,
            max_in_flight_tokens=2048,
            scheduler_block_size=32,
        )
    )
    prompt = list(range(1000, 1064))
    hasher = block_hasher(
        PROFILE,
        "sha256_cbor",
        16,
        none_hash("sha256_cbor", "0", profile=PROFILE),
        num_hash_lookahead_tokens=1,
    )
    pool.add_request("a", prompt, hasher.extend(prompt))
    hit = pool.get_computed_blocks("a")
    new = pool.allocate_slots(
        "a", 64, hit.num_tokens, hit, delay_cache_blocks=delayed, full_sequence_must_fit=True
    )
    assert new is not None
    if delayed:
        assert pool.take_events() == []
        pool.cache_blocks("a", 64)
    stored = [
        (e.group_idx, len(e.block_hashes), e.lookahead_token_ids)
        for e in pool.take_events()
        if isinstance(e, BlockStored)
    ]
    pool.free("a")
    return {
        "new": [list(x) for x in new],
        "stored": stored,
        "free_queue_head": pool.free_queue_head(12),
        "num_free": pool.num_free_blocks,
    }


@pytest.mark.parametrize("delayed", [False, True], ids=["allocate_slots", "cache_blocks"])
def test_lookahead_caching_rounds_down_before_stopping_at_the_hashes(delayed: bool) -> None:
    """The hybrid caches 3 blocks of the 16-token group, as vLLM does, so the block
    left without a hash (the 4th) is the only one freed to the queue's head."""
    assert lookahead_round_down_scenario(delayed) == VLLM_LOOKAHEAD_ROUND_DOWN


class _Pool033:
    """A ``vllm-0.33`` pool behind the call surface of bench/vs_vllm.py's sides (so the
    same scenario runs on vLLM 0.33.0's manager: tests/with_vllm/test_vs_vllm033.py)."""

    def __init__(self, groups: tuple[Any, ...], num_blocks: int, lookahead: int) -> None:
        self.pool = KVCachePool(
            KVCacheConfig(
                num_blocks=num_blocks,
                groups=groups,
                hash_block_size=16,
                enable_kv_cache_events=True,
                max_model_len=8192,
                profile=PROFILE,
                num_hash_lookahead_tokens=lookahead,
                max_in_flight_tokens=2048,
                scheduler_block_size=16,
                prefix_cache_retention_interval=0,
            )
        )
        none = none_hash("sha256_cbor", "0", profile=PROFILE)
        self.hasher = lambda: block_hasher(
            PROFILE, "sha256_cbor", 16, none, num_hash_lookahead_tokens=lookahead
        )
        self.hashers: dict[str, Any] = {}

    def add(self, rid: str, tokens: list[int]) -> None:
        self.hashers[rid] = self.hasher()
        self.pool.add_request(rid, tokens, self.hashers[rid].extend(tokens))

    def lookup(self, rid: str) -> tuple[Any, list[list[int]], int]:
        hit = self.pool.get_computed_blocks(rid)
        return hit, [list(x) for x in hit.block_ids], hit.num_tokens

    def admit(self, rid: str, n: int, hit_tokens: int, hit: Any, lookahead: int) -> list[list[int]] | None:
        out = self.pool.allocate_slots(rid, n, hit_tokens, hit, lookahead, full_sequence_must_fit=True)
        return None if out is None else [list(x) for x in out]

    def grow(self, rid: str, n: int, lookahead: int) -> list[list[int]] | None:
        out = self.pool.allocate_slots(rid, n, num_lookahead_tokens=lookahead)
        return None if out is None else [list(x) for x in out]

    def advance(self, rid: str, computed: int, appended: list[int]) -> None:
        hashes = self.hashers[rid].extend(appended)
        self.pool.update_request(
            rid, num_computed_tokens=computed, append_token_ids=appended, append_block_hashes=hashes
        )

    def cache_blocks(self, rid: str, computed: int) -> None:
        self.pool.cache_blocks(rid, computed)

    def step_start(self) -> None:
        self.pool.new_step_starts()

    def free(self, rid: str) -> None:
        self.pool.free(rid)

    def block_ids(self, rid: str) -> list[list[int]]:
        return [list(x) for x in self.pool.get_block_ids(rid)]

    def free_head(self, limit: int) -> list[int]:
        return self.pool.free_queue_head(limit)

    def num_free(self) -> int:
        return self.pool.num_free_blocks


def mamba_speculative_scenario(side: Any) -> list[Any]:
    """MTP on a mamba hybrid (full16 + mamba16 "align" with 2 speculative blocks, one
    look-ahead hash token, 40 blocks): request a's 40-token prompt in a block-aligned
    chunk of 32 and one of 8, then decode steps of one token and 2 drafts (2 look-ahead
    slots), some drafts accepted, ``cache_blocks`` after each output; request b, the same
    prompt, admitted on a's cached prompt boundary, decodes beside it; both freed. Every
    answer, block table, free count and the free queue's head is recorded. The
    speculative blocks move to the end of the mamba list as the running state crosses a
    block boundary; b's admission on a hit takes 1 + 2 new mamba blocks."""
    out: list[Any] = []
    rec = out.append
    prompt = list(range(1000, 1040))
    computed: dict[str, int] = {}
    accepted = iter([2, 0, 1, 2, 2, 0, 1, 2, 2, 2, 0, 1, 2, 2])

    def table() -> None:
        rec(
            (
                "blocks",
                {rid: side.block_ids(rid) for rid in sorted(computed)},
                side.free_head(8),
                side.num_free(),
            )
        )

    def decode(rid: str) -> None:
        rec(("grow", rid, side.grow(rid, 3, 2), side.num_free()))
        take = next(accepted)
        new_computed = computed[rid] + 1 + take
        side.advance(rid, new_computed, [2000 + new_computed + i for i in range(1 + take)])
        side.cache_blocks(rid, new_computed)
        computed[rid] = new_computed

    side.add("a", list(prompt))
    side.step_start()
    hit, ids, n = side.lookup("a")
    rec(("hit", "a", ids, n))
    rec(("admit", "a", side.admit("a", 32, n, hit, 2), side.num_free()))
    computed["a"] = 32
    side.advance("a", 32, [])
    table()
    side.step_start()
    rec(("grow", "a", side.grow("a", 8, 2), side.num_free()))
    computed["a"] = 40
    side.advance("a", 40, [3000])
    side.cache_blocks("a", 40)
    table()
    for _ in range(3):
        side.step_start()
        decode("a")
        table()
    side.add("b", list(prompt))
    side.step_start()
    decode("a")
    hit, ids, n = side.lookup("b")
    rec(("hit", "b", ids, n))
    rec(("admit", "b", side.admit("b", len(prompt) - n, n, hit, 2), side.num_free()))
    computed["b"] = len(prompt)
    side.advance("b", len(prompt), [3001])
    side.cache_blocks("b", len(prompt))
    table()
    for _ in range(4):
        side.step_start()
        decode("a")
        decode("b")
        table()
    side.free("a")
    del computed["a"]
    table()
    side.free("b")
    del computed["b"]
    table()
    return out


def _mamba_speculative_pool() -> _Pool033:
    return _Pool033((FullAttentionSpec(16), MambaSpec(16, MambaCacheMode.ALIGN, 2)), 40, 1)


#: vLLM 0.33.0's answers to :func:`mamba_speculative_scenario` (the scenario run on its own
#: KVCacheManager through bench/vs_vllm.py's ``VLLM033`` side, layout
#: ``[("full", {}), ("mamba_align", {})]``, 40 blocks, EAGLE/MTP on, caching on;
#: tests/with_vllm/test_vs_vllm033.py checks it still answers these)
VLLM_MAMBA_SPECULATIVE: list[Any] = [
    ("hit", "a", [[], []], 0),
    ("admit", "a", [[1, 2, 3], [0, 4, 5, 6]], 33),
    ("blocks", {"a": [[1, 2, 3], [0, 4, 5, 6]]}, [7, 8, 9, 10, 11, 12, 13, 14], 33),
    ("grow", "a", [[], [7]], 32),
    ("blocks", {"a": [[1, 2, 3], [0, 4, 5, 6, 7]]}, [8, 9, 10, 11, 12, 13, 14, 15], 32),
    ("grow", "a", [[], []], 33),
    ("blocks", {"a": [[1, 2, 3], [0, 0, 5, 6, 7]]}, [8, 9, 10, 11, 12, 13, 14, 15], 33),
    ("grow", "a", [[], []], 33),
    ("blocks", {"a": [[1, 2, 3], [0, 0, 5, 6, 7]]}, [8, 9, 10, 11, 12, 13, 14, 15], 33),
    ("grow", "a", [[8], []], 32),
    ("blocks", {"a": [[1, 2, 3, 8], [0, 0, 5, 6, 7]]}, [9, 10, 11, 12, 13, 14, 15, 16], 32),
    ("grow", "a", [[], [9]], 31),
    ("hit", "b", [[1, 2], [0, 4]], 32),
    ("admit", "b", [[10], [11, 12, 13]], 26),
    (
        "blocks",
        {"a": [[1, 2, 3, 8], [0, 0, 5, 6, 7, 9]], "b": [[1, 2, 10], [0, 4, 11, 12, 13]]},
        [14, 15, 16, 17, 18, 19, 20, 21],
        26,
    ),
    ("grow", "a", [[], []], 27),
    ("grow", "b", [[], []], 28),
    (
        "blocks",
        {"a": [[1, 2, 3, 8], [0, 0, 0, 6, 7, 9]], "b": [[1, 2, 10], [0, 0, 11, 12, 13]]},
        [5, 14, 15, 16, 17, 18, 19, 20],
        28,
    ),
    ("grow", "a", [[], []], 28),
    ("grow", "b", [[], []], 28),
    (
        "blocks",
        {"a": [[1, 2, 3, 8], [0, 0, 0, 6, 7, 9]], "b": [[1, 2, 10], [0, 0, 11, 12, 13]]},
        [5, 14, 15, 16, 17, 18, 19, 20],
        28,
    ),
    ("grow", "a", [[], []], 28),
    ("grow", "b", [[5], []], 27),
    (
        "blocks",
        {"a": [[1, 2, 3, 8], [0, 0, 0, 6, 7, 9]], "b": [[1, 2, 10, 5], [0, 0, 11, 12, 13]]},
        [14, 15, 16, 17, 18, 19, 20, 21],
        27,
    ),
    ("grow", "a", [[], []], 27),
    ("grow", "b", [[], [14]], 26),
    (
        "blocks",
        {"a": [[1, 2, 3, 8], [0, 0, 0, 6, 7, 9]], "b": [[1, 2, 10, 5], [0, 0, 11, 12, 13, 14]]},
        [15, 16, 17, 18, 19, 20, 21, 22],
        26,
    ),
    ("blocks", {"b": [[1, 2, 10, 5], [0, 0, 11, 12, 13, 14]]}, [9, 7, 6, 8, 15, 16, 17, 18], 31),
    ("blocks", {}, [14, 13, 12, 11, 5, 9, 7, 6], 39),
]


def test_mamba_speculative_blocks_allocate_and_relocate_like_vllm_033() -> None:
    """MTP on a mamba "align" hybrid: the 1 + 2 new mamba blocks of a first allocation
    and of an admission on a hit, the speculative blocks moved to the end of the list as
    the state crosses a block boundary, the state two steps back freed, every table and
    the free queue as vLLM 0.33.0 has them."""
    assert mamba_speculative_scenario(_mamba_speculative_pool()) == VLLM_MAMBA_SPECULATIVE
