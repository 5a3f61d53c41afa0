"""KVCachePool.update_and_allocate: the same answers and state as update_request then
allocate_slots without a hit (the mirror's call for a running request's step)."""

from __future__ import annotations

import random

import pytest
from kvcoord.engine import FullAttentionSpec, InvalidArgumentError, SlidingWindowSpec
from support import Driver


@pytest.mark.parametrize(
    "specs", [(FullAttentionSpec(4),), (FullAttentionSpec(4), SlidingWindowSpec(4, sliding_window=8))]
)
def test_fused_step_equals_the_two_calls(specs: tuple[object, ...]) -> None:
    """Random decode and chunk steps (refusals included, the pool being small) leave
    both pools with the same answers, tables, free counts and events."""
    rnd = random.Random(7)
    two, fused = (Driver(specs, num_blocks=40, enable_kv_cache_events=True) for _ in range(2))
    lengths: dict[str, int] = {}
    for i in range(6):
        tokens = [rnd.randrange(50) for _ in range(rnd.randint(3, 12))]
        for d in (two, fused):
            d.add(f"r{i}", tokens)
        lengths[f"r{i}"] = len(tokens)
    computed = dict.fromkeys(lengths, 0)
    answers = {"refused": 0, "blocks": 0, "none": 0}
    for _ in range(300):
        rid = rnd.choice(sorted(lengths))
        new_tokens = [rnd.randrange(50) for _ in range(rnd.choice((0, 1, 1, 3)))]
        n = rnd.randint(1, 6)
        look = rnd.choice((0, 0, 2))
        hashes = fused.hashers[rid].extend(new_tokens)
        assert two.hashers[rid].extend(new_tokens) == hashes
        done = computed[rid]
        two.pool.update_request(
            rid, num_computed_tokens=done, append_token_ids=new_tokens, append_block_hashes=hashes
        )
        want = two.pool.allocate_slots(rid, n, 0, None, look)
        got = fused.pool.update_and_allocate(rid, done, new_tokens, hashes, n, look)
        assert got == want
        answers["refused" if got is None else "blocks" if any(got) else "none"] += 1
        lengths[rid] += len(new_tokens)
        if got is not None:
            computed[rid] = min(done + n, lengths[rid])
        assert fused.pool.get_block_ids(rid) == two.pool.get_block_ids(rid)
        assert fused.pool.num_free_blocks == two.pool.num_free_blocks
        assert fused.pool.take_events() == two.pool.take_events()
        if rnd.random() < 0.05:
            for d in (two, fused):
                d.pool.free(rid)
            fused.hashers[rid].truncate(0)
            two.hashers[rid].truncate(0)
            del lengths[rid], computed[rid]
            rid = f"n{rnd.randrange(10**6)}"
            tokens = [rnd.randrange(50) for _ in range(rnd.randint(3, 12))]
            for d in (two, fused):
                d.add(rid, tokens)
            lengths[rid], computed[rid] = len(tokens), 0
    assert all(answers.values()), answers  # refusals, new blocks and steps inside a block
    assert fused.pool.requests.keys() == two.pool.requests.keys()
    for rid, req in fused.pool.requests.items():
        other = two.pool.requests[rid]
        assert (req.all_token_ids, req.block_hashes, req.num_computed_tokens) == (
            other.all_token_ids, other.block_hashes, other.num_computed_tokens,
        )  # fmt: skip


def test_a_refused_update_or_allocation_changes_nothing() -> None:
    """A bad token, and an allocation past max_model_len, raise with the request as it was."""
    d = Driver((FullAttentionSpec(4),), num_blocks=40)
    d.add("a", [1, 2, 3, 4, 5])
    assert d.pool.allocate_slots("a", 5) == ((1, 2),)
    req = d.pool.requests["a"]
    before = (list(req.all_token_ids), list(req.block_hashes), req.num_computed_tokens)
    with pytest.raises(InvalidArgumentError):
        d.pool.update_and_allocate("a", 5, [-1], [], 1)
    big = d.pool.max_model_len
    with pytest.raises(InvalidArgumentError):
        d.pool.update_and_allocate("a", 5, [6], [], big)
    assert (list(req.all_token_ids), list(req.block_hashes), req.num_computed_tokens) == before
    assert d.pool.get_block_ids("a") == ((1, 2),)
