"""A first allocation with external (KV connector) tokens beside a mamba ``align`` group.

Adopting the external tokens takes one block of the mamba group (the state of the last
computed token) that vLLM's count (0.16.0 and 0.33.0 alike) leaves out. With exactly
one free block too few, vLLM takes blocks and then raises ``ValueError`` half way; the
pool raises :class:`UncountedBlocksError` before anything changes instead, and wherever
the free blocks cover that block too it allocates as before (the ids vLLM 0.16.0's and
0.33.0's own managers give: tests/with_vllm/test_mamba_external_vs_vllm.py).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import pytest
from kvcoord.engine import (
    ErrorStatus,
    FailedPreconditionError,
    KVCacheConfig,
    KVCachePool,
    UncountedBlocksError,
)
from kvcoord.engine.invariants import check_pool
from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec
from kvcoord.engine.state import export_state

PROFILES = ("vllm-0.16", "vllm-0.33")


def hashes(tokens: list[int], bs: int = 4) -> list[bytes]:
    out, prev = [], b""
    for i in range(len(tokens) // bs):
        prev = hashlib.sha256(prev + bytes(tokens[i * bs : (i + 1) * bs])).digest()
        out.append(prev)
    return out


def pool(
    num_blocks: int, profile: str = "vllm-0.16", spec: int = 0, ckpt: int = 0, mamba_first: bool = False
) -> KVCachePool:
    extra: dict[str, Any] = (
        {"num_prefill_checkpoint_blocks": 1, "prefill_checkpoint_alignment": ckpt} if ckpt else {}
    )
    mamba = MambaSpec(4, MambaCacheMode.ALIGN, spec, **extra)
    groups = (mamba, FullAttentionSpec(4)) if mamba_first else (FullAttentionSpec(4), mamba)
    more: dict[str, Any] = (
        {} if profile == "vllm-0.16" else {"profile": profile, "max_in_flight_tokens": 1024}
    )
    return KVCachePool(KVCacheConfig(num_blocks, groups, 4, max_model_len=64, **more))


def whole_state(p: KVCachePool) -> str:
    """Everything a refusal must leave as it was: the exported state (tables, free queue,
    cache, request records, mamba records, events, statistics), the refusal counter, the
    statistics not taken yet."""
    return json.dumps(
        [export_state(p), p.num_refusals, repr(p.peek_prefix_cache_stats())], sort_keys=True, default=repr
    )


@pytest.mark.parametrize("profile", PROFILES)
def test_one_block_too_few_is_a_typed_refusal_that_changes_nothing(profile: str) -> None:
    """The brief's case: 13 tokens, 1 external, 12 to compute; full attention takes 4
    blocks, the mamba group 2 (the external tokens' state, then the step's), 5 free."""
    p = pool(6, profile)
    tokens = list(range(13))
    p.add_request("a", tokens, hashes(tokens))
    before = whole_state(p)
    with pytest.raises(UncountedBlocksError) as err:
        p.allocate_slots("a", 12, 0, None, 0, 1)
    assert isinstance(err.value, FailedPreconditionError)
    assert err.value.status is ErrorStatus.FAILED_PRECONDITION
    assert err.value.reason == "UNCOUNTED_BLOCKS"
    assert "takes 6 blocks but only 5 are free; vLLM counts 5" in str(err.value)
    assert whole_state(p) == before
    assert check_pool(p).ok
    assert p.num_free_blocks == 5
    # the request is usable afterwards: a later free returns nothing it does not hold
    p.free("a")
    assert p.num_free_blocks == 5 and check_pool(p).ok


@pytest.mark.parametrize("profile", PROFILES)
def test_with_that_block_free_the_allocation_is_vllms(profile: str) -> None:
    """One block more and the allocation goes through, with vLLM's ids (0.16.0's and
    0.33.0's own managers answer ([3, 4, 5], [0, 0, 6]) and tables [1, 3, 4, 5],
    [2, 0, 0, 6]), and every block comes back on free."""
    p = pool(7, profile)
    tokens = list(range(13))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 12, 0, None, 0, 1) == ((3, 4, 5), (0, 0, 6))
    assert p.get_block_ids("a") == ((1, 3, 4, 5), (2, 0, 0, 6))
    assert p.num_free_blocks == 0
    assert check_pool(p).violations == ()
    p.free("a")
    assert p.num_free_blocks == 6 and check_pool(p).ok


def test_too_few_even_for_vllms_count_stays_a_refusal() -> None:
    """Below vLLM's own count the answer stays None (vLLM returns None), not an error."""
    p = pool(5)
    tokens = list(range(13))
    p.add_request("a", tokens, hashes(tokens))
    assert p.allocate_slots("a", 12, 0, None, 0, 1) is None
    assert p.get_block_ids("a") == ((), ()) and p.num_free_blocks == 4


def _first_allocation(
    profile: str,
    spec: int,
    ckpt: int,
    mamba_first: bool,
    keep: bool,
    prefix: int,
    length: int,
    ext: int,
    nb: int,
) -> tuple[KVCachePool, Any] | None:
    """A pool of ``nb`` blocks where request "p" computed (and, unless ``keep``, freed)
    the first ``prefix`` tokens, and request "a" of ``length`` tokens sharing them looks
    up its hit; None when the setup itself does not fit."""
    p = pool(nb, profile, spec, ckpt, mamba_first)
    tokens = list(range(1, length + 1))
    if prefix:
        p.add_request("p", tokens[:prefix], hashes(tokens[:prefix]))
        if p.allocate_slots("p", prefix) is None:
            return None
        if not keep:
            p.free("p")
        if profile == "vllm-0.33":
            p.new_step_starts()  # (a state cached this step is not adopted before the next)
    p.add_request("a", tokens, hashes(tokens))
    return p, p.get_computed_blocks("a")


CASES = [
    (profile, spec, ckpt, mamba_first, keep, prefix, length, ext)
    for (profile, spec, ckpt), mamba_first, (keep, prefix), length, ext in itertools.product(
        [
            ("vllm-0.16", 0, 0),
            ("vllm-0.16", 2, 0),
            ("vllm-0.33", 0, 0),
            ("vllm-0.33", 1, 1),
            ("vllm-0.33", 0, 4),
        ],
        (False, True),
        [(False, 0), (False, 8), (True, 8)],
        (9, 17),
        (1, 4, 5),
    )
    if prefix + ext < length
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_the_refusal_is_exactly_where_the_blocks_taken_exceed_the_free_ones(case: tuple[Any, ...]) -> None:
    """Over pool sizes, hits (held or evictable), speculative and prefill checkpoint
    blocks and either group order: the smallest pool that allocates takes exactly its
    free blocks' worth or fewer; one block smaller, the call is refused (None where
    vLLM's count refuses, else the typed error) with nothing changed."""
    profile, spec, ckpt, mamba_first, keep, prefix, length, ext = case
    outcomes = []
    for nb in range(2, 24):
        made = _first_allocation(profile, spec, ckpt, mamba_first, keep, prefix, length, ext, nb)
        if made is None:
            continue
        p, hit = made
        before, free = whole_state(p), p.num_free_blocks
        try:
            got = p.allocate_slots("a", length - hit.num_tokens - ext, hit.num_tokens, hit, 0, ext)
        except UncountedBlocksError:
            assert whole_state(p) == before
            outcomes.append("error")
            continue
        if got is None:
            outcomes.append("none")
            continue
        assert check_pool(p).violations == ()
        if outcomes and outcomes[-1] == "error":
            # refused one block short: here it takes every free block
            assert p.num_free_blocks == 0, (nb, free)
        outcomes.append("ok")
        break
    assert outcomes and outcomes[-1] == "ok", outcomes
    # at most one size refuses with the error (the one uncounted block), right below success
    assert outcomes.count("error") <= 1
    if "error" in outcomes:
        assert outcomes[-2] == "error"
