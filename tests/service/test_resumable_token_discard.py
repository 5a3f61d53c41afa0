"""vLLM 0.33's resumable (streaming-input) requests discard their last sampled token
when the next input chunk arrives (``Scheduler._update_request_as_session``): in place,
``del _all_token_ids[keep_end:]`` (keep_end = num_tokens - 1, never computed), ``del
block_hashes[keep_end // hash_block_size:]``, then the chunk's tokens appended and the
hashes of the blocks now full computed again. The request keeps its blocks.

Between the token's append and that cut, vLLM's ``update_from_output`` calls
``cache_blocks(request, num_computed_tokens - num_in_flight_tokens)`` (async scheduling
or speculative decoding): kvcoord's managers sync the request there (the waiting one
always, the predicting one when a block became full, here the accepted drafts'), so the
discarded token and, when it filled a block, that block's hash reach the pool (and the
predicting client's mirror: mirror and server agree, nothing is compared wrong). The cut is not
seen (the request's token and hash lists are read from their sent length on), so the
pool keeps the discarded token's hash for the block and caches the block under it once
the chunk's first token is computed there: a later prompt that continues with the
discarded token is a hit on a block holding another token's KV, no error. vLLM's own
manager caches the block under the new hash: vLLM 0.33.0's KVCacheManager, driven
through this very flow with vLLM's Request (append_output_token_ids, the same cut and
update_block_hashes), hands out the same block ids and answers the later prompt a
4-token hit ([1]) where both kvcoord managers answer an 8-token one ([1, 2]).

Found by the HUNTPRED hunt; fixed: the tracker sees the cut at the next sync (the last
token or hash it sent changed) and rewinds the request to its computed tokens
(``RequestSync.rewind_num_tokens``), which the pool and the mirror apply by vLLM's rule
(tokens past it, hashes from its block on dropped) before the chunk's are appended."""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.vllm033 import Predicting033KVCacheManager, Remote033KVCacheManager
from kvcoord.service.testing import InProcessServer
from support import NONE, Req, wire_pool_config
from unit.test_client_fast_paths import _View  # vLLM's ConstantList

HASH_BLOCK = 4


def _request(rid: str, tokens: list[int]) -> Any:
    r: Any = Req(rid, _View(list(tokens)))  # type: ignore[arg-type]
    r.block_hashes = []
    _update_block_hashes(r)
    return r


def _update_block_hashes(r: Any) -> None:
    """vLLM's Request.update_block_hashes: the hashes of the full blocks not hashed yet."""
    hasher = BlockHasher("sha256_cbor", HASH_BLOCK, NONE)
    every = hasher.extend(list(r.all_token_ids._x))
    r.block_hashes.extend(every[len(r.block_hashes) :])


@pytest.mark.parametrize("mode", ["waiting", "predicted"])
def test_a_discarded_streaming_token_leaves_no_hit_on_the_block_that_held_it(
    server: InProcessServer, client: KVCoordClient, mode: str
) -> None:
    config = wire_pool_config(32)
    config.profile, config.max_model_len = "vllm-0.33", 256
    client.create_pool("resumable", config)
    m: Any = (
        Remote033KVCacheManager(client, "resumable", hash_seed="0", renew=False, exclusive=True)
        if mode == "waiting"
        else Predicting033KVCacheManager(client, "resumable", hash_seed="0", renew=False)
    )
    # chunk 1: a 3-token prompt computed with 5 draft tokens; 4 drafts are accepted
    # (positions 3-6 computed) and the bonus token 17 is sampled at position 7: it stops
    r = _request("r", [10, 11, 12])
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 3, n, hit, 5) is not None
    r.num_computed_tokens = 7
    r.all_token_ids._x.extend([13, 14, 15, 16, 17])  # Request.append_output_token_ids
    _update_block_hashes(r)
    m.cache_blocks(r, 7)  # update_from_output, before the stop is handled
    m.take_events()
    # the turn stops; chunk 2 arrives: 17 is discarded, [50, 51] appended (in place)
    keep_end = len(r.all_token_ids) - 1
    del r.all_token_ids._x[keep_end:]
    del r.block_hashes[keep_end // HASH_BLOCK :]
    r.all_token_ids._x.extend([50, 51])
    _update_block_hashes(r)
    # the request resumes on its blocks: positions 7 and 8 computed (50's KV at 7)
    assert m.allocate_slots(r, 2) is not None
    r.num_computed_tokens = 9
    m.take_events()
    # a prompt continuing with the discarded 17 may hit block 0 only (4 tokens), as
    # under vLLM's own manager: the block holding position 7 holds 50's KV
    q = _request("q", [10, 11, 12, 13, 14, 15, 16, 17, 99])
    hit, n = m.get_computed_blocks(q)
    assert n == 4, (hit.block_ids, n)
    m.close()
