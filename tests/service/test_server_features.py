"""Server features over real gRPC: reflection, unix-socket listeners, graceful shutdown
health, and exact metric values (read from the server's own Prometheus registry)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from conftest import POOL_TOML
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from helpers import allocate, attach
from kvcoord.client import HashMismatchError, KVCoordClient, PoolBusyError
from kvcoord.client.errors import KVCoordError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.service.config import parse_config
from kvcoord.service.server import start_server
from kvcoord.service.testing import InProcessServer
from support import scrape_metrics


def test_reflection_lists_services(server: InProcessServer) -> None:
    """Server reflection names the Allocator, health and reflection services."""
    with grpc.insecure_channel(server.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        (resp,) = list(stub.ServerReflectionInfo(iter([req]), timeout=5))
    names = {s.name for s in resp.list_services_response.service}
    assert {"kvcoord.v1.Allocator", "grpc.health.v1.Health"} <= names


def test_unix_socket_listener(tmp_path: Path) -> None:
    """A unix:/path listener serves the same API."""
    sock = tmp_path / "kvcoord.sock"
    cfg = parse_config(f'[server]\nlisten = ["unix:{sock}"]\nmetrics_listen = ""\n' + POOL_TOML)

    async def main() -> list[str]:
        running = await start_server(cfg)
        try:
            async with grpc.aio.insecure_channel(f"unix:{sock}") as ch:
                from kvcoord.v1 import allocator_pb2 as pb
                from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

                resp = await pb_grpc.AllocatorStub(ch).ListPools(pb.ListPoolsRequest(), timeout=5)
                return [p.name for p in resp.pools]
        finally:
            await running.stop(0.5)

    assert asyncio.run(main()) == ["p"]


def test_graceful_shutdown_turns_health_not_serving(server: InProcessServer, client: KVCoordClient) -> None:
    """Entering shutdown flips gRPC health to NOT_SERVING before the listener closes."""
    assert client.health() == "SERVING"
    assert server.running is not None
    server._run(server.running.health.enter_graceful_shutdown())
    assert client.health() == "NOT_SERVING"
    assert client.health("kvcoord.v1.Allocator") == "NOT_SERVING"


def _scrape(server: InProcessServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    assert server.metrics is not None
    out = {}
    for fam in server.metrics.registry.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_move_exactly_with_a_known_workload(make_server: Callable[..., InProcessServer]) -> None:
    """Each pool counter equals what the same calls do to an in-process reference engine."""
    srv = make_server()
    ref = KVCachePool(KVCacheConfig(num_blocks=64, groups=(FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
                                    hash_block_size=4, enable_kv_cache_events=True, max_model_len=256))  # fmt: skip
    none = none_hash("sha256_cbor", "0")
    prompts = [list(range(40)), list(range(36)) + [99, 98], [1, 2, 3], list(range(300, 500))]
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c)
        for i, tokens in enumerate(prompts):
            rid = f"r{i}"
            op = allocate(rid, tokens, 100, lookup=True)
            got = c.allocate("p", op.allocate, sid, fence).result
            ref.add_request(rid, tokens, BlockHasher("sha256_cbor", 4, none).extend(tokens))
            want = ref.allocate_slots_with_lookup(rid, 100)
            assert got.refused == (want.new_block_ids is None) and got.hit.num_tokens == want.hit.num_tokens
        c.free("p", ["r0"], session_id=sid, fence=fence)
        ref.free("r0")
        try:
            c.attach("p", "sha256", 4, "0")
        except Exception:  # noqa: BLE001 - the refusal is what is counted
            pass
    m = _scrape(srv)
    p = (("pool", "p"),)
    lc = ref.lookup_counters
    assert lc.hits > 0 and lc.short_lookups == 1 and ref.num_refusals == 1
    assert m[("kvcoord_prefix_cache_hits_tokens_total", p)] == lc.hits
    assert m[("kvcoord_prefix_cache_queries_tokens_total", p)] == lc.queries
    assert m[("kvcoord_prefix_cache_short_lookups_total", p)] == 1
    for g, tokens in enumerate(lc.group_hit_tokens):
        kind = "FullAttentionSpec" if g == 0 else "SlidingWindowSpec"
        key = (("group", str(g)), ("pool", "p"), ("type", kind))
        assert m[("kvcoord_prefix_cache_group_hits_tokens_total", key)] == tokens
    assert m[("kvcoord_allocation_refusals_total", p)] == 1
    assert m[("kvcoord_blocks_allocated_total", p)] == ref.block_pool.num_allocated
    assert m[("kvcoord_blocks_freed_total", p)] == ref.block_pool.num_freed
    assert m[("kvcoord_blocks_free", p)] == ref.num_free_blocks
    assert m[("kvcoord_kv_cache_usage_ratio", p)] == ref.usage
    assert m[("kvcoord_requests", p)] == 3
    assert m[("kvcoord_kv_events_published_total", p)] == len(ref.take_events())
    assert m[("kvcoord_hash_handshake_refusals_total", p)] == 1
    ok = (("grpc_code", "OK"), ("grpc_method", "Allocate"), ("grpc_service", "kvcoord.v1.Allocator"),
          ("grpc_type", "unary"))  # fmt: skip
    assert m[("grpc_server_handled_total", ok)] == 4
    assert m[("grpc_server_handling_seconds_count", tuple(x for x in ok if x[0] != "grpc_code"))] >= 4


def test_grpc_series_count_every_call_of_a_method_by_its_own_code(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The interceptor wraps each method's handler once (intercept.WrappedHandlers):
    calls of one method with different outcomes, and of two methods alternating, each
    land in their own method's and code's series, every time."""
    srv = make_server()
    with KVCoordClient(srv.address) as c:
        for i in range(9):
            c.list_pools()
            if i % 3:
                c.get_pool("p")
            else:
                with pytest.raises(KVCoordError):
                    c.get_pool("nope")
    m = _scrape(srv)

    def series(name: str, method: str, code: str | None = None) -> float:
        labels = {"grpc_method": method, "grpc_service": "kvcoord.v1.Allocator", "grpc_type": "unary"}
        if code is not None:
            labels["grpc_code"] = code
        return m.get((name, tuple(sorted(labels.items()))), 0.0)

    assert series("grpc_server_started_total", "GetPool") == 9
    assert series("grpc_server_handled_total", "GetPool", "OK") == 6
    assert series("grpc_server_handled_total", "GetPool", "NOT_FOUND") == 3
    assert series("grpc_server_handling_seconds_count", "GetPool") == 9
    assert series("grpc_server_started_total", "ListPools") == 9
    assert series("grpc_server_handled_total", "ListPools", "OK") == 9
    assert series("grpc_server_handling_seconds_count", "ListPools") == 9


def test_only_a_hash_mismatch_counts_as_a_handshake_refusal(
    make_server: Callable[..., InProcessServer],
) -> None:
    """An Attach refused because an exclusive session holds the pool leaves
    kvcoord_hash_handshake_refusals_total (a critical alert) alone; a hash mismatch moves it."""
    srv = make_server()
    key = ("kvcoord_hash_handshake_refusals_total", (("pool", "p"),))
    with KVCoordClient(srv.address) as c:
        assert scrape_metrics(srv)[key] == 0
        c.attach("p", "sha256_cbor", 4, "0", exclusive=True)
        with pytest.raises(PoolBusyError) as busy:
            c.attach("p", "sha256_cbor", 4, "0")  # the pool's own hash settings
        assert busy.value.reason == "POOL_EXCLUSIVE"
        assert scrape_metrics(srv)[key] == 0
        with pytest.raises(HashMismatchError) as mismatch:
            c.attach("p", "sha256_cbor", 16, "0")
        assert mismatch.value.reason == "HASH_MISMATCH"
        assert scrape_metrics(srv)[key] == 1
