"""vLLM 0.33's ``kv_cache_report_mode = "full"``: with KV events on, a lookup of such a
request that finds a hit re-announces the hit's blocks (one BlockStored per group, from
block 0, no parent), as vLLM 0.26+'s ``get_computed_blocks``. The request's mode travels
with its registration (``RequestSync.kv_cache_report_full``). vLLM 0.33.0's own bytes:
tests/with_vllm/test_kv_events.py::test_033_full_report_mode_re_announces_hits_as_vllm_033."""

from __future__ import annotations

import types

import pytest
from kvcoord.client.tracking import RequestTracker, SyncValues
from kvcoord.engine import BlockStored, FullAttentionSpec, SlidingWindowSpec
from kvcoord.engine.state import export_state, import_state
from kvcoord.service.convert import sync_from_pb
from kvcoord.v1 import allocator_pb2 as pb
from support import Driver, toks

V033 = "vllm-0.33"


def _driver(profile: str = V033, events: bool = True, swa: bool = False) -> Driver:
    groups = (FullAttentionSpec(4), SlidingWindowSpec(4, 6)) if swa else (FullAttentionSpec(4),)
    return Driver(
        groups, num_blocks=40, enable_kv_cache_events=events, profile=profile,
        prefix_cache_retention_interval=None if profile == V033 else 0,
    )  # fmt: skip


def _cached(d: Driver) -> list[bytes]:
    """Request "a" of 26 tokens cached and freed; its hashes."""
    hashes = d.add("a", toks(1, 26))
    assert d.pool.allocate_slots("a", 26) is not None
    d.pool.free("a")
    d.pool.take_events()
    return hashes


@pytest.mark.parametrize("swa", [False, True], ids=["full", "full+swa"])
def test_a_full_report_lookup_re_announces_its_hit_per_group(swa: bool) -> None:
    d = _driver(swa=swa)
    hashes = _cached(d)
    tokens = [*toks(1, 18), *toks(500, 506)]
    d.add("b", tokens, cache_salt="s", kv_cache_report_full=True)
    hit = d.hit("b")
    assert hit.num_tokens == 16
    assert not swa or hit.block_ids[1][0] == 0  # (the window's null positions are listed too)
    events = d.pool.take_events()
    assert [e.group_idx for e in events] == ([0, 1] if swa else [0])
    for e in events:
        assert isinstance(e, BlockStored)
        assert e.block_hashes == tuple(hashes[:4]) and e.parent_block_hash is None
        assert e.token_ids == tuple(tokens[:16]) and e.block_size == 4
        assert e.extra_keys == (("s",), None, None, None)  # the salt on block 0, as a store
    # the allocation of the hit announces only the blocks it caches, as before
    assert d.pool.allocate_slots("b", len(tokens) - 16, 16, hit) is not None
    after = d.pool.take_events()
    assert after and all(isinstance(e, BlockStored) and e.parent_block_hash == hashes[3] for e in after)


def test_the_atomic_lookup_puts_the_hit_first_and_a_failed_call_queues_nothing() -> None:
    d = _driver()
    _cached(d)
    tokens = [*toks(1, 18), *toks(500, 506)]
    d.add("b", tokens, kv_cache_report_full=True)
    with pytest.raises(Exception, match="num_lookahead_tokens"):
        d.pool.allocate_slots_with_lookup("b", 100, num_lookahead_tokens=-1)
    assert d.pool.take_events() == []
    assert d.pool.allocate_slots_with_lookup("b", 100).new_block_ids is not None
    events = d.pool.take_events()
    assert [(e.parent_block_hash is None, len(e.block_hashes)) for e in events] == [(True, 4), (False, 2)]


@pytest.mark.parametrize("case", ["incremental", "no-hit", "events-off", "vllm-0.16", "answered"])
def test_no_re_announcement_but_where_vllm_033_makes_one(case: str) -> None:
    """A request in the incremental mode, a lookup finding nothing, events off, and a
    0.16 pool (vLLM 0.16 has no report mode) add nothing to a lookup; a lookup the
    client answered (a predicting mirror's) re-announces as a plain one."""
    d = _driver(profile="vllm-0.16" if case == "vllm-0.16" else V033, events=case != "events-off")
    _cached(d)
    tokens = toks(900, 920) if case == "no-hit" else [*toks(1, 18), *toks(500, 506)]
    d.add("b", tokens, kv_cache_report_full=case != "incremental")
    if case == "answered":
        hint, _ = d.pool.lookup_hint("b")
        assert d.pool.check_lookup("b", hint, hint.num_tokens).num_tokens == 16
        assert len(d.pool.take_events()) == 1
        return
    d.hit("b")
    assert d.pool.take_events() == []


def test_the_mode_is_kept_by_a_state_export_and_crosses_the_wire() -> None:
    d = _driver()
    _cached(d)
    d.add("b", [*toks(1, 18), *toks(500, 506)], kv_cache_report_full=True)
    copy = import_state(d.config, export_state(d.pool))
    assert copy.get_request("b").kv_cache_report_full
    copy.get_computed_blocks("b")
    assert len(copy.take_events()) == 1
    sync = SyncValues("b", True, 0, 0, tokens=[1, 2], kv_cache_report_full=True).write(pb.RequestSync())
    assert sync.kv_cache_report_full and sync_from_pb(sync).kv_cache_report_full
    assert not SyncValues("b", True, 0, 0, tokens=[1, 2]).write(pb.RequestSync()).HasField("lora")


@pytest.mark.parametrize("names", [False, True])
def test_the_tracker_names_the_full_mode_only_when_told(names: bool) -> None:
    """The vllm-0.33 plug-in sets ``report_modes`` for a pool publishing events; a
    request's registration then carries vLLM's ``kv_cache_report_mode == "full"``."""
    tracker = RequestTracker(pb.PoolConfig(enable_caching=False, hash_block_size=4), b"")
    tracker.report_modes = names
    for rid, mode in (("f", "full"), ("i", "incremental")):
        request = types.SimpleNamespace(
            request_id=rid, all_token_ids=[1, 2, 3], num_computed_tokens=0, kv_cache_report_mode=mode
        )
        assert tracker.sync_values(request).kv_cache_report_full == (names and mode == "full")
