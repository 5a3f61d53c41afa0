"""Bounded resources: every limit refuses with its status and changes nothing."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import grpc
from helpers import NONE
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.budget import BLOCK_BYTES, TOKEN_BYTES
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from tenancy import Raw, pool_toml, server_state

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _config(num_blocks: int, max_model_len: int = 256) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks,
        hash_block_size=16,
        hash_algo="sha256_cbor",
        hash_seed="0",
        enable_caching=True,
        max_model_len=max_model_len,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))],
    )


def _attach(raw: Raw, pool: str, lease: float = 0.0) -> pb.AttachResponse:
    request = pb.AttachRequest(
        pool=pool, hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", lease_seconds=lease
    )
    return raw.ok("Attach", request, None)


def test_memory_budget_refuses_with_the_arithmetic_and_returns_on_delete(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A pool beyond max_pool_memory_bytes is RESOURCE_EXHAUSTED naming the estimate and
    its parts, nothing is created; deleting a pool gives its share back."""
    per_block = BLOCK_BYTES + TOKEN_BYTES * 16
    limits = Limits(max_pool_memory_bytes=per_block * 1500)
    raw = Raw(make_server("", limits=limits).address)
    raw.ok("CreatePool", pb.CreatePoolRequest(name="one", config=_config(1000)), None)
    before = server_state(raw)
    code, message = raw.call("CreatePool", pb.CreatePoolRequest(name="two", config=_config(1000)), None)
    assert code == EXHAUSTED
    assert f"{1000 * per_block:,} bytes" in message and f"{per_block * 1500:,}" in message, message
    assert f"{BLOCK_BYTES} per block + {TOKEN_BYTES} per token x 16 tokens per block" in message
    assert server_state(raw) == before
    stats = raw.ok("GetStats", pb.GetStatsRequest(pool="one"), None)
    assert stats.pool_memory_bytes == stats.limits.pool_memory_bytes == 1000 * per_block
    raw.ok("DeletePool", pb.DeletePoolRequest(name="one"), None)
    raw.ok("CreatePool", pb.CreatePoolRequest(name="two", config=_config(1000)), None)


def _fill_pool(raw: Raw) -> None:
    """Create pool "big" and use every one of its 20,000 blocks (4 requests of 80,000 tokens)."""
    raw.ok("CreatePool", pb.CreatePoolRequest(name="big", config=_config(20_001, 1 << 20)), None)
    attach = pb.AttachRequest(pool="big", hash_algo="sha256_cbor", hash_block_size=16, hash_seed="0")
    sid = raw.ok("Attach", attach, None).session_id
    for i in range(4):
        tokens = [i * 100_000 + t for t in range(80_000)]
        sync = pb.RequestSync(
            request_id=f"r{i}",
            append_token_ids=tokens,
            append_block_hashes=BlockHasher("sha256_cbor", 16, NONE).extend(tokens),
            new_request=True,
        )
        op = pb.AllocateOp(request=sync, num_new_tokens=80_000)
        assert not raw.ok(
            "Allocate", pb.AllocateRequest(pool="big", session_id=sid, op=op), None
        ).result.refused


def test_memory_is_returned_when_a_pool_is_deleted(make_server: Callable[..., InProcessServer]) -> None:
    """A pool whose every block was used (created, hashed, cached) leaves no Python
    memory behind once deleted (tracemalloc: what stays is under 5% of the pool's peak)."""
    server = make_server("")
    raw = Raw(server.address)
    # Only memory allocated by the server's own code counts: other threads of this test
    # process (lease renewals, earlier tests' channels) allocate meanwhile too.
    server_code = [
        tracemalloc.Filter(True, "*/kvcoord/engine/*"),
        tracemalloc.Filter(True, "*/kvcoord/service/*"),
    ]

    def held() -> int:
        gc.collect()
        return sum(t.size for t in tracemalloc.take_snapshot().filter_traces(server_code).traces)

    tracemalloc.start()
    try:
        base = held()
        _fill_pool(raw)
        peak = held() - base
        raw.ok("DeletePool", pb.DeletePoolRequest(name="big"), None)
        server.settle()  # the blocks are released a slice at a time after the answer
        left = held() - base
    finally:
        tracemalloc.stop()
    assert peak > 20_000 * 100, peak  # the blocks really were created
    assert left < peak // 20, (left, peak)


def test_oversized_step_is_refused_before_parsing(make_server: Callable[..., InProcessServer]) -> None:
    """A 60 MB Step is RESOURCE_EXHAUSTED under the default 16 MiB max_message_bytes,
    and with a configured 1 MiB limit so is a 2 MB one (a 0.5 MB one reaches the
    handler); nothing changes."""
    for limit, size, refused in (
        (None, 60_000_000, True),
        (1 << 20, 2_000_000, True),
        (1 << 20, 500_000, False),
    ):
        settings = {} if limit is None else {"max_message_bytes": limit}
        server = make_server(pool_toml("p"), **settings)
        raw = Raw(server.address)
        raw.channel.close()
        raw.channel = grpc.insecure_channel(
            server.address, options=[("grpc.max_send_message_length", 100 << 20)]
        )
        from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

        raw.stub = pb_grpc.AllocatorStub(raw.channel)
        sid = _attach(raw, "p").session_id
        before = server_state(raw)
        sync = pb.RequestSync(request_id="x" * size, append_token_ids=[1], new_request=True)
        code, message = raw.call(
            "Step",
            pb.StepRequest(pool="p", session_id=sid, ops=[pb.Operation(sync=pb.SyncOp(request=sync))]),
            None,
        )
        if refused:
            assert code == EXHAUSTED, (limit, size, code, message)
        else:
            assert code == grpc.StatusCode.OK
        assert server_state(raw) == before or not refused
        raw.close()


def test_max_tokens_per_request_bounds_unlimited_pools(make_server: Callable[..., InProcessServer]) -> None:
    """max_model_len = 0 means the server's max_tokens_per_request (default 2^20), not
    2^31: a 10M-token request is refused and nothing changes; a pool asking for more
    than the limit is RESOURCE_EXHAUSTED at creation."""
    server = make_server("", max_message_bytes=200 << 20)
    raw = Raw(server.address)
    raw.channel = grpc.insecure_channel(server.address, options=[("grpc.max_send_message_length", 200 << 20)])
    from kvcoord.v1 import allocator_pb2_grpc as pb_grpc

    raw.stub = pb_grpc.AllocatorStub(raw.channel)
    cfg = _config(64, 0)
    cfg.hash_block_size = 1 << 20  # no hashes to send for 10M tokens: the token count alone is checked
    cfg.groups[0].full.block_size = 1 << 20
    raw.ok("CreatePool", pb.CreatePoolRequest(name="open", config=cfg), None)
    sid = raw.ok(
        "Attach",
        pb.AttachRequest(pool="open", hash_algo="sha256_cbor", hash_block_size=1 << 20, hash_seed="0"),
        None,
    ).session_id
    before = server_state(raw)
    sync = pb.RequestSync(request_id="huge", append_token_ids=[7] * 10_000_000, new_request=True)
    op = pb.AllocateOp(request=sync, num_new_tokens=10_000_000)
    code, message = raw.call("Allocate", pb.AllocateRequest(pool="open", session_id=sid, op=op), None)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len 1048576" in message, message
    assert server_state(raw) == before
    code, message = raw.call(
        "CreatePool", pb.CreatePoolRequest(name="long", config=_config(64, (1 << 20) + 1)), None
    )
    assert code == EXHAUSTED and "max_tokens_per_request" in message
    assert server_state(raw) == before
    assert raw.ok("GetStats", pb.GetStatsRequest(pool="open"), None).limits.max_tokens_per_request == 1 << 20


def test_sessions_per_tenant_and_lease_length(make_server: Callable[..., InProcessServer]) -> None:
    """The fourth session of a tenant limited to three is RESOURCE_EXHAUSTED (nothing
    created); detaching one makes room; a one-hour lease is cut to the maximum."""
    limits = dataclasses.replace(Limits(), max_sessions_per_tenant=3)
    server = make_server(pool_toml("p"), limits=limits)
    raw = Raw(server.address)
    sids = [_attach(raw, "p").session_id for _ in range(3)]
    before = server.call(lambda: len(server.running.servicer.registry.sessions.sessions))  # type: ignore[union-attr]
    code, message = raw.call(
        "Attach", pb.AttachRequest(pool="p", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"), None
    )
    assert code == EXHAUSTED and "max_sessions_per_tenant 3" in message
    assert server.call(lambda: len(server.running.servicer.registry.sessions.sessions)) == before  # type: ignore[union-attr]
    stats = raw.ok("GetStats", pb.GetStatsRequest(pool="p"), None)
    assert (stats.limits.tenant_sessions, stats.limits.max_sessions_per_tenant) == (3, 3)
    raw.ok("Detach", pb.DetachRequest(session_id=sids[0]), None)
    lease = _attach(raw, "p", lease=3600.0).lease_seconds
    assert lease == stats.limits.max_session_lease_seconds == 120.0


def test_get_stats_reports_every_limit(make_server: Callable[..., InProcessServer]) -> None:
    """GetStats.limits carries the configured limits and the message size."""
    limits = Limits(
        max_pools=7, max_ops_per_step=99, max_tokens_per_request=5000, max_pool_memory_bytes=10**9
    )
    raw = Raw(make_server(pool_toml("p"), limits=limits, max_message_bytes=3 << 20).address)
    got = raw.ok("GetStats", pb.GetStatsRequest(pool="p"), None).limits
    assert (got.max_pools, got.max_ops_per_step, got.max_tokens_per_request, got.max_pool_memory_bytes) == (
        7,
        99,
        5000,
        10**9,
    )
    assert got.max_message_bytes == 3 << 20
    assert (got.pool_block_bytes, got.pool_token_bytes) == (BLOCK_BYTES, TOKEN_BYTES)
    assert got.pool_memory_bytes == 64 * (BLOCK_BYTES + TOKEN_BYTES * 4)


def test_the_memory_budget_is_server_wide_as_deploy_documents(
    make_server: Callable[..., InProcessServer],
) -> None:
    """max_pool_memory_bytes is one budget, first come first served: tenant a spends it
    and tenant b's CreatePool is refused. deploy/README says so instead of counting it
    among limits that protect tenants from each other."""
    a, b = "tok-a", "tok-b"
    tenants = "".join(
        f'[tenants.{t}]\ntokens = ["{tok}"]\ngrants = [{{ pools = ["{t}-*"], roles = ["administer"] }}]\n'
        for t, tok in (("a", a), ("b", b))
    )
    per_block = BLOCK_BYTES + TOKEN_BYTES * 16
    server = make_server(f"[limits]\nmax_pool_memory_bytes = {1000 * per_block}\n" + tenants)
    raw = Raw(server.address)
    try:
        raw.ok("CreatePool", pb.CreatePoolRequest(name="a-big", config=_config(900)), a)
        code, _ = raw.call("CreatePool", pb.CreatePoolRequest(name="b-small", config=_config(200)), b)
        assert code == EXHAUSTED
    finally:
        raw.close()
    doc = " ".join((Path(__file__).resolve().parents[2] / "deploy" / "README.md").read_text().split())
    assert "protect tenants from each other" not in doc
    assert "`max_pool_memory_bytes` and `max_pools` are server-wide budgets" in doc
