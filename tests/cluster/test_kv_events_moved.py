"""A pool's ``[[kv_events]]`` stream while the pool moves between replicas A -> B -> A
(real replica processes, a real etcd, real ZMQ sockets), read by a router's index.

Each replica publishes the pool's events while it serves the pool. The pool's event
journal keeps its newest events only (``[limits] event_buffer``), and goes with the
pool. A subscriber holds a count of cached blocks per hash, as docs/routing.md's
does, and replays on a gap. After each phase its index must claim no hit the pool
would not give (the router's hit, checked against ``ScorePools``), and it must never
be sent the removal of a block it holds none of (docs/routing.md's ``apply`` raises
KeyError on it; a tolerant count goes negative and hides, or claims, the hash)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from durable_server import env  # noqa: E402
from etcd_process import Etcd  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.testing import ServerProcess, start_server  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402
from service import test_kv_publisher_faults as faults  # noqa: E402
from service.helpers import hashes, new_request  # noqa: E402
from test_handover import wait_placed  # noqa: E402
from test_replicas import placed, replica_config, wait_members  # noqa: E402

BLOCK = 4
POOL_CONFIG = pb.PoolConfig(
    num_blocks=13, hash_block_size=BLOCK, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    enable_kv_cache_events=True, max_model_len=128,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BLOCK))],
)  # fmt: skip


class Subscriber(faults.Subscriber):
    """docs/routing.md's loop (0.16 payloads, raw-byte hashes): a count of cached
    blocks per hash, a replay from its last number plus one on a gap; a removal of a
    hash it holds no block of is noted (checked per phase) instead of failing at once."""

    def __init__(self, endpoint: str, replay_endpoint: str) -> None:
        super().__init__(faults.Endpoints(endpoint, replay_endpoint))
        #: removals of a hash this subscriber held no block of
        self.unknown_removals: list[bytes] = []
        self.connect()

    def removed(self, h: bytes) -> None:
        if self.index[h] <= 0:  # docs/routing.md's dict: KeyError
            self.unknown_removals.append(h)
        self.index[h] -= 1
        if not self.index[h]:
            del self.index[h]

    def drain(self, quiet_ms: int = 1500) -> None:
        super().drain(quiet_ms)

    def claimed_hit(self, tokens: list[int]) -> int:
        """The hit (tokens) this index predicts: its run of held hashes, at most
        ``num_tokens - 1`` tokens, as FindLongestCacheHit counts it."""
        run = 0
        for h in hashes(tokens, BLOCK)[: (len(tokens) - 1) // BLOCK]:
            if self.index[h] <= 0:
                break
            run += 1
        return run * BLOCK


def _prompt(i: int) -> list[int]:
    return [1000 * (i + 1) + t for t in range(9)]  # two full blocks and a token


def _kv_events(pool: str) -> str:
    """A replica's ``[[kv_events]]`` table for ``pool``: bound on 127.0.0.1, any port."""
    return (
        f'[[kv_events]]\npool = "{pool}"\nendpoint = "tcp://127.0.0.1:*"\n'
        'replay_endpoint = "tcp://127.0.0.1:*"\ntopic = "kv"\nint_hashes = false\n'
    )


def _endpoints(proc: ServerProcess) -> tuple[str, str]:
    """The publisher's bound PUB and replay addresses, as its log names them."""
    for _ in range(200):
        found = re.search(
            r"KV events in vLLM's format on (\S+) \(replay (\S+)\)", Path(proc.log_path).read_text()
        )
        if found:
            return found.group(1), found.group(2)
        time.sleep(0.05)
    raise AssertionError("the publisher's endpoints are not logged")


def _hits(addresses: list[str], pool: str, prompts: list[list[int]]) -> list[int]:
    """ScorePools' hit of each prompt in ``pool``."""
    out = []
    with KVCoordClient(addresses, timeout=10) as c:
        for tokens in prompts:
            prompt = pb.HashedPrompt(
                hash_algo="sha256_cbor",
                hash_block_size=BLOCK,
                hash_seed="0",
                block_hashes=hashes(tokens, BLOCK),
            )
            r = c.score_pools(len(tokens), [prompt], [pool])
            out.append(next(s.hit_tokens for s in r.scores if s.pool == pool))
    return out


def _check(
    sub: Subscriber, addresses: list[str], pool: str, prompts: list[list[int]], phase: str, serving: bool
) -> None:
    """No removal of a block the subscriber was not sent, no hit claimed that the pool
    would not give; and, from the serving replica's publisher, every hit it gives."""
    assert not sub.unknown_removals, (
        f"{phase}: {len(sub.unknown_removals)} removal(s) of blocks the subscriber was never sent "
        "(docs/routing.md's apply raises KeyError)"
    )
    assert all(n > 0 for n in sub.index.values()), f"{phase}: negative counts {sub.index}"
    actual = _hits(addresses, pool, prompts)
    claimed = [sub.claimed_hit(t) for t in prompts]
    false = [(i, c, a) for i, (c, a) in enumerate(zip(claimed, actual, strict=True)) if c > a]
    assert not false, (
        f"{phase}: the index claims hits the pool would not give (prompt, claimed, actual): {false}"
    )
    if serving:
        assert claimed == actual, f"{phase}: claimed {claimed}, ScorePools {actual}"


def test_a_pool_moved_away_and_back_leaves_its_subscribers_no_unknown_removal(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """r0 serves the pool, whose journal keeps 8 events (older ones dropped); r1 joins
    (the pool moves to r1), then leaves (SIGTERM: the pool moves back to r0). r0's
    subscriber is sent a clear when the pool leaves, and r1's holds nothing before the
    pool arrives: the kept events each then receives remove blocks stored before them,
    which neither holds."""
    cluster = request.node.name[:40]
    ids = ["r0", "r1"]
    pool = placed("ev", "r1", ids)
    procs: dict[str, ServerProcess] = {}
    subs: list[Subscriber] = []
    endpoints: dict[str, tuple[str, str]] = {}

    def start(replica: str) -> ServerProcess:
        config = replica_config(etcd, replica, tmp_path / replica, cluster)
        config += "[limits]\nevent_buffer = 8\n" + _kv_events(pool)
        procs[replica] = start_server(config, env=env())
        endpoints[replica] = _endpoints(procs[replica])
        return procs[replica]

    try:
        r0 = start("r0")
        with KVCoordClient([r0.address], timeout=10) as c:
            assert c.create_pool(pool, POOL_CONFIG).pool.replica == "r0"
        s0 = Subscriber(*endpoints["r0"])
        subs.append(s0)
        time.sleep(1.5)  # (the publisher's first look at the pool: it looks once a second)
        prompts = [_prompt(i) for i in range(8)]
        with KVCoordClient([r0.address], timeout=10) as c:
            s = c.attach(pool, "sha256_cbor", BLOCK, "0", lease_seconds=60)
            sid, fence = s.session_id, s.fence

            def step(ops: list[pb.Operation]) -> None:
                assert not any(r.status_code for r in c.step(pool, ops, sid, fence).results)
                s0.drain()  # (each Step's events sent before the next: no gap at r0)

            def alloc(rid: str, i: int) -> pb.Operation:
                return pb.Operation(
                    allocate=pb.AllocateOp(request=new_request(rid, prompts[i]), num_new_tokens=9)
                )

            step([alloc(f"a{i}", i) for i in range(4)])  # 8 cached blocks: 4 events
            step([pb.Operation(free=pb.FreeOp(request_id=f"a{i}")) for i in range(4)])
            # evicts a0's and a1's blocks: 6 events, the journal keeps the last 8 of 10
            step([alloc(f"b{i}", 4 + i) for i in range(2)])
            step([pb.Operation(free=pb.FreeOp(request_id=f"b{i}")) for i in range(2)])
        _check(s0, [r0.address], pool, prompts, "r0 serving", serving=True)
        assert s0.index

        r1 = start("r1")
        s1 = Subscriber(*endpoints["r1"])
        subs.append(s1)
        wait_members([r0, r1], ids)
        wait_placed([r0.address, r1.address], {pool: "r1"})
        s0.drain()
        s1.drain()
        _check(s0, [r1.address], pool, prompts, "r0's subscriber, the pool at r1", serving=False)
        _check(s1, [r1.address], pool, prompts, "r1's subscriber, the pool at r1", serving=True)

        assert r1.stop() == 0
        wait_placed([r0.address], {pool: "r0"})
        s0.drain()
        _check(s0, [r0.address], pool, prompts, "r0's subscriber, the pool back at r0", serving=True)
    finally:
        for sub in subs:
            sub.close()
        for p in procs.values():
            p.stop()
