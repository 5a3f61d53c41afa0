"""vLLM 0.33's sliding-window retention (``prefix_cache_retention_interval``) in the
vllm-0.33 profile: which window blocks get a hash, for one group and beside others.

The expected masks are vLLM 0.33.0's own: ``SlidingWindowManager.reachable_block_mask``
called with the same arguments in the 0.33.0 venv (no EAGLE shift); the differential
run against its whole manager is bench/vs_vllm.py (``LAYOUTS_033``, layouts ``swa16(w64)``,
``swa16(w16) r64``, ``... r64`` / ``r128`` / ``dense``).
"""

from __future__ import annotations

import pytest
from kvcoord.engine import (
    ConfigError,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)
from kvcoord.engine.coordinators import window_block_mask


@pytest.mark.parametrize(
    ("window", "block", "scheduler_block", "retention", "start", "end", "boundaries", "kept"),
    [
        # sparse: only the window's tail before the replay boundary (99 -> block 6)
        (32, 16, 16, 0, 0, 10, (99,), [4, 5]),
        # dense, the tail covers the scheduler block: every block
        (32, 16, 16, None, 0, 10, (99,), None),
        # periodic: a 2-block tail per 64 tokens, and the boundary's
        (32, 16, 16, 64, 0, 10, (99,), [2, 3, 4, 5, 6, 7]),
        # dense with a tail shorter than the scheduler block: the last block of each
        (16, 16, 32, None, 0, 12, (150,), [1, 3, 5, 7, 9, 11]),
        # periodic from a cached prefix, two boundaries rounded down to 32 tokens
        (16, 16, 32, 128, 2, 20, (150, 200), [7, 11, 15]),
        (64, 16, 32, 128, 0, 16, (250,), [4, 5, 6, 7, 10, 11, 12, 13, 14, 15]),
        (16, 16, 32, 0, 0, 12, (150,), [7]),
    ],
)
def test_window_masks_are_vllm_033s(
    window: int,
    block: int,
    scheduler_block: int,
    retention: int | None,
    start: int,
    end: int,
    boundaries: tuple[int, ...],
    kept: list[int] | None,
) -> None:
    mask = window_block_mask(window, block, scheduler_block, retention, start, end, boundaries)
    got = None if mask is None else [i for i, m in enumerate(mask, start) if m]
    assert got == kept


def _stored_blocks(
    groups: tuple[object, ...], retention: int | None, num_tokens: int
) -> list[tuple[int, int]]:
    """(group, block index) of every block hashed when one request of ``num_tokens``
    tokens is allocated and computed whole (block i's hash names i)."""
    pool = KVCachePool(
        KVCacheConfig(
            64,
            groups,
            16,
            enable_kv_cache_events=True,
            profile="vllm-0.33",
            prefix_cache_retention_interval=retention,
        )  # fmt: skip
    )
    pool.add_request("r", list(range(num_tokens)), [bytes([7, i]) * 16 for i in range(num_tokens // 16)])
    assert pool.allocate_slots("r", num_tokens) is not None
    return [
        (e.group_idx, h[1])
        for e in pool.take_events()
        if type(e).__name__ == "BlockStored"
        for h in e.block_hashes
    ]


@pytest.mark.parametrize(
    ("retention", "kept"),
    [(0, [4, 5]), (None, [0, 1, 2, 3, 4, 5]), (64, [2, 3, 4, 5])],
    ids=["sparse", "dense", "periodic"],
)
def test_one_window_group_hashes_what_its_retention_keeps(retention: int | None, kept: list[int]) -> None:
    """A pool of one sliding-window group (w 32, 16-token blocks), a 100-token request:
    vLLM 0.33's unitary coordinator hashes by the group's retention too (the pool had
    hashed all six full blocks whatever the retention, as 0.16 does)."""
    assert _stored_blocks((SlidingWindowSpec(16, 32),), retention, 100) == [(0, i) for i in kept]


def test_a_window_beside_full_attention_keeps_a_tail_per_interval() -> None:
    """Full attention hashes every block; the window (w 32) a 2-block tail per 64 tokens
    and the one before the replay boundary (159 -> block 9)."""
    stored = _stored_blocks((FullAttentionSpec(16), SlidingWindowSpec(16, 32)), 64, 160)
    assert [i for g, i in stored if g == 0] == list(range(10))
    assert [i for g, i in stored if g == 1] == [2, 3, 6, 7, 8]


def test_vllm_033s_rules_for_a_positive_interval() -> None:
    """As vLLM 0.33's coordinator: a positive interval needs a sliding-window (or mamba)
    group and a multiple of the scheduler block size; beside a mamba group it is not
    reproduced (refused)."""
    window = (FullAttentionSpec(16), SlidingWindowSpec(16, 32))
    with pytest.raises(ConfigError, match="no group is sliding window or mamba"):
        KVCacheConfig(
            8, (FullAttentionSpec(16),), 16, profile="vllm-0.33", prefix_cache_retention_interval=64
        )
    with pytest.raises(ConfigError, match="multiple of the scheduler block size 16"):
        KVCacheConfig(8, window, 16, profile="vllm-0.33", prefix_cache_retention_interval=40)
    with pytest.raises(ConfigError, match="beside a mamba group"):
        KVCacheConfig(
            8, (FullAttentionSpec(16), MambaSpec(16, MambaCacheMode.ALIGN)), 16, profile="vllm-0.33",
            prefix_cache_retention_interval=64,
        )  # fmt: skip
    KVCacheConfig(8, window, 16, profile="vllm-0.33", prefix_cache_retention_interval=64)
