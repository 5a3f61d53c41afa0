"""Event streams never spin and never hold anyone up (issue 26, scenario 1 and
"done" items 2 and 9): a real server over real gRPC, the journal on."""

from __future__ import annotations

import random
import threading
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.engine import BlockRemoved, BlockStored, KVCacheEvent
from kvcoord.engine.events import block_removed
from kvcoord.service.budget import (
    BLOCK_BYTES,
    ENGINE_BLOCK_BYTES,
    ENGINE_TOKEN_BYTES,
    EVENT_BLOCK_BYTES,
    TOKEN_BYTES,
    event_buffer_bytes,
    pool_bytes,
)
from kvcoord.service.events import EVENT_TOKEN_BYTES, EventJournal
from kvcoord.service.pool_service import Fence, Limits
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from support import POOL_TOML

#: a deadline for calls that answer at once on a sound server and never on a hung one
ANSWER_WITHIN = 10.0


class GatedWrites:
    """Holds the journal's next commit until released (the store's write runs on the
    journal's thread, so holding it delays the commit, never the event loop)."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.write = store.write
        self.entered = threading.Event()
        self.release = threading.Event()
        self.armed = False
        store.write = self._write

    def _write(self, *args: Any) -> None:
        if self.armed:
            self.armed = False
            self.entered.set()
            self.release.wait(60)
        self.write(*args)


class Watcher:
    """A WatchEvents reader on its own thread, keeping every message."""

    def __init__(self, address: str, pool: str = "p", metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stream = pb_grpc.AllocatorStub(self.channel).WatchEvents(
            pb.WatchEventsRequest(pool=pool), timeout=60, metadata=metadata
        )
        self.messages: list[pb.WatchEventsResponse] = []
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for m in self.stream:
                with self.changed:
                    self.messages.append(m)
                    self.changed.notify_all()
        except grpc.RpcError:
            pass

    def wait_for(self, done: Callable[[list[pb.WatchEventsResponse]], bool], timeout: float = 20.0) -> bool:
        with self.changed:
            return self.changed.wait_for(lambda: done(self.messages), timeout)

    def close(self) -> None:
        self.stream.cancel()
        self.thread.join(10)
        self.channel.close()


@pytest.fixture
def journaled(tmp_path: Path) -> Iterator[InProcessServer]:
    server = InProcessServer(
        POOL_TOML, limits=Limits(event_buffer=4), data_dir=str(tmp_path / "data")
    ).start()
    yield server
    server.stop()


def _prompt(i: int, n: int = 32) -> list[int]:
    return [1000 * (i + 1) + t for t in range(n)]


def test_a_commit_behind_the_oldest_kept_event_does_not_hang_the_server(journaled: InProcessServer) -> None:
    """Scenario 1: a watcher is open; one Step's journal commit is pending while another
    Step evicts more cached blocks than event_buffer (4) holds. Once the first commit
    lands, the watcher's cursor is behind the oldest kept event and the durable sequence
    is still below it: nothing is deliverable. The server must go on answering (the old
    stream loop spun on the event loop: every RPC, health checks included, hung) and the
    watcher must get the evictions once they are durable, flagged as a gap."""
    gate = GatedWrites(journaled.running.servicer.registry.recorder.journal.store)  # type: ignore[union-attr]
    channel = grpc.insecure_channel(journaled.address)
    stub = pb_grpc.AllocatorStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    with KVCoordClient(journaled.address, timeout=ANSWER_WITHIN) as client:
        sid, fence = attach(client)
        held = client.step("p", [allocate("r1", _prompt(1), 32)], sid, fence)
        cached = list(held.results[0].allocate.new_block_ids[0].block_ids)
        assert len(cached) == 8
        client.step("p", [pb.Operation(free=pb.FreeOp(request_id="r1"))], sid, fence)
        watcher = Watcher(journaled.address)
        try:
            events = journaled.running.servicer.registry.pools["p"].events  # type: ignore[union-attr]
            seen = journaled.call(lambda: events.visible_sequence)  # r1's blocks stored
            assert seen > 0 and watcher.wait_for(lambda ms: bool(ms) and ms[-1].sequence == seen)
            gate.armed = True
            steps: list[Any] = []

            def step(ops: list[pb.Operation]) -> None:
                steps.append(client.step("p", ops, sid, fence))

            # Step A: stores one block; its record's commit is held
            a = threading.Thread(target=step, args=([allocate("r2", _prompt(2, 4), 4)],))
            a.start()
            assert gate.entered.wait(ANSWER_WITHIN)
            a_last = journaled.call(lambda: events.last_sequence)  # A is applied, not committed
            # Step B: evicts the 8 cached blocks (8 events > event_buffer), queued behind A
            evict = pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=cached))
            b = threading.Thread(target=step, args=([evict],))
            b.start()
            for _ in range(200):  # until B is applied (bounded)
                if journaled.call(lambda: events.last_sequence) >= a_last + 8:
                    break
                b.join(0.05)
            assert journaled.call(lambda: events.oldest_sequence) > a_last  # A's events dropped unread
            gate.release.set()
            a.join(ANSWER_WITHIN)
            b.join(ANSWER_WITHIN)
            # the server answers: a health check and a small call
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_WITHIN).status
            assert status == health_pb2.HealthCheckResponse.SERVING
            assert stub.GetPool(pb.GetPoolRequest(name="p"), timeout=ANSWER_WITHIN).pool.name == "p"
            assert len(steps) == 2 and all(not r.results[0].status_code for r in steps)
            # the watcher moved on to what was deliverable, told of the gap
            assert watcher.wait_for(lambda ms: any(m.gap for m in ms))
            after = [m for m in watcher.messages if m.sequence > seen]
            assert after[0].gap
            assert [m.sequence for m in after] == sorted({m.sequence for m in after})
            assert after[-1].event.WhichOneof("event") == "block_removed"
        finally:
            watcher.close()
    channel.close()


TENANTS = """
[server]
auth_tokens = ["root"]

[tenants.alice]
tokens = ["tok-alice"]
grants = [{ pools = ["p"], roles = ["use", "observe"] }]

[tenants.bob]
tokens = ["tok-bob"]
grants = [{ pools = ["p"], roles = ["use", "observe"] }]

[tenants.eve]
tokens = ["tok-eve"]
grants = [{ pools = ["p"], roles = ["observe"] }]

[tenants.admin]
tokens = ["tok-admin"]
grants = [{ pools = ["p"], roles = ["administer", "observe"] }]
"""


def _auth(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def test_watch_events_shows_an_observer_only_its_own_namespace(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Done 9: on a pool shared by tenants with isolated caches, WatchEvents gives an
    observing tenant the events of its own namespace only (Alice's stored prompt never
    reaches Bob or Eve, who never attached), while the pool's administrator and the
    full-access caller see every tenant's; a cache reset reaches everyone."""
    server = make_server(POOL_TOML + TENANTS)
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.AllocatorStub(channel)
    watchers = {name: Watcher(server.address, metadata=_auth(token)) for name, token in
                [("alice", "tok-alice"), ("bob", "tok-bob"), ("eve", "tok-eve"), ("admin", "tok-admin"),
                 ("root", "root")]}  # fmt: skip
    try:
        sids = {}
        for name in ("alice", "bob"):
            request = pb.AttachRequest(pool="p", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
            sids[name] = stub.Attach(request, metadata=_auth(f"tok-{name}"), timeout=10).session_id
        for i, name in enumerate(("alice", "bob")):
            ops = [
                allocate(f"{name}-r", _prompt(i), 32),
                pb.Operation(free=pb.FreeOp(request_id=f"{name}-r")),
            ]
            step = pb.StepRequest(pool="p", session_id=sids[name], ops=ops)
            assert not stub.Step(step, metadata=_auth(f"tok-{name}"), timeout=10).results[0].status_code
        reset = pb.ResetPrefixCacheRequest(pool="p")
        assert stub.ResetPrefixCache(reset, metadata=_auth("tok-admin"), timeout=10).result

        def tokens(name: str) -> set[int]:
            return {t for m in watchers[name].messages for t in m.event.block_stored.token_ids}

        def cleared(ms: list[pb.WatchEventsResponse]) -> bool:
            return any(m.event.HasField("all_blocks_cleared") for m in ms)

        for w in watchers.values():
            assert w.wait_for(cleared)  # the reset is the last event: all before it were sent
        alice, bob = set(_prompt(0)), set(_prompt(1))
        assert tokens("alice") == alice
        assert tokens("bob") == bob
        assert tokens("eve") == set()
        assert tokens("admin") == tokens("root") == alice | bob
        # sequence numbers stay the pool's, increasing, with no gap flagged for skipped ones
        for w in watchers.values():
            seqs = [m.sequence for m in w.messages]
            assert seqs == sorted(set(seqs)) and not any(m.gap for m in w.messages)
    finally:
        for w in watchers.values():
            w.close()
        channel.close()


def pool16(name: str, num_blocks: int) -> str:
    """A caching pool of one full-attention group of 16-token blocks, with events."""
    return f"""
[[pools]]
name = "{name}"
num_blocks = {num_blocks}
hash_block_size = 16
hash_algo = "sha256_cbor"
hash_seed = "0"
enable_caching = true
enable_kv_cache_events = true

[[pools.groups]]
type = "full"
block_size = 16
"""


STORM_POOL = pool16("storm", 512)


def storm_step(
    client: KVCoordClient, sid: str, fence: pb.Fence, i: int, tokens: int = 1024
) -> pb.StepResponse:
    """Store a fresh 1024-token prompt (64 blocks: a BlockStored event of 1024 token
    ids) and free it; later ones evict the cached blocks (BlockRemoved events)."""
    prompt = [i * tokens + t for t in range(tokens)]
    ops = [allocate(f"s{i}", prompt, tokens, block_size=16), pb.Operation(free=pb.FreeOp(request_id=f"s{i}"))]
    return client.step("storm", ops, sid, fence)


def test_a_stalled_watcher_never_delays_a_step_or_a_health_check(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Done 2: two watchers open their streams and never read while eviction storms run
    (megabytes of events, far past what gRPC's flow-control windows buffer). Every Step,
    GetPool and health check answers within its deadline, and when a stalled watcher
    finally reads it learns that it fell behind the buffer (gap): its stream had been
    suspended by flow control, the server kept nothing for it beyond the buffer."""
    server = make_server(STORM_POOL, limits=Limits(event_buffer=256))
    # no BDP probing: the reader's window stays at gRPC's initial 64 KiB
    stalled = [grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)]) for _ in range(2)]
    streams = [
        pb_grpc.AllocatorStub(c).WatchEvents(pb.WatchEventsRequest(pool="storm"), timeout=60) for c in stalled
    ]
    channel = grpc.insecure_channel(server.address)
    stub = pb_grpc.AllocatorStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    try:
        with KVCoordClient(server.address, timeout=ANSWER_WITHIN) as client:
            sid, fence = attach(client, "storm", block_size=16)
            for i in range(300):  # ~600 events, ~3 MB of token ids
                assert not storm_step(client, sid, fence, i).results[0].status_code
                if i % 25 == 0:
                    status = health.Check(health_pb2.HealthCheckRequest(), timeout=ANSWER_WITHIN).status
                    assert status == health_pb2.HealthCheckResponse.SERVING
                    assert stub.GetPool(pb.GetPoolRequest(name="storm"), timeout=ANSWER_WITHIN).pool.name
        events = server.running.servicer.registry.pools["storm"].events  # type: ignore[union-attr]
        last = server.call(lambda: events.last_sequence)
        assert last > 500
        for stream in streams:
            messages = [next(stream)]
            while messages[-1].sequence < last:
                messages.append(next(stream))
            assert any(m.gap for m in messages[1:]), "the stalled watcher never fell behind"
            seqs = [m.sequence for m in messages]
            assert seqs == sorted(set(seqs))
    finally:
        for stream in streams:
            stream.cancel()
        for c in [*stalled, channel]:
            c.close()


def _fresh_events(kind: str, n: int, rng: random.Random) -> list[KVCacheEvent]:
    """Events holding objects of their own (new hashes and token ids, as events of
    freed requests do)."""
    if kind == "removed":
        return [block_removed(rng.randbytes(32)) for _ in range(n)]
    if kind == "stored-0.33":  # a LoRA request's with an image, and 4 look-ahead tokens per block
        return [_fresh_033(rng) for _ in range(n)]
    return [
        BlockStored(
            tuple(rng.randbytes(32) for _ in range(4)),
            rng.randbytes(32),
            tuple(rng.randrange(300, 200_000) for _ in range(64)),
            16,
            None,
            None,
        )
        for _ in range(n)
    ]


def _fresh_033(rng: random.Random) -> BlockStored:
    """A vllm-0.33 BlockStored of 4 blocks: each block's extra keys (the adapter's name,
    the image's identifier and offset: one name and one identifier per event, as a
    request's) and look-ahead tokens."""
    name, identifier = rng.randbytes(12).hex(), rng.randbytes(32).hex()
    return BlockStored(
        tuple(rng.randbytes(32) for _ in range(4)),
        rng.randbytes(32),
        tuple(rng.randrange(300, 200_000) for _ in range(64)),
        16,
        7,
        name,
        extra_keys=tuple((name, (identifier, rng.randrange(-(2**20), 2**20))) for _ in range(4)),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
        lookahead_token_ids=tuple(tuple(rng.randrange(300, 200_000) for _ in range(4)) for _ in range(4)),
    )


def _held_and_counted(kind: str, batches: int, size: int, seed: int) -> tuple[int, int, random.Random]:
    """What a journal fed ``batches`` batches of ``size`` fresh events of ``kind`` holds
    (tracemalloc) and what it counts (``bytes``), and the generator after them.

    tracemalloc counts every thread of the process: a thread left by an earlier test in
    the same (pytest-xdist) worker can allocate during a measurement and only add to it.
    The same publications are measured three times; the least is what they take."""
    helds, sizes = [], set()
    for _ in range(3):
        rng = random.Random(seed)
        journal = EventJournal(capacity=1 << 20)
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            for _ in range(batches):
                journal.publish(_fresh_events(kind, size, rng))
            helds.append(tracemalloc.get_traced_memory()[0] - before)
        finally:
            tracemalloc.stop()
        sizes.add(journal.bytes)
    assert len(sizes) == 1  # the same events, the same count
    return min(helds), journal.bytes, rng


@pytest.mark.parametrize("kind", ["removed", "stored", "stored-0.33"])
def test_the_event_buffer_estimate_covers_what_it_holds(kind: str) -> None:
    """Scenario 9: the bytes the buffer counts (and the budget counts, budget.py) are at
    least what its events take, measured by tracemalloc; and past max_bytes it drops
    its oldest, so what it holds stays within the bound however many are published."""
    held, counted, rng = _held_and_counted(kind, batches=1, size=4000, seed=7)
    # (at most 2 x: EVENT_BYTES was sized when the journal also held a (sequence,
    # event) tuple and a deque entry per event; it was kept, so that bounds and pool
    # estimates stay as they were, and a one-hash BlockRemoved is now over-counted ~1.8 x;
    # one batch, so kept as published: the compact form is the next test's)
    assert held <= counted <= 2 * held
    bounded = EventJournal(capacity=1 << 20, max_bytes=counted // 10)
    for _ in range(20):
        bounded.publish(_fresh_events(kind, 400, rng))
        assert bounded.bytes <= bounded.max_bytes
    assert bounded.last_sequence == 8000 and bounded.oldest_sequence > 7000
    assert bounded.missed(0) and not bounded.missed(bounded.oldest_sequence - 1)


@pytest.mark.parametrize("kind", ["removed", "stored", "stored-0.33"])
def test_the_event_buffer_estimate_covers_its_compact_events(kind: str) -> None:
    """The journal keeps a batch as published until the next publish, then in a compact
    form (service/events.py, _kept_form): the bytes it counts still cover what it holds
    with nine batches compact and the last as published (measured by tracemalloc, the
    least of three runs, as above)."""
    held, counted, _ = _held_and_counted(kind, batches=10, size=400, seed=11)
    assert held <= counted


def test_the_pools_memory_estimate_includes_its_event_buffer(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Scenario 9 over gRPC: GetStats counts the event buffer's bound in the pool's
    estimate (pool_bytes), reports what the buffer holds, and under eviction storms of
    far more events than the bound holds (event_buffer's count not reached) what it
    holds stays within it, while a reader behind is told of the gap."""
    server = make_server(STORM_POOL)
    with KVCoordClient(server.address, timeout=ANSWER_WITHIN) as client:
        sid, fence = attach(client, "storm", block_size=16)
        stats = client.get_stats("storm")
        assert stats.event_buffer_max_bytes == event_buffer_bytes(512, 16)
        assert stats.pool_memory_bytes == pool_bytes(512, 16)
        assert stats.pool_memory_bytes == 512 * (
            ENGINE_BLOCK_BYTES + 16 * ENGINE_TOKEN_BYTES
        ) + event_buffer_bytes(512, 16)
        assert stats.limits.pool_memory_bytes == stats.pool_memory_bytes
        peak = 0
        for i in range(60):  # ~70 KB of events each: 6 times the buffer's bound
            storm_step(client, sid, fence, i)
            peak = max(peak, client.get_stats("storm").event_buffer_bytes)
        assert 0 < peak <= stats.event_buffer_max_bytes
        assert client.get_stats("storm").limits.event_buffer > 120  # the count bound was not what held it
        taken = client.step("storm", [], sid, fence, include_state=True)
        assert taken.events_gap


def test_the_docs_give_the_estimate_the_server_uses() -> None:
    """README, deploy/README and the default config state the per-block and per-token
    figures budget.py uses (events included)."""
    root = Path(__file__).resolve().parents[2]
    formula = f"{BLOCK_BYTES} + {TOKEN_BYTES} x hash_block_size"
    assert formula in (root / "README.md").read_text()
    assert formula in (root / "server/kvcoord/service/default_config.toml").read_text()
    assert formula.replace(" x ", " × ") in (root / "deploy/README.md").read_text()
    assert (
        f"{EVENT_BLOCK_BYTES} per block and {EVENT_TOKEN_BYTES} per token" in (root / "README.md").read_text()
    )


def test_a_whole_pool_replaced_between_two_takes_fits_the_byte_bound() -> None:
    """The byte bound holds a BlockRemoved and a one-block BlockStored per block: a
    session taking events every step loses none to it, even when one step replaces
    every cached block of the pool by blocks stored one per event."""
    from kvcoord.client.hashing import BlockHasher, none_hash
    from kvcoord.engine import FullAttentionSpec, KVCacheConfig
    from kvcoord.service import operations as op
    from kvcoord.service.pool_service import PoolService
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock

    root = none_hash("sha256_cbor", "0")
    cfg = KVCacheConfig(
        num_blocks=65, groups=(FullAttentionSpec(4),), hash_block_size=4, enable_kv_cache_events=True
    )
    p = PoolService(
        "p", cfg, ("sha256_cbor", 4, "0"), Fence("i", 1), Limits(), SessionTable(ManualClock(), 30, 60)
    )
    s = p.attach("sha256_cbor", 4, "0", "w", 0)

    def one_block_requests(base: int) -> list[op.Operation]:
        ops: list[op.Operation] = []
        for i in range(64):
            tokens = [base + 4 * i + t for t in range(4)]
            sync = op.RequestSync(
                f"r{base}-{i}", tokens, BlockHasher("sha256_cbor", 4, root).extend(tokens), True
            )
            ops.append(op.Allocate(sync, 4))
        return ops + [op.Free(f"r{base}-{i}") for i in range(64)]

    assert all(o.error is None for o in p.apply(s, one_block_requests(1000)))
    p.take_events(s)
    assert all(o.error is None for o in p.apply(s, one_block_requests(5000)))  # evicts all 64
    taken = p.take_events(s)
    assert not taken.gap and p.events.bytes <= p.events.max_bytes
    assert sum(isinstance(e, BlockRemoved) for e in taken.events) == 64
    assert sum(len(e.block_hashes) for e in taken.events if isinstance(e, BlockStored)) == 64
