"""vLLM 0.33's fine-grained (partial) prefix hits with copy-on-write, in the engine.

Layout: full attention (block 32) + mamba "align" (block 32), hash block 16, prefix
caching on, sparse retention: vLLM 0.33 enables partial hash hits there.

How the expected ids were obtained: vLLM 0.33.0's own ``KVCacheManager`` (its venv,
``/var/cache/kvcoord/vllm033-venv/bin/python``) was built with this layout (24 blocks,
``scheduler_block_size`` 32, ``hash_block_size`` 16, ``max_in_flight_tokens`` 256, events
on) and driven with the calls below (``get_computed_blocks``, ``allocate_slots`` with
``full_sequence_must_fit``, ``new_step_starts`` then ``take_kv_cache_block_copies`` after
each call, ``block_pool.free_blocks`` of the retained blocks, ``free``); every id,
reference count and free-queue order asserted here is what it printed. The requests'
token ids are the same; only the hash function differs (ids do not depend on it).
The differential run ``tests/with_vllm/test_mamba033_engine.py`` (case ``align-partial``)
compares such sequences call by call against vLLM itself.
"""

from __future__ import annotations

import hashlib

import pytest
from kvcoord.engine import KVCacheConfig, KVCachePool
from kvcoord.engine.errors import BlockNotRetainedError, ConfigError
from kvcoord.engine.invariants import check_pool
from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec, SlidingWindowSpec

HBS = 16
P = list(range(1, 57))  # 56 tokens: its last hash boundary below the end is 48
B_TOKENS = P + list(range(500, 524))  # 80 tokens


def pool(num_blocks: int = 24) -> KVCachePool:
    cfg = KVCacheConfig(
        num_blocks, (FullAttentionSpec(32), MambaSpec(32, MambaCacheMode.ALIGN)), HBS,
        profile="vllm-0.33", max_model_len=1024, max_in_flight_tokens=256, enable_kv_cache_events=True,
    )  # fmt: skip
    assert cfg.partial_hash_hits
    return KVCachePool(cfg)


def hashes(tokens: list[int]) -> list[bytes]:
    return [
        hashlib.sha256(repr(tokens[: (i + 1) * HBS]).encode()).digest() for i in range(len(tokens) // HBS)
    ]


def refs(p: KVCachePool, ids: list[int]) -> list[int]:
    return [p.block_pool.blocks[b].ref_cnt for b in ids]


def ok(p: KVCachePool) -> None:
    assert check_pool(p).violations == ()


def drain(p: KVCachePool) -> tuple[list[tuple[int, int]], list[int]]:
    p.new_step_starts()
    return p.take_kv_cache_block_copies()


def admit(p: KVCachePool, rid: str, tokens: list[int], first_chunk: int) -> tuple[object, object]:
    """Lookup, then the admission of ``first_chunk - hit`` tokens (vLLM's scheduler)."""
    p.add_request(rid, tokens, hashes(tokens))
    hit = p.get_computed_blocks(rid)
    new = p.allocate_slots(
        rid, first_chunk - hit.num_tokens, hit.num_tokens, hit, full_sequence_must_fit=True
    )
    p.update_request(rid, num_computed_tokens=first_chunk)
    return hit, new


def test_a_producer_tail_moves_and_a_waiting_hit_copies_its_tail_like_vllm_033() -> None:
    p = pool()
    # A: 56 tokens, chunked at 48 (its last hash boundary): partial keys at 48 on the
    # attention block 2 and the state block 3
    hit, new = admit(p, "A", P, 48)
    assert (hit.block_ids, hit.num_tokens) == (((), ()), 0)
    assert new == ((1, 2), (0, 3))
    assert [(type(e).__name__, e.block_size, len(e.block_hashes)) for e in p.take_events()] == [
        ("BlockStored", 32, 1), ("BlockStored", 16, 1), ("BlockStored", 32, 0), ("BlockStored", 16, 1),
    ]  # fmt: skip
    assert drain(p) == ([], [])
    ok(p)
    # A's next chunk: the mamba key at 48 moves to a new block 4, A keeps writing 3
    assert p.allocate_slots("A", 8) == ((), ())
    p.update_request("A", num_computed_tokens=56)
    ok(p)
    assert drain(p) == ([(3, 4)], [3, 4])
    assert refs(p, [3, 4]) == [2, 1]
    assert p.take_events() == []
    ok(p)
    p.release_retained_blocks([3, 4])
    assert refs(p, [3, 4]) == [1, 0]
    assert p.free_queue_head(None) == [*range(5, 24), 4]
    ok(p)
    # B: 80 tokens, hits 48 (attention [1, 2], mamba [null, 4]); its admission copies
    # both tails into new blocks 5 and 6, drawn first, group by group
    hit, new = admit(p, "B", B_TOKENS, 64)
    assert (hit.block_ids, hit.num_tokens) == (((1, 2), (0, 4)), 48)
    assert new == ((5,), (6,))
    assert p.get_block_ids("B") == ((1, 5), (0, 6))
    assert [(type(e).__name__, e.block_size, len(e.block_hashes)) for e in p.take_events()] == [
        ("BlockStored", 32, 1), ("BlockStored", 32, 1),
    ]  # fmt: skip
    ok(p)
    assert drain(p) == ([(2, 5), (4, 6)], [2, 5, 4, 6])
    assert refs(p, [2, 5, 4, 6]) == [2, 2, 1, 2]
    assert p.num_free_blocks == 17
    assert p.allocate_slots("B", 16) == ((7,), (8,))
    p.update_request("B", num_computed_tokens=80)
    assert drain(p) == ([], [])
    assert p.num_free_blocks == 15
    ok(p)
    # B freed before its copies' blocks are released: they stay referenced
    p.free("B")
    assert refs(p, [2, 5, 4, 6]) == [2, 1, 1, 1]
    assert p.free_queue_head(None) == [8, 7, *range(9, 24)]
    ok(p)
    p.release_retained_blocks([2, 5, 4, 6])
    assert p.free_queue_head(None) == [8, 7, *range(9, 24), 5, 4, 6]
    ok(p)
    # the copies were cached whole: the same 80 tokens hit 64
    hit, new = admit(p, "B2", B_TOKENS, 80)
    assert (hit.block_ids, hit.num_tokens) == (((1, 5), (0, 6)), 64)
    assert new == ((8,), (7,))
    assert drain(p) == ([], [])
    assert p.num_free_blocks == 16
    ok(p)


def test_a_release_of_a_block_not_retained_changes_nothing() -> None:
    p = pool()
    admit(p, "A", P, 48)
    assert p.allocate_slots("A", 8) == ((), ())
    with pytest.raises(BlockNotRetainedError):
        p.release_retained_blocks([3, 4])  # not taken yet
    assert drain(p) == ([(3, 4)], [3, 4])
    before = p.snapshot()
    for wrong in ([3, 3], [1], [4, 4, 3]):
        with pytest.raises(BlockNotRetainedError):
            p.release_retained_blocks(wrong)
        assert p.snapshot() == before
    p.release_retained_blocks([4])
    p.release_retained_blocks([3])
    with pytest.raises(BlockNotRetainedError):
        p.release_retained_blocks([3])
    ok(p)


def test_retained_blocks_keep_the_prefix_cache_from_being_reset() -> None:
    p = pool()
    admit(p, "A", P, 48)
    assert p.allocate_slots("A", 8) == ((), ())
    p.free("A")
    assert not p.reset_prefix_cache()  # the pair not taken yet still holds 3 and 4
    copies, retained = drain(p)
    assert not p.reset_prefix_cache()
    p.release_retained_blocks(retained)
    assert p.reset_prefix_cache()
    ok(p)


def test_a_session_end_drops_the_copies_and_retentions_it_left() -> None:
    """The session whose scheduler would run the copies and release their blocks is
    gone (detach, lease expiry, fence change): its pairs, taken or not, return their
    references as a release would, and the prefix cache can be reset again."""
    p = pool()
    free0 = p.block_pool.get_num_free_blocks()
    admit(p, "A", P, 48)
    p.new_step_starts()
    assert p.allocate_slots("A", 8) == ((), ())
    assert drain(p) == ([(3, 4)], [3, 4])  # taken, never released
    p.free("A")
    assert dict(p.retained) == {3: 1, 4: 1}
    assert not p.reset_prefix_cache()
    assert p.drop_block_copies() == 2
    assert (dict(p.retained), refs(p, [3, 4])) == ({}, [0, 0])
    assert p.block_pool.get_num_free_blocks() == free0
    ok(p)
    assert p.reset_prefix_cache()
    assert p.drop_block_copies() == 0  # nothing left: nothing changes
    # a pair made and not taken yet is dropped too
    q = pool()
    admit(q, "A", P, 48)
    assert q.allocate_slots("A", 8) == ((), ())
    q.free("A")
    assert q.drop_block_copies() == 2
    assert q.take_kv_cache_block_copies() == ([], [])
    assert q.block_pool.get_num_free_blocks() == free0
    ok(q)
    assert q.reset_prefix_cache()


def test_partial_hits_are_taken_only_where_modelled() -> None:
    """Fine-grained hits beside a sliding-window group, or with groups of several block
    sizes, stay refused by name; beside prefill checkpoint blocks, speculative mamba
    blocks and look-ahead hashes they are taken."""
    mamba = MambaSpec(32, MambaCacheMode.ALIGN)
    with pytest.raises(ConfigError, match="copy-on-write.*block-aligned hits"):
        KVCacheConfig(24, (SlidingWindowSpec(32, 64), mamba), HBS, profile="vllm-0.33")
    with pytest.raises(ConfigError, match="copy-on-write.*beside groups of another block size"):
        KVCacheConfig(24, (FullAttentionSpec(16), mamba), HBS, profile="vllm-0.33")
    assert not KVCacheConfig(24, (FullAttentionSpec(32), mamba), HBS, profile="vllm-0.16").partial_hash_hits
    ckpt = MambaSpec(
        32, MambaCacheMode.ALIGN, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
    )
    # taken beside prefill checkpoint blocks (refused before; vLLM 0.33's Mamba2 and GDN
    # layers always have one: tests/with_vllm/test_mamba033_engine.py compares them)
    assert KVCacheConfig(24, (FullAttentionSpec(32), ckpt), HBS, profile="vllm-0.33").partial_hash_hits
    spec = MambaSpec(32, MambaCacheMode.ALIGN, num_speculative_blocks=2)
    assert KVCacheConfig(24, (FullAttentionSpec(32), spec), HBS, profile="vllm-0.33").partial_hash_hits
    lookahead = KVCacheConfig(
        24, (FullAttentionSpec(32), spec), HBS, profile="vllm-0.33", num_hash_lookahead_tokens=1
    )
    assert lookahead.partial_hash_hits  # MTP/EAGLE's look-ahead hashes


def test_the_state_export_keeps_tails_copies_and_retentions() -> None:
    """A pool restored from export_state answers the rest of the sequence as the
    original does: the producer's tail, a pair not taken yet and a taken one."""
    from kvcoord.engine.state import export_state, import_state

    p = pool()
    admit(p, "A", P, 48)
    assert p.allocate_slots("A", 8) == ((), ())
    p.update_request("A", num_computed_tokens=56)
    assert drain(p) == ([(3, 4)], [3, 4])  # taken, not released
    admit(p, "B", B_TOKENS, 64)  # its pairs not taken yet
    q = import_state(p.config, export_state(p))
    assert q.snapshot() == p.snapshot()
    ok(q)
    for x in (p, q):
        assert drain(x) == ([(2, 5), (4, 6)], [2, 5, 4, 6])
        x.release_retained_blocks([3, 4, 2, 5, 4, 6])
        ok(x)
    assert q.snapshot() == p.snapshot()


def test_shared_prefix_checkpoints_are_taken_where_vllm_033_turns_them_on_only() -> None:
    """``mamba_shared_prefix_checkpoint`` (vLLM 0.33's manager flag, the engine option
    ``enable_mamba_shared_prefix_checkpoint`` as it narrows it): fine-grained hits only,
    where vLLM can turn it on; a bool. The wire carries it (PoolConfig, the table form)."""
    from kvcoord.v1 import allocator_pb2 as pb
    from kvcoord.wire.layouts import config_from_pb, pool_config_from_table

    groups = (FullAttentionSpec(32), MambaSpec(32, MambaCacheMode.ALIGN))
    cfg = KVCacheConfig(24, groups, HBS, profile="vllm-0.33", mamba_shared_prefix_checkpoint=True)
    p = KVCachePool(cfg)
    assert [getattr(m, "shared_prefix_checkpoint", None) for m in p.coordinator.managers] == [None, True]
    for kwargs in (
        {"hash_block_size": 32, "profile": "vllm-0.33"},  # no fine-grained hits
        {"hash_block_size": HBS, "profile": "vllm-0.33", "enable_caching": False},
        {"hash_block_size": HBS, "profile": "vllm-0.16"},
    ):
        with pytest.raises(ConfigError, match="mamba_shared_prefix_checkpoint needs the vllm-0.33 profile"):
            KVCacheConfig(24, groups, mamba_shared_prefix_checkpoint=True, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="must be a bool"):
        KVCacheConfig(24, groups, HBS, profile="vllm-0.33", mamba_shared_prefix_checkpoint=1)  # type: ignore[arg-type]
    # each runs beside fine-grained hits, but not with the junction's key too: refused, named
    for mamba, lookahead in (
        (
            MambaSpec(
                32, MambaCacheMode.ALIGN, num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=1
            ),
            0,
        ),
        (MambaSpec(32, MambaCacheMode.ALIGN, num_speculative_blocks=2), 0),
        (MambaSpec(32, MambaCacheMode.ALIGN), 1),
    ):
        KVCacheConfig(24, (groups[0], mamba), HBS, profile="vllm-0.33", num_hash_lookahead_tokens=lookahead)
        with pytest.raises(ConfigError, match="not modelled together"):
            KVCacheConfig(24, (groups[0], mamba), HBS, profile="vllm-0.33", num_hash_lookahead_tokens=lookahead,
                          mamba_shared_prefix_checkpoint=True)  # fmt: skip
    table = {
        "num_blocks": 24, "hash_block_size": HBS, "hash_algo": "sha256", "hash_seed": "0",
        "enable_caching": True, "profile": "vllm-0.33", "mamba_shared_prefix_checkpoint": True,
        "groups": [{"type": "full", "block_size": 32}, {"type": "mamba", "block_size": 32, "mamba_cache_mode": "align"}],
    }  # fmt: skip
    wire = pool_config_from_table(table, "pools[0]")
    assert isinstance(wire, pb.PoolConfig) and wire.mamba_shared_prefix_checkpoint
    assert config_from_pb(wire).mamba_shared_prefix_checkpoint is True
