"""A prompt's tokens handed to the engine (HandedTokenIds, made by the server's long
sync reader) are kept as they are, not copied; any other list is copied; and a refused
registration keeps nothing of them."""

from __future__ import annotations

import pytest
from kvcoord.engine import (
    FullAttentionSpec,
    HandedTokenIds,
    InvalidArgumentError,
    KVCacheConfig,
    KVCachePool,
    TokenIds,
)


def _pool(max_model_len: int = 1 << 20) -> KVCachePool:
    return KVCachePool(
        KVCacheConfig(
            num_blocks=64, groups=(FullAttentionSpec(4),), hash_block_size=4, hash_length=8,
            max_model_len=max_model_len,
        )
    )  # fmt: skip


def test_handed_tokens_are_kept_without_a_copy() -> None:
    pool = _pool()
    handed = HandedTokenIds(range(10))
    pool.add_request("r", handed, [b"a" * 8, b"b" * 8])
    assert pool.requests["r"].all_token_ids is handed
    pool.update_request("r", append_token_ids=HandedTokenIds([10, 11]), append_block_hashes=[b"c" * 8])
    assert pool.requests["r"].all_token_ids == list(range(12))


@pytest.mark.parametrize("kind", [list, TokenIds])
def test_other_lists_are_copied(kind: type) -> None:
    pool = _pool()
    tokens = kind(range(10))
    pool.add_request("r", tokens, [b"a" * 8, b"b" * 8])
    assert pool.requests["r"].all_token_ids is not tokens
    assert pool.requests["r"].all_token_ids == list(range(10))


@pytest.mark.parametrize(
    ("hashes", "limit"), [([b"a" * 8], 1 << 20), ([b"a" * 7, b"b" * 8], 1 << 20), ([b"a" * 8, b"b" * 8], 9)]
)
def test_a_refused_registration_keeps_nothing(hashes: list[bytes], limit: int) -> None:
    pool = _pool(limit)
    with pytest.raises(InvalidArgumentError):
        pool.add_request("r", HandedTokenIds(range(10)), hashes)
    assert "r" not in pool.requests
