"""Metrics read a consistent view (on the server's loop), a deleted pool's series go, and
pool counters carry their pool's creation time as `_created`."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import allocate_op
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import scrape_metrics

POOL = """
[[pools]]
name = "p"
num_blocks = 4096
hash_block_size = 4
[[pools.groups]]
type = "full"
block_size = 4
"""


def _samples(server: InProcessServer) -> dict[tuple[str, str], float]:
    assert server.metrics is not None
    text = generate_latest(server.metrics.registry).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, s.labels.get("pool", ""))] = s.value
    return out


def test_scrapes_see_one_consistent_state_while_pools_change() -> None:
    """Scraped from another thread during thousands of allocations and frees, free
    blocks and usage always describe the same moment."""
    server = InProcessServer(POOL).start()
    stop = threading.Event()
    try:
        with KVCoordClient(server.address) as c:
            sid = c.attach("p", "", 4, "").session_id

            def churn() -> None:
                i = 0
                while not stop.is_set() and i < 5000:
                    sync = pb.RequestSync(
                        request_id=f"r{i}", append_token_ids=list(range(64)), new_request=True
                    )
                    ops = [
                        pb.Operation(allocate=allocate_op(sync, 64)),
                        pb.Operation(free=pb.FreeOp(request_id=f"r{i}")),
                    ]
                    if i % 3:
                        ops.pop()
                    c.step("p", ops, sid)
                    i += 1

            t = threading.Thread(target=churn)
            t.start()
            scrapes = 0
            while t.is_alive() and scrapes < 300:
                m = _samples(server)
                total = m[("kvcoord_blocks_usable", "p")]
                free = m[("kvcoord_blocks_free", "p")]
                assert m[("kvcoord_kv_cache_usage_ratio", "p")] == 1.0 - free / total
                scrapes += 1
            stop.set()
            t.join(60)
            assert scrapes > 10
    finally:
        stop.set()
        server.stop()


def test_deleted_pool_series_are_removed() -> None:
    server = InProcessServer(POOL).start()
    try:
        with KVCoordClient(server.address) as c:
            cfg = c.get_pool("p").pool.config
            c.create_pool("q", cfg)
            assert any(pool == "q" for _, pool in _samples(server))
            c.delete_pool("q")
            assert not any(pool == "q" for _, pool in _samples(server))
            assert any(pool == "p" for _, pool in _samples(server))
    finally:
        server.stop()


#: every counter the pool collector reads from the engine at scrape time
POOL_COUNTERS = (
    "kvcoord_prefix_cache_lookups",
    "kvcoord_prefix_cache_queries_tokens",
    "kvcoord_prefix_cache_hits_tokens",
    "kvcoord_prefix_cache_short_lookups",
    "kvcoord_block_evictions",
    "kvcoord_allocation_refusals",
    "kvcoord_blocks_allocated",
    "kvcoord_blocks_freed",
    "kvcoord_kv_events_published",
)
P = (("pool", "p"),)
GROUP = (("group", "0"), ("pool", "p"), ("type", "FullAttentionSpec"))


def _allocate(c: KVCoordClient, rid: str) -> None:
    sid = c.attach("p", "", 4, "").session_id
    sync = pb.RequestSync(request_id=rid, append_token_ids=list(range(64)), new_request=True)
    c.step("p", [pb.Operation(allocate=allocate_op(sync, 64))], sid)
    c.detach(sid)


def _created(m: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> set[float]:
    return {m[(f"{n}_created", P)] for n in POOL_COUNTERS} | {
        m[("kvcoord_prefix_cache_group_hits_tokens_created", GROUP)]
    }


def test_a_recreated_pool_s_counters_have_a_new_created_time() -> None:
    """Every pool counter exports `_created`, the pool's creation time; a pool deleted
    and created again under the same name restarts at 0 with a later `_created`, so
    rate() sees a reset rather than a drop."""
    wall = ManualClock()
    wall.now = 1_700_000_000.0
    server = InProcessServer(POOL, wall_clock=wall).start()
    try:
        with KVCoordClient(server.address) as c:
            _allocate(c, "a")
            m = scrape_metrics(server)
            assert m[("kvcoord_blocks_allocated_total", P)] == 16
            assert _created(m) == {1_700_000_000.0}
            wall.advance(60)
            cfg = c.get_pool("p").pool.config
            c.delete_pool("p")
            c.create_pool("p", cfg)
            m = scrape_metrics(server)
            assert m[("kvcoord_blocks_allocated_total", P)] == 0
            assert _created(m) == {1_700_000_060.0}
    finally:
        server.stop()


@pytest.mark.parametrize("snapshot_every", [1, 10_000], ids=["snapshot", "replay"])
def test_a_journaled_pool_keeps_its_created_time_across_a_restart(
    tmp_path: Path, snapshot_every: int
) -> None:
    """A journaled pool's counters go on after a restart (from a snapshot or a replayed
    journal), and so does their `_created`: no false reset."""
    wall = ManualClock()
    wall.now = 1_700_000_000.0

    def start() -> InProcessServer:
        return InProcessServer(
            POOL, wall_clock=wall, data_dir=str(tmp_path), snapshot_every=snapshot_every
        ).start()

    server = start()
    try:
        with KVCoordClient(server.address) as c:
            _allocate(c, "a")
        before = scrape_metrics(server)
    finally:
        server.stop()
    wall.advance(3600)
    server = start()
    try:
        after = scrape_metrics(server)
    finally:
        server.stop()
    assert after[("kvcoord_blocks_allocated_total", P)] == before[("kvcoord_blocks_allocated_total", P)] == 16
    assert _created(after) == _created(before) == {1_700_000_000.0}
