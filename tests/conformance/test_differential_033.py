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
