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
from helpers import allocate, attach, new_request
from kvcoord.client import HashMismatchError, KVCoordClient, PoolBusyError
from kvcoord.client.errors import KVCoordError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.service.config import parse_config
from kvcoord.service.server import start_server
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
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


def test_step_and_session_series_count_what_the_server_did(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """The series the dashboard's Step latency and sessions panels read, over a real
    /metrics scrape: every Step's engine work is one histogram observation and its
    operations are counted (an Admit as the requests it carries); a lease running out
    counts one expired session, a Detach none."""
    srv = make_server()
    p = (("pool", "p"),)
    ops, engine, expired = (
        "kvcoord_step_operations_total",
        "kvcoord_step_engine_seconds",
        "kvcoord_sessions_expired_total",
    )
    before = scrape_metrics(srv)
    assert (before[(ops, p)], before[(f"{engine}_count", ())], before[(expired, p)]) == (0, 0, 0)
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c, lease_seconds=5)
        gone, gone_fence = attach(c, lease_seconds=5)
        c.step("p", [allocate("a", list(range(10)), 10), allocate("b", list(range(20, 28)), 8)], sid, fence)
        c.step("p", [], sid, fence)
        c.step("p", [pb.Operation(free=pb.FreeOp(request_id="a"))], sid, fence)
        admitted = [new_request(f"w{i}", list(range(50 + 10 * i, 58 + 10 * i))) for i in range(3)]
        c.step("p", [pb.Operation(admit=pb.AdmitOp(requests=admitted, token_budget=1000))], sid, fence)
        c.detach(gone, gone_fence)
        clock.advance(6)
        assert srv.call(srv.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
    m = scrape_metrics(srv)
    assert m[(ops, p)] == 6
    assert m[(f"{engine}_count", ())] == 4
    assert 0 < m[(f"{engine}_sum", ())] < m[("grpc_server_handling_seconds_sum", _STEP_LABELS)]
    assert m[(f"{engine}_bucket", (("le", "+Inf"),))] == 4
    assert m[(expired, p)] == 1


def test_a_pool_made_again_counts_its_step_operations_anew(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A deleted pool's kvcoord_step_operations_total goes with it, and a pool made
    again under its name counts from 0 (the series' child the metrics keep per pool
    is dropped with it, not counted into after its series was removed)."""
    srv = make_server()
    ops = ("kvcoord_step_operations_total", (("pool", "p"),))
    with KVCoordClient(srv.address) as c:
        config = c.get_pool("p").pool.config
        sid, fence = attach(c)
        c.step("p", [allocate("a", list(range(10)), 10), allocate("b", list(range(20, 28)), 8)], sid, fence)
        assert scrape_metrics(srv)[ops] == 2
        c.detach(sid, fence)
        c.delete_pool("p")
        assert ops not in scrape_metrics(srv)
        c.create_pool("p", config)
        assert scrape_metrics(srv)[ops] == 0
        sid, fence = attach(c)
        c.step("p", [allocate("c", list(range(10)), 10)], sid, fence)
        assert scrape_metrics(srv)[ops] == 1


_STEP_LABELS = (("grpc_method", "Step"), ("grpc_service", "kvcoord.v1.Allocator"), ("grpc_type", "unary"))


def test_event_gaps_are_counted_per_stream(make_server: Callable[..., InProcessServer]) -> None:
    """Readers that fell behind a small event buffer are told of a gap, and every such
    answer moves kvcoord_event_gaps_total (what the KVCoordEventStreamGaps alert reads):
    a watcher's first message after the gap, a Step's TakeEvents and a Step taking the
    session's events (include_state); a reader that kept up moves nothing."""
    from kvcoord.service.registry import Limits

    srv = make_server(POOL_TOML, limits=Limits(event_buffer=3))
    watch = ("kvcoord_event_gaps_total", (("pool", "p"), ("stream", "watch")))
    step = ("kvcoord_event_gaps_total", (("pool", "p"), ("stream", "step")))
    with KVCoordClient(srv.address) as c:
        sid, fence = attach(c)
        c.allocate("p", allocate("r0", list(range(12)), 12).allocate, sid, fence)
        assert not any(e.gap for e in c.watch_events("p", 0, timeout=1.0))
        c.step("p", [], sid, fence, include_state=True)  # kept up: no gap
        m = scrape_metrics(srv)
        assert (m[watch], m[step]) == (0, 0)
        for i in range(1, 4):
            c.allocate("p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence)
        assert sum(e.gap for e in c.watch_events("p", 1, timeout=1.0)) == 1
        assert (
            c.step("p", [pb.Operation(take_events=pb.TakeEventsOp())], sid, fence).results[0].take_events.gap
        )
        other, other_fence = attach(c)
        for i in range(4, 8):
            c.allocate("p", allocate(f"r{i}", list(range(i * 100, i * 100 + 12)), 12).allocate, sid, fence)
        assert c.step("p", [], other, other_fence, include_state=True).events_gap
    m = scrape_metrics(srv)
    assert (m[watch], m[step]) == (1, 2)


def test_step_weight_counts_what_the_engine_applies() -> None:
    """kvcoord_step_operations_total counts a run's entries and checks and an Admit's
    requests, not the Operation messages that carry them, so that engine time per
    operation means the same for a decode step sent as one AllocateRunOp or as one
    AllocateOp per request; and a Step is scanned for a TakeEvents gap only when it
    has a TakeEvents."""
    from kvcoord.service import operations as op
    from kvcoord.service.mutating_calls import step_weight

    def run(n: int, checks: int) -> op.AllocateRun:
        ids = [f"r{i}" for i in range(n)]
        zeros = [0] * n
        checked = op.RunChecks(ids[:checks], [0] * checks, *([[0] * checks] * 4)) if checks else None
        return op.AllocateRun(ids, zeros, zeros, zeros, zeros, zeros, zeros, [], zeros, [], checked)

    admit = op.Admit([op.RequestSync("x", (), ()), op.RequestSync("y", (), ())], 100)
    assert step_weight([run(256, 0)]) == (256, False)
    assert step_weight([run(5, 2), admit, op.Free("z"), op.TakeEvents()]) == (5 + 2 + 2 + 1 + 1, True)
    assert step_weight([]) == (0, False)
