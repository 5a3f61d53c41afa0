"""The vllm-0.33 profile's rules in the engine, against the vllm-0.16 default."""

from __future__ import annotations

import pytest
from kvcoord.engine import (
    ConfigError,
    FailedPreconditionError,
    FullAttentionSpec,
    HitBlockTakenError,
    InvalidArgumentError,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)


def pool(profile: str, caching: bool = True, num_blocks: int = 16) -> KVCachePool:
    return KVCachePool(
        KVCacheConfig(num_blocks, (FullAttentionSpec(16),), 16, enable_caching=caching, profile=profile)
    )


def hashes(n: int, salt: int = 0) -> list[bytes]:
    return [bytes([salt, i]) * 16 for i in range(n)]


@pytest.mark.parametrize(
    ("profile", "caching", "second"),
    [
        # vllm-0.33-differences.md §3: A (40 tokens) holds [1, 2, 3], blocks 1 and 2 full
        # and hashed, 3 partial; after free(A) the next request without a hit that
        # needs 2 blocks gets these ids.
        ("vllm-0.16", True, [4, 5]),
        ("vllm-0.33", True, [3, 4]),
        ("vllm-0.33", False, [3, 2]),
        ("vllm-0.16", False, [4, 5]),
    ],
)
def test_free_order(profile: str, caching: bool, second: list[int]) -> None:
    p = pool(profile, caching)
    p.add_request("a", list(range(40)), hashes(2) if caching else [])
    assert p.allocate_slots("a", 40) == ((1, 2, 3),)
    p.free("a")
    p.add_request("b", list(range(100, 132)), hashes(2, 1) if caching else [])
    assert p.allocate_slots("b", 32) == (tuple(second),)


def test_free_queue_head_lists_prepended_blocks_first() -> None:
    p = pool("vllm-0.33", caching=False, num_blocks=8)
    p.add_request("a", list(range(40)))
    p.allocate_slots("a", 40)
    p.free("a")
    assert p.free_queue_head() == [3, 2, 1, 4, 5, 6, 7]
    assert p.free_queue_head(2) == [3, 2]
    assert p.num_free_blocks == 7


def test_full_sequence_must_fit_refuses_and_changes_nothing() -> None:
    """The gate counts the whole prompt, not this step's chunk."""
    p = pool("vllm-0.33", num_blocks=5)  # 4 usable blocks
    p.add_request("r", list(range(80)), hashes(5))
    before = p.snapshot()
    assert p.allocate_slots("r", 16, full_sequence_must_fit=True) is None
    assert p.snapshot() == before
    assert p.allocate_slots("r", 16) == ((1,),)  # the chunk alone fits


def test_reserved_blocks_are_left_free() -> None:
    p = pool("vllm-0.33", num_blocks=5)
    p.add_request("r", list(range(48)), hashes(3))
    assert p.allocate_slots("r", 48, reserved_blocks=2) is None
    assert p.allocate_slots("r", 48, reserved_blocks=1) == ((1, 2, 3),)


def test_watermark_blocks_are_left_free_besides_reserved_ones() -> None:
    """vLLM 0.33's watermark (0.24.0): both admission checks need n + watermark blocks,
    the full-sequence gate without the reserved blocks, the step's check with them."""
    p = pool("vllm-0.33", num_blocks=6)  # 5 usable blocks
    p.add_request("r", list(range(48)), hashes(3))
    before = p.snapshot()
    assert p.allocate_slots("r", 16, full_sequence_must_fit=True, watermark_blocks=3) is None
    assert p.snapshot() == before
    assert p.allocate_slots("r", 16, watermark_blocks=4, reserved_blocks=1) is None
    assert p.allocate_slots("r", 16, full_sequence_must_fit=True, watermark_blocks=2, reserved_blocks=2) == (
        (1,),
    )
    p.add_request("s", list(range(100, 132)), hashes(2, 1))
    assert p.allocate_slots_with_lookup("s", 32, watermark_blocks=3).new_block_ids is None
    assert p.allocate_slots_with_lookup("s", 32, watermark_blocks=2).new_block_ids == ((2, 3),)


def test_statistics_count_admissions_in_033() -> None:
    """A lookup records nothing in vllm-0.33; record_prefix_cache_stats does."""
    p = pool("vllm-0.33")
    p.add_request("r", list(range(40)), hashes(2))
    p.get_computed_blocks("r")
    stats = p.peek_prefix_cache_stats()
    assert stats is not None and stats.requests == 0
    p.record_prefix_cache_stats("r", 0)
    stats = p.peek_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries, stats.hits) == (1, 40, 0)
    old = pool("vllm-0.16")
    old.add_request("r", list(range(40)), hashes(2))
    with pytest.raises(FailedPreconditionError, match="record_prefix_cache_stats is a vllm-0.33 call"):
        old.record_prefix_cache_stats("r", 0)


def test_with_lookup_counts_only_a_successful_admission_in_033() -> None:
    p = pool("vllm-0.33", num_blocks=3)
    p.add_request("big", list(range(80)), hashes(5))
    res = p.allocate_slots_with_lookup("big", 80, full_sequence_must_fit=True)
    assert res.new_block_ids is None
    stats = p.peek_prefix_cache_stats()
    assert stats is not None and stats.requests == 0
    p.add_request("small", list(range(20)), hashes(1, 1))
    assert p.allocate_slots_with_lookup("small", 20, full_sequence_must_fit=True).new_block_ids == ((1, 2),)
    stats = p.peek_prefix_cache_stats()
    assert stats is not None and (stats.requests, stats.queries) == (1, 20)


def test_016_refuses_033_inputs() -> None:
    p = pool("vllm-0.16")
    p.add_request("r", list(range(20)), hashes(1))
    with pytest.raises(InvalidArgumentError, match="vLLM 0.33 inputs"):
        p.allocate_slots("r", 20, full_sequence_must_fit=True)
    with pytest.raises(InvalidArgumentError, match="vLLM 0.33 inputs"):
        p.allocate_slots("r", 20, reserved_blocks=1)
    with pytest.raises(InvalidArgumentError, match="vLLM 0.33 inputs"):
        p.allocate_slots("r", 20, num_in_flight_tokens=1)
    with pytest.raises(InvalidArgumentError, match="vLLM 0.33 inputs"):
        p.allocate_slots("r", 20, watermark_blocks=1)


def test_common_prefix_blocks_are_zeros_in_033() -> None:
    """vLLM 0.32+ answers zeros (cascade attention was removed); 0.16 counts blocks."""
    answers = {}
    for profile in ("vllm-0.16", "vllm-0.33"):
        p = pool(profile)
        p.add_request("r", list(range(40)), hashes(2))
        p.allocate_slots("r", 40)
        answers[profile] = p.get_num_common_prefix_blocks("r")
    assert answers["vllm-0.16"] != (0,)
    assert answers["vllm-0.33"] == (0,)


def test_unknown_profile_and_unsupported_033_layouts() -> None:
    with pytest.raises(ConfigError, match="profile must be one of"):
        KVCacheConfig(4, (FullAttentionSpec(16),), 16, profile="vllm-0.17")
    with pytest.raises(
        ConfigError, match="does not support yet: group 1: EAGLE's trailing-block drop beside a mamba"
    ):
        KVCacheConfig(
            4,
            (FullAttentionSpec(16), MambaSpec(16, MambaCacheMode.ALIGN)),
            16,
            use_eagle=True,
            profile="vllm-0.33",
        )
    with pytest.raises(
        ConfigError, match="does not support yet: EAGLE's trailing-block drop together with look-ahead"
    ):
        KVCacheConfig(
            4, (FullAttentionSpec(16),), 16, use_eagle=True, profile="vllm-0.33", num_hash_lookahead_tokens=1
        )
    with pytest.raises(ConfigError, match="eagle_group_ids is a vLLM 0.33 field"):
        KVCacheConfig(4, (FullAttentionSpec(16),), 16, use_eagle=True, eagle_group_ids=(0,))
    with pytest.raises(ConfigError, match="eagle_group_ids must be distinct group ids below 1"):
        KVCacheConfig(
            4, (FullAttentionSpec(16),), 16, use_eagle=True, eagle_group_ids=(1,), profile="vllm-0.33"
        )
    # the drop on full attention and windows of the LCM's block: taken (bench/vs_vllm.py)
    KVCacheConfig(
        4, (FullAttentionSpec(16), SlidingWindowSpec(16, 64)), 16, use_eagle=True, profile="vllm-0.33"
    )
    with pytest.raises(ConfigError, match="scheduler_block_size 32 other than the LCM 16"):
        KVCacheConfig(
            4,
            (FullAttentionSpec(16), SlidingWindowSpec(16, 64)),
            16,
            profile="vllm-0.33",
            scheduler_block_size=32,
        )
    with pytest.raises(ConfigError, match="sink attention"):
        KVCacheConfig(4, (FullAttentionSpec(16, sink_len=16),), 16, profile="vllm-0.33")


def test_lookahead_hashes_lag_and_cap_caching() -> None:
    """With L = 1 a request has hashes only for blocks followed by a token, and only
    those blocks are cached (the block hashed last waits for the next token)."""
    cfg = KVCacheConfig(16, (FullAttentionSpec(16),), 16, profile="vllm-0.33", num_hash_lookahead_tokens=1)
    p = KVCachePool(cfg)
    with pytest.raises(InvalidArgumentError, match="expected 1 new block hashes"):
        p.add_request("r", list(range(32)), hashes(2))
    p.add_request("r", list(range(32)), hashes(1))
    p.allocate_slots("r", 32)
    assert p.estimate_cached_tokens("r") == 16
    p.update_request("r", num_computed_tokens=32, append_token_ids=[7], append_block_hashes=hashes(1, 9))
    p.cache_blocks("r", 32)
    assert p.estimate_cached_tokens("r") == 32
    with pytest.raises(ConfigError, match="needs the vllm-0.33 profile"):
        KVCacheConfig(16, (FullAttentionSpec(16),), 16, num_hash_lookahead_tokens=1)


def test_admission_cap_of_sliding_window_groups() -> None:
    """vLLM 0.33's full-sequence gate counts a sliding-window group up to its cap,
    cdiv(min(w - 1 + max_in_flight_tokens, max_model_len), block) blocks: a 160-token
    prompt needs 10 full-attention blocks plus at most 4 window blocks (w 32, 32 in
    flight), so 15 free blocks admit it, where counting the window whole (10) would not."""
    cfg = KVCacheConfig(
        16, (FullAttentionSpec(16), SlidingWindowSpec(16, 32)), 16, enable_caching=False,
        profile="vllm-0.33", max_in_flight_tokens=32,
    )  # fmt: skip
    p = KVCachePool(cfg)
    p.add_request("r", list(range(160)))
    assert p.get_num_blocks_to_allocate("r", 160, 0, 160) == 20
    assert p.get_num_blocks_to_allocate("r", 160, 0, 160, apply_admission_cap=True) == 14
    assert p.allocate_slots("r", 32, full_sequence_must_fit=True) is not None
    old = KVCachePool(KVCacheConfig(16, (FullAttentionSpec(16),), 16, enable_caching=False))
    old.add_request("r", list(range(16)))
    with pytest.raises(FailedPreconditionError, match="vllm-0.33 call"):
        old.get_num_blocks_to_allocate("r", 16, 0, 16)


def test_block_ids_for_computed_tokens_clip_each_group() -> None:
    p = pool("vllm-0.33")
    p.add_request("r", list(range(40)), hashes(2))
    p.allocate_slots("r", 40)
    assert p.get_block_ids_for_computed_tokens("r", 17) == ((1, 2),)
    assert p.get_block_ids_for_computed_tokens("r", 0) == ((),)


@pytest.mark.parametrize(("profile", "retention", "hashed"), [
    ("vllm-0.16", 0, list(range(10))),
    # vllm-0.33's sparse retention: the cdiv(w - 1, 16) = 2 window blocks ending at the
    # replay boundary (160 - 1 rounded down to 144: block 9) are hashed, no others
    ("vllm-0.33", 0, [7, 8]),
    ("vllm-0.33", None, list(range(10))),  # dense retention
])  # fmt: skip
def test_sliding_window_retention(profile: str, retention: int | None, hashed: list[int]) -> None:
    cfg = KVCacheConfig(
        64, (FullAttentionSpec(16), SlidingWindowSpec(16, 32)), 16, profile=profile,
        prefix_cache_retention_interval=retention,
    )  # fmt: skip
    p = KVCachePool(cfg)
    p.add_request("r", list(range(160)), hashes(10))
    p.allocate_slots("r", 160)
    full, window = p.get_block_ids("r")
    cached = set(p.cached_block_ids())
    assert [i for i, b in enumerate(full) if b in cached] == list(range(10))
    assert [i for i, b in enumerate(window) if b in cached] == hashed


def hybrid_033(caching: bool = True) -> KVCachePool:
    groups = (FullAttentionSpec(16), SlidingWindowSpec(16, 64))
    return KVCachePool(KVCacheConfig(24, groups, 16, enable_caching=caching, profile="vllm-0.33"))


@pytest.mark.parametrize("caching", [True, False])
def test_deferred_free_releases_all_groups_in_one_reversed_pass(caching: bool) -> None:
    """vLLM 0.33's deferred free (a KV-consumer connector with overlapping steps) pops
    every group's list and frees their concatenation reversed: the last group's tail
    first. A plain free goes group by group; both are compared with the rule here."""
    plain, deferred = hybrid_033(caching), hybrid_033(caching)
    for p in (plain, deferred):
        p.add_request("a", list(range(40)), hashes(2) if caching else [])
        table = p.allocate_slots("a", 40)
        assert table is not None and all(len(g) == 3 for g in table)
        before = p.free_queue_head()
    plain.free("a")
    deferred.free("a", all_groups_reversed=True)
    held = [b for g in table for b in g]
    # what each order leaves in the queue: the freed blocks' positions, by the rule
    freed_plain = [b for g in table for b in reversed(g)]
    freed_deferred = list(reversed(held))
    assert sorted(plain.free_queue_head()) == sorted(deferred.free_queue_head()) == sorted(before + held)

    def order(p: KVCachePool) -> list[int]:
        return [b for b in p.free_queue_head() if b in held]

    if caching:  # hashed blocks (0 and 1 of each group) to the tail, the partial ones to the head
        hashed = {g[0] for g in table} | {g[1] for g in table}
        assert [b for b in order(plain) if b in hashed] == [b for b in freed_plain if b in hashed]
        assert [b for b in order(deferred) if b in hashed] == [b for b in freed_deferred if b in hashed]
        assert order(plain) != order(deferred)
    else:  # every freed block goes to the head, in the order freed; per call for the plain free
        assert order(deferred) == freed_deferred
        assert order(plain) == [b for g in reversed(table) for b in reversed(g)]
    assert not deferred.has_request("a")


def test_deferred_free_is_a_033_call() -> None:
    p = pool("vllm-0.16")
    p.add_request("a", list(range(20)), hashes(1))
    p.allocate_slots("a", 20)
    with pytest.raises(FailedPreconditionError, match="vllm-0.33"):
        p.free("a", all_groups_reversed=True)
    assert p.has_request("a")


@pytest.mark.parametrize(("profile", "full", "window"), [
    # group by group (vLLM 0.16.0): the full group's external block would be the window
    # group's hit (block 2, at the queue's head and not touched yet), and block 2 would
    # end in both groups ((1, 2, 3) and (2, 4, 6): vLLM 0.16.0's own tables); the pool
    # refuses instead (full and window None: HitBlockTakenError, nothing changed)
    ("vllm-0.16", None, None),
    # vLLM 0.24+: every group's hit is touched first, then the external blocks taken
    ("vllm-0.33", (1, 4, 6), (2, 3, 5)),
])  # fmt: skip
def test_external_tokens_take_blocks_after_every_groups_hit_is_touched(
    profile: str, full: tuple[int, ...] | None, window: tuple[int, ...] | None
) -> None:
    """A KV connector's external tokens on a full + sliding-window pool: the free
    queue is [1, 2, 4, 3, 6, 5] and the request hits [1] and [2] (16 tokens) with 16
    external tokens after them. The vllm-0.33 answer is what vLLM 0.33.0's own
    KVCacheManager hands out for these calls (checked in its venv while writing this);
    vLLM 0.16.0's hands out block 2 twice, which a vllm-0.16 pool refuses
    (tests/unit/test_hit_block_taken.py). (vllm-0.33 was seen to hand out other ids than
    vLLM 0.33.0 with a connector, drafts and a sliding window: this rule.)"""
    groups = (FullAttentionSpec(16), SlidingWindowSpec(16, 64))
    cfg = KVCacheConfig(7, groups, 16, profile=profile, prefix_cache_retention_interval=None)
    p = KVCachePool(cfg)
    p.add_request("a", list(range(16)), hashes(1))
    assert p.allocate_slots("a", 16) == ((1,), (2,))
    p.add_request("c", list(range(100, 132)), hashes(2, 1))
    assert p.allocate_slots("c", 32) == ((3, 4), (5, 6))
    p.free("a")
    p.free("c")
    assert p.free_queue_head() == [1, 2, 4, 3, 6, 5]
    p.add_request("b", [*range(16), *range(200, 232)], [*hashes(1), *hashes(2, 2)])
    hit = p.get_computed_blocks("b")
    assert (hit.block_ids, hit.num_tokens) == (((1,), (2,)), 16)
    if full is None:
        with pytest.raises(HitBlockTakenError, match=r"block 2 \(group 1's hit\) by group 0"):
            p.allocate_slots("b", 16, 16, hit, num_external_computed_tokens=16)
        assert p.get_block_ids("b") == ((), ()) and p.free_queue_head() == [1, 2, 4, 3, 6, 5]
        return
    table = p.allocate_slots("b", 16, 16, hit, num_external_computed_tokens=16)
    assert table is not None
    assert p.get_block_ids("b") == (full, window)


@pytest.mark.parametrize(("num_prompt_tokens", "partial"), [(None, []), (20, [(1, 16)])])
def test_the_prompt_length_of_a_request_registered_again_places_its_partial_tail(
    num_prompt_tokens: int | None, partial: list[tuple[int, int]]
) -> None:
    """A request freed on preemption is registered again with its output tokens; vLLM
    0.33 keeps its prompt length, and with it the prompt's last hash boundary, where a
    32-token full-attention group registers a partial entry (hashes of 16 tokens). With
    ``num_prompt_tokens`` (the wire's RequestSync.num_prompt_tokens) the pool places it
    as vLLM: at 16 tokens for a 20-token prompt, not at 32 (a block edge: no entry)."""
    p = KVCachePool(
        KVCacheConfig(
            16, (FullAttentionSpec(16), FullAttentionSpec(32)), 16, profile="vllm-0.33",
            enable_kv_cache_events=True,
        )
    )  # fmt: skip
    p.add_request("r", list(range(40)), hashes(2), num_prompt_tokens=num_prompt_tokens)
    assert p.allocate_slots("r", 40) is not None
    stored = [(e.group_idx, e.block_size) for e in p.take_events() if type(e).__name__ == "BlockStored"]
    assert [s for s in stored if s[1] == 16 and s[0] == 1] == partial
    for bad in (0, 41):
        with pytest.raises(InvalidArgumentError, match="num_prompt_tokens"):
            p.add_request(f"bad{bad}", list(range(40)), hashes(2), num_prompt_tokens=bad)
