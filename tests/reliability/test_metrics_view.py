"""Metrics read a consistent view (on the server's loop), and a deleted pool's series go."""

from __future__ import annotations

import threading

from kvcoord.client import KVCoordClient
from kvcoord.client import _requests as rq
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

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
                        pb.Operation(allocate=rq.allocate_op(sync, 64)),
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
                total = m[("kvcoord_blocks_total", "p")]
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
