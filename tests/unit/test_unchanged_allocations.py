"""KVCachePool.allocation_changes_nothing: the claim a client makes for a decode step
inside its last block, which the server checks instead of applying the allocation.

The claim must hold exactly when the allocation would leave the pool as it is (no
block ids returned, the pool's whole observable state unchanged): a claim that holds
when the allocation would change something lets the server's copy drift from vLLM's,
and one that fails when nothing would change costs the client its requests.
"""

from __future__ import annotations

import random

import pytest
from kvcoord.engine import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaSpec,
    RequestNotFoundError,
    SlidingWindowSpec,
)
from support import Driver, toks

LAYOUTS = {
    "full4": (FullAttentionSpec(4),),
    "full4+sliding4w8": (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
    "full4+chunked4c8": (FullAttentionSpec(4), ChunkedLocalAttentionSpec(4, 8)),
    "full4+full8": (FullAttentionSpec(4), FullAttentionSpec(8)),
}


def allocate_and_compare(
    pool: KVCachePool, rid: str, num_new: int, lookahead: int
) -> tuple[bool, bool, object]:
    """(the claim, whether the allocation left the pool as it was with no ids, its answer)."""
    req = pool.requests[rid]
    claim = pool.allocation_changes_nothing(rid, req.num_computed_tokens, num_new, lookahead, req.num_tokens)
    before = pool.snapshot()
    new = pool.allocate_slots(rid, num_new, num_lookahead_tokens=lookahead)
    unchanged = new is not None and not any(new) and pool.snapshot() == before
    return claim, unchanged, new


@pytest.mark.parametrize("caching", [True, False], ids=["caching", "no-caching"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_the_claim_holds_exactly_when_the_allocation_changes_nothing(layout: str, caching: bool) -> None:
    """A scheduler-shaped loop (chunked prefills, decodes with and without lookahead,
    shared prefixes, preemption under memory pressure): before every allocation of a
    running request, the claim is compared with what the allocation then does."""
    rnd = random.Random(7)
    d = Driver(
        LAYOUTS[layout], num_blocks=48, enable_caching=caching, enable_kv_cache_events=True, max_model_len=200
    )
    prefixes = [[rnd.randrange(50) for _ in range(n)] for n in (5, 9, 16)]
    running: list[str] = []
    waiting: list[str] = []
    tokens: dict[str, list[int]] = {}
    seen = {True: 0, False: 0}
    for step in range(400):
        if rnd.random() < 0.4:
            rid = f"r{step}"
            tokens[rid] = rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randint(1, 20))]
            waiting.append(rid)
        budget = 24
        scheduled: list[tuple[str, int]] = []
        for rid in list(running):
            req = d.pool.requests[rid]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                n = 1  # drafts counted as computed ran ahead of the tokens (below)
            if n == 1 and rnd.random() < 0.2:
                # speculative decoding: drafts scheduled with the sampled token; they count
                # as computed before their tokens exist (computed may pass num_tokens)
                n += rnd.randint(1, 3)
            lookahead = rnd.choice((0, 0, 0, 2))
            claim, unchanged, new = allocate_and_compare(d.pool, rid, n, lookahead)
            assert claim == unchanged, (step, rid, n, lookahead, new)
            seen[claim] += 1
            if new is None:  # preempted (vLLM preempts from the end; any order will do here)
                d.pool.preempt(rid)
                running.remove(rid)
                waiting.insert(0, rid)
                continue
            budget -= n
            scheduled.append((rid, n))
        while waiting and budget > 0 and len(running) < 6:
            rid = waiting[0]
            if rid not in d.pool.requests:
                d.add(rid, tokens[rid])
            hit = d.hit(rid)
            n = min(d.pool.requests[rid].num_tokens - hit.num_tokens, budget)
            if d.pool.allocate_slots(rid, n, hit.num_tokens, hit) is None:
                break
            waiting.pop(0)
            running.append(rid)
            d.pool.update_request(rid, num_computed_tokens=hit.num_tokens)
            budget -= n
            scheduled.append((rid, n))
        for rid, n in scheduled:  # the model ran: computed tokens move, a token is sampled
            req = d.pool.requests[rid]
            computed = req.num_computed_tokens + n
            if computed < req.num_tokens:
                d.append(rid, [], computed)
            elif req.num_tokens - len(tokens[rid]) >= 12:  # finished
                d.pool.free(rid)
                running.remove(rid)
            else:
                if computed > req.num_tokens + 1 and rnd.random() < 0.5:
                    computed = req.num_tokens  # rejected drafts given back
                d.append(rid, [rnd.randrange(50)], computed)
    assert seen[True] > 100 and seen[False] > 100, seen


def test_a_decode_inside_its_last_block_changes_nothing() -> None:
    """Full attention, 4-token blocks: A holds 6 tokens in 2 blocks. Computing token 7
    (6 computed, 1 new) stays in block 2 and fills nothing: unchanged. Computing token 8
    fills block 2 (cached); computing token 9 needs a third block."""
    d = Driver((FullAttentionSpec(4),), num_blocks=10)
    d.add("A", toks(1, 6))
    assert d.pool.allocate_slots("A", 6) == ((1, 2),)
    d.append("A", [7], 6)
    assert d.pool.allocation_changes_nothing("A", 6, 1, 0, 7)
    assert not d.pool.allocation_changes_nothing("A", 6, 1, 2, 7)  # lookahead slots 8, 9: a third block
    d.append("A", [8], 7)
    assert not d.pool.allocation_changes_nothing("A", 7, 1, 0, 8)  # block 2 becomes full: cached
    assert d.pool.allocate_slots("A", 1) == ((),)
    assert d.pool.allocation_changes_nothing("A", 7, 1, 0, 8)  # already cached now
    assert not d.pool.allocation_changes_nothing("A", 8, 1, 0, 9)  # a third block
    assert not d.pool.allocation_changes_nothing("A", 6, 1, 0, 5)  # fewer tokens than the pool has
    assert not d.pool.allocation_changes_nothing("A", 7, 0, 0, 8)  # no new tokens: not an allocation


def test_a_block_leaving_the_window_is_a_change() -> None:
    """Sliding window 8 over 4-token blocks: skip(c) = c - 7 tokens. At 10 computed
    nothing leaves the window; at 11, block 0 does (the allocation nulls and frees it);
    once it is null, the same claim holds."""
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=20)
    d.add("A", toks(1, 14))
    assert d.pool.allocate_slots("A", 10) == ((1, 2, 3), (4, 5, 6))
    d.append("A", [], 10)
    assert d.pool.allocation_changes_nothing("A", 10, 1, 0, 14)
    d.append("A", [], 11)
    assert not d.pool.allocation_changes_nothing("A", 11, 1, 0, 14)
    assert d.pool.allocate_slots("A", 1) == ((), ())
    assert d.pool.get_block_ids("A")[1] == (0, 5, 6)
    assert d.pool.allocation_changes_nothing("A", 11, 1, 0, 14)


def test_mamba_pools_and_unknown_requests() -> None:
    """Mamba groups allocate by their own rules: no claim holds there. An unknown
    request is an error, as for allocate_slots."""
    pool = KVCachePool(
        KVCacheConfig(num_blocks=10, groups=(MambaSpec(4),), hash_block_size=4, enable_caching=False)
    )
    pool.add_request("A", toks(1, 6), [])
    assert pool.allocate_slots("A", 6) is not None
    pool.update_request("A", num_computed_tokens=6, append_token_ids=[7])
    assert not pool.allocation_changes_nothing("A", 6, 1, 0, 7)
    with pytest.raises(RequestNotFoundError):
        pool.allocation_changes_nothing("B", 0, 1, 0, 1)
