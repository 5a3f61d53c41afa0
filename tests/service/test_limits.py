"""Bounded resources: every limit refuses with its status and changes nothing."""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
from helpers import NONE
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.budget import BLOCK_BYTES, TOKEN_BYTES
from kvcoord.service.idempotency import IdempotencyStore, entry_bytes
from kvcoord.service.registry import Limits
from kvcoord.service.testing import InProcessServer, ManualClock
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
        # one huge block hash: no input bound covers it (the pool checks each hash's length)
        sync = pb.RequestSync(
            request_id="x", append_token_ids=[1], append_block_hashes=[b"h" * size], new_request=True
        )
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
    # refused at the wire (bounds.py): a request's tokens are bounded by max_tokens_per_request
    assert code == grpc.StatusCode.INVALID_ARGUMENT, message
    assert "append_token_ids is 10,000,000 items long" in message and "1,048,576" in message, message
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


def _store_count(server: InProcessServer) -> tuple[int, int]:
    store = server.running.servicer.registry.idempotency  # type: ignore[union-attr]
    return server.call(lambda: (len(store), store.bytes))


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_huge_idempotency_keys_are_refused_and_kept_nowhere(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """Issue 26 scenario 6: 25 empty Steps with 4 MiB idempotency keys (which added
    176 MiB of server memory and 208 MiB of journal) are each INVALID_ARGUMENT naming
    the key's bound; the idempotency store counts no new key, the journal grows by no
    key, GetStats.limits reports the same idempotency bytes, and the pool is unchanged."""
    server = make_server(pool_toml("p"), data_dir=str(tmp_path / "data"))
    raw = Raw(server.address)
    try:
        sid = _attach(raw, "p").session_id
        raw.ok("Step", pb.StepRequest(pool="p", session_id=sid, idempotency_key="small"), None)
        before, journal = _store_count(server), _dir_bytes(tmp_path / "data")
        stats = raw.ok("GetStats", pb.GetStatsRequest(pool="p"), None).limits
        assert (stats.idempotency_keys, stats.idempotency_bytes) == before and before[0] == 1
        state = server_state(raw)
        for i in range(25):
            key = f"{i:04d}" + "k" * (4 << 20)
            code, message = raw.call(
                "Step", pb.StepRequest(pool="p", session_id=sid, idempotency_key=key), None
            )
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, str(message)[:200])
            assert "idempotency_key is 4,194,308 characters long; the longest accepted is 128" in message
        assert _store_count(server) == before
        assert _dir_bytes(tmp_path / "data") - journal < 1 << 20  # not one key: 4 MiB each
        stats = raw.ok("GetStats", pb.GetStatsRequest(pool="p"), None).limits
        assert (stats.idempotency_keys, stats.idempotency_bytes) == before
        assert stats.max_idempotency_key_length == 128
        assert server_state(raw) == state
    finally:
        raw.close()


def test_long_ids_and_names_are_refused_and_change_nothing(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A request id, LoRA name, client_name or pool name one past its bound, and a Free
    naming more requests than max_ops_per_step, are INVALID_ARGUMENT: no request, no
    session, nothing changed. At the bound they are served."""
    limits = dataclasses.replace(Limits(), max_ops_per_step=8)
    server = make_server(pool_toml("p"), limits=limits)
    raw = Raw(server.address)
    try:
        sid = _attach(raw, "p").session_id
        sessions = server.call(lambda: len(server.running.servicer.registry.sessions.sessions))  # type: ignore[union-attr]

        def step(rid: str, lora: str = "") -> tuple[grpc.StatusCode, Any]:
            sync = pb.RequestSync(request_id=rid, append_token_ids=[1, 2], new_request=True)
            if lora:
                sync.lora.CopyFrom(pb.LoRA(adapter_id=1, name=lora))
            request = pb.StepRequest(
                pool="p", session_id=sid, ops=[pb.Operation(sync=pb.SyncOp(request=sync))]
            )
            return raw.call("Step", request, None)

        before = server_state(raw)

        def attach(client_name: str) -> pb.AttachRequest:
            return pb.AttachRequest(
                pool="p", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", client_name=client_name
            )

        refused = [
            ("RequestSync.request_id", lambda: step("r" * 257)),
            ("LoRA.name", lambda: step("with-lora", "n" * 257)),
            ("client_name", lambda: raw.call("Attach", attach("c" * 257), None)),
            ("GetStatsRequest.pool", lambda: raw.call("GetStats", pb.GetStatsRequest(pool="p" * 129), None)),
            (
                "FreeRequest.request_ids",
                lambda: raw.call(
                    "Free",
                    pb.FreeRequest(pool="p", session_id=sid, request_ids=[f"r{i}" for i in range(9)]),
                    None,
                ),
            ),
        ]
        for what, call in refused:
            code, message = call()
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, message)
            assert what.split(".")[-1] in message and "longest accepted" in message, (what, message)
        assert server_state(raw) == before
        assert server.call(lambda: len(server.running.servicer.registry.sessions.sessions)) == sessions  # type: ignore[union-attr]
        # at the bounds: served
        code, response = step("r" * 256, "n" * 256)
        assert code == grpc.StatusCode.OK and not response.results[0].status_code, response
        raw.ok("Attach", attach("c" * 256), None)
    finally:
        raw.close()


def test_idempotency_keys_count_against_their_budget(make_server: Callable[..., InProcessServer]) -> None:
    """Every kept key counts against idempotency_max_bytes, its answer dropped or not:
    once keys alone fill it, a keyed Step is RESOURCE_EXHAUSTED and not applied (its
    request is not registered); GetStats reports the budget and what it holds."""
    budget = 20 * entry_bytes("0" * 32, "k-00") + 100
    server = make_server(pool_toml("p"), idempotency_max_bytes=budget)
    raw = Raw(server.address)
    try:
        sid = _attach(raw, "p").session_id
        assert len(sid) == 32
        for i in range(20):
            raw.ok("Step", pb.StepRequest(pool="p", session_id=sid, idempotency_key=f"k-{i:02d}"), None)
        before = server_state(raw)
        sync = pb.RequestSync(request_id="late", append_token_ids=[1], new_request=True)
        late = pb.StepRequest(
            pool="p", session_id=sid, idempotency_key="k-20", ops=[pb.Operation(sync=pb.SyncOp(request=sync))]
        )
        code, message = raw.call("Step", late, None)
        assert code == EXHAUSTED and "idempotency_max_bytes" in message and "nothing was applied" in message
        assert server_state(raw) == before
        got = raw.ok("GetStats", pb.GetStatsRequest(pool="p"), None).limits
        assert got.idempotency_max_bytes == budget and got.idempotency_keys == 20
        assert 20 * entry_bytes(sid, "k-00") <= got.idempotency_bytes <= budget
        assert got.server_sessions == 1
        # without a key the call is not kept, so it is served
        late.idempotency_key = ""
        code, response = raw.call("Step", late, None)
        assert code == grpc.StatusCode.OK and not response.results[0].status_code
    finally:
        raw.close()


def test_the_idempotency_count_covers_the_memory_it_holds() -> None:
    """What the store counts is at least the memory its entries take (tracemalloc),
    keys and tombstones included, so the budget bounds the real memory."""
    store = IdempotencyStore(ManualClock(), window=600, max_bytes=1 << 30)
    sid = "s" * 32
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for i in range(5_000):
            # a fresh session-id string per call, as each parsed request brings its own
            store.remember("".join([sid[:16], sid[16:]]), "Step", f"{i:032x}", bytes(16), b"a" * 10)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert held <= store.bytes, (held, store.bytes)
    assert store.bytes < 2 * held, (held, store.bytes)  # and not wildly above it
