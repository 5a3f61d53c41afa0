"""A first allocation with external (KV connector) tokens whose hit has a free block of a
later group near the free queue's head: vLLM's own KVCacheManager (0.16.0 or 0.33.0,
whichever this venv has) and kvcoord's engine side by side.

vLLM 0.16.0 adopts group by group, so an earlier group's block for the external tokens
can be a later group's hit block, which that group then touches: vLLM's tables hold
one block in two groups (shown here on vLLM's own manager). kvcoord raises
:class:`~kvcoord.engine.HitBlockTakenError` there with its pool unchanged, and answers
vLLM's ids everywhere else. vLLM 0.33.0 touches every hit first: never shared, and
kvcoord's answers are vLLM's throughout. The pools are built as in
tests/unit/test_hit_block_taken.py: p0 caches the prompt's first block and is freed, q
is freed behind it, p computes the prefix without a hit and keeps running, then
``holders`` requests of 3 tokens move the free queue's head.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from harness import V033
from kvcoord.engine import HitBlockTakenError, KVCacheConfig, KVCachePool
from kvcoord.engine.invariants import check_pool
from kvcoord.engine.specs import FullAttentionSpec, MambaCacheMode, MambaSpec, SlidingWindowSpec
from kvcoord.engine.state import export_state
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1 import kv_cache_interface as k
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

BS = 4
MAX_LEN = 64
PREFIX = list(range(1, 9))
PROMPT = PREFIX + [9, 10, 11, 12, 13]
COMMON: dict[str, Any] = {"num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}

#: layout -> per group (vLLM's spec, kvcoord's spec)
KINDS = {
    "mamba": (
        lambda: k.MambaSpec(
            block_size=BS, shapes=((2, 16), (4, 8)), dtypes=(torch.float16, torch.float16),
            mamba_cache_mode="align",
        ),
        lambda: MambaSpec(BS, MambaCacheMode.ALIGN, 0),
    ),
    "full": (lambda: k.FullAttentionSpec(BS, **COMMON), lambda: FullAttentionSpec(BS)),
    "swa": (lambda: k.SlidingWindowSpec(BS, sliding_window=64, **COMMON), lambda: SlidingWindowSpec(BS, 64)),
}  # fmt: skip
LAYOUTS = ("mamba,full", "mamba,full,swa", "swa,full", "full,mamba")


class Both:
    """vLLM's manager and kvcoord's pool, driven by the same calls."""

    def __init__(self, layout: str, num_blocks: int) -> None:
        kinds = layout.split(",")
        groups = [k.KVCacheGroupSpec([f"layer{i}"], KINDS[kind][0]()) for i, kind in enumerate(kinds)]
        config = k.KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
        more: dict[str, Any] = {}
        ours: dict[str, Any] = {}
        if V033:
            config.prefix_cache_retention_interval = 0  # (what 0.33's EngineCore sets by default)
            more = {"scheduler_block_size": BS, "max_in_flight_tokens": 1024}
            ours = {"profile": "vllm-0.33", "max_in_flight_tokens": 1024}
        self.m = KVCacheManager(
            config, max_model_len=MAX_LEN, hash_block_size=BS, enable_caching=True, **more
        )
        specs = tuple(KINDS[kind][1]() for kind in kinds)
        self.p = KVCachePool(KVCacheConfig(num_blocks, specs, BS, max_model_len=MAX_LEN, **ours))
        self.reqs: dict[str, Request] = {}

    def add(self, rid: str, tokens: list[int]) -> None:
        init_none_hash(get_hash_fn_by_name("sha256"))
        hasher = get_request_block_hasher(BS, get_hash_fn_by_name("sha256"))
        extra: dict[str, Any] = {} if V033 else {"eos_token_id": None}
        r = Request(rid, tokens, SamplingParams(max_tokens=4), None, block_hasher=hasher, **extra)
        self.reqs[rid] = r
        self.p.add_request(rid, tokens, [bytes(h) for h in r.block_hashes])

    def alloc(self, rid: str, n: int) -> bool:
        theirs = self.m.allocate_slots(self.reqs[rid], n)
        ours = self.p.allocate_slots(rid, n)
        assert (None if theirs is None else tuple(map(tuple, theirs.get_block_ids()))) == ours
        return ours is not None

    def free(self, rid: str) -> None:
        self.m.free(self.reqs[rid])
        self.p.free(rid)

    def step(self) -> None:
        if V033:
            self.m.new_step_starts()
            self.p.new_step_starts()

    def vllm_tables(self, rid: str) -> list[list[int]]:
        return [
            [b.block_id for b in m.req_to_blocks.get(rid, [])]
            for m in self.m.coordinator.single_type_managers
        ]


def setup(layout: str, holders: int) -> Both:
    both = Both(layout, 24)
    both.add("p0", PREFIX[:4] + [50, 51, 52, 53])
    both.add("q", list(range(200, 217)))
    assert both.alloc("p0", 8) and both.alloc("q", 16)
    both.free("p0")
    both.free("q")
    both.step()
    both.add("p", PREFIX + [99])
    assert both.alloc("p", 8)
    both.step()
    both.add("e", PROMPT)
    for i in range(holders):
        both.add(f"h{i}", [1000 + i, 2000 + i, 3000 + i])
        if not both.alloc(f"h{i}", 3):
            break
    return both


def shared(tables: list[list[int]]) -> list[int]:
    """Block ids in more than one group's table."""
    seen: dict[int, set[int]] = {}
    for gid, table in enumerate(tables):
        for bid in table:
            if bid:
                seen.setdefault(bid, set()).add(gid)
    return sorted(b for b, g in seen.items() if len(g) > 1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_where_vllm_shares_a_block_kvcoord_refuses_and_elsewhere_answers_vllms_ids(layout: str) -> None:
    outcomes = []
    for holders in range(9):
        both = setup(layout, holders)
        theirs_hit, n = both.m.get_computed_blocks(both.reqs["e"])[:2]
        ours_hit = both.p.get_computed_blocks("e")
        assert (ours_hit.num_tokens, [list(g) for g in ours_hit.block_ids]) == (
            n,
            [list(g) for g in theirs_hit.get_block_ids()],
        )
        queue = [b.block_id for b in both.m.block_pool.free_block_queue.get_all_free_blocks()]
        assert both.p.free_queue_head() == queue
        new = len(PROMPT) - n - 1
        before = json.dumps(export_state(both.p), sort_keys=True, default=repr)
        theirs = both.m.allocate_slots(both.reqs["e"], new, n, theirs_hit, 0, 1)
        tables = both.vllm_tables("e")
        try:
            ours = both.p.allocate_slots("e", new, n, ours_hit, 0, 1)
        except HitBlockTakenError:
            assert theirs is not None and shared(tables), (holders, tables)
            assert json.dumps(export_state(both.p), sort_keys=True, default=repr) == before
            assert check_pool(both.p).violations == ()
            outcomes.append("shared")
            continue
        assert not shared(tables), (holders, tables)
        assert ours == (None if theirs is None else tuple(map(tuple, theirs.get_block_ids())))
        if ours is not None:
            assert [list(g) for g in both.p.get_block_ids("e")] == tables
            assert check_pool(both.p).violations == ()
        outcomes.append("ok" if ours is not None else "none")
    assert "ok" in outcomes, outcomes
    if V033 or layout == "full,mamba":
        assert "shared" not in outcomes, outcomes
    elif layout in ("mamba,full", "mamba,full,swa", "swa,full"):
        assert "shared" in outcomes, outcomes  # vLLM 0.16.0's own manager shares a block


def test_vllm_016s_own_manager_holds_one_block_in_two_groups() -> None:
    """The brief's case on vLLM's own manager, in numbers: (mamba align, full), the full
    group's hit [2, 11] with block 2 free at the queue's head. vLLM 0.16.0: the mamba
    group takes block 2 for the external token's state, the full group touches it
    (ref_cnt 2), tables [0, 0, 2, 8] and [2, 11, 4, 7]. vLLM 0.33.0: block 4 instead."""
    both = setup("mamba,full", 7)
    hit, n = both.m.get_computed_blocks(both.reqs["e"])[:2]
    assert [b.block_id for b in both.m.block_pool.free_block_queue.get_all_free_blocks()][:2] == [2, 4]
    assert both.m.allocate_slots(both.reqs["e"], len(PROMPT) - n - 1, n, hit, 0, 1) is not None
    tables = both.vllm_tables("e")
    if V033:
        assert hit.get_block_ids() == ([0, 1], [2, 10])
        assert tables == [[0, 0, 4, 7], [2, 10, 8, 6]]
    else:
        assert hit.get_block_ids() == ([0, 9], [2, 11])
        assert tables == [[0, 0, 2, 8], [2, 11, 4, 7]]
        assert both.m.block_pool.blocks[2].ref_cnt == 2
