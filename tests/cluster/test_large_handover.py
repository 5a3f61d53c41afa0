"""A pool whose state is larger than one message is handed over all the same.

The receiving replica's ``server.max_message_bytes`` bounds every message it receives,
and a handover sent the pool's whole state in one ``Replicas.AdoptPool``: a pool past
the limit (about 160,000 blocks in use at the default 16 MiB) was refused
RESOURCE_EXHAUSTED at every rebalance pass, and a replica told to leave could not hand
it over (with local journals the pool then waited, unserved, for that replica to come
back). The state now goes in parts (``AdoptPoolParts``, handover_parts.py), each under
the limit, assembled and checked (size, order, SHA-256) before anything is adopted.

Here the replicas run with a small limit (:data:`LIMIT`) so that a pool of modest
size (:data:`BIG`, about 750 KB of state) is past it. Real etcd, real ``kvcoord serve``
processes, real gRPC; a broken stream is made by a channel interceptor on the sender's
peer channel (the sender in the test's process) or by SIGKILLing the sender mid-stream;
a replica of the previous release is one whose Replicas service has no
``AdoptPoolParts`` (a server hook registers the old table). After every handover, or
every one that failed, each of the pool's requests holds the blocks it was acknowledged
and CheckPool finds nothing wrong, on the one replica that serves it."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import durable_server
import earlier_release
import grpc
import pytest
from durable_server import free_port
from etcd_process import Etcd
from kvcoord.client import KVCoordClient, NotOwnerError
from kvcoord.client.errors import error_from_rpc
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.service.config import parse_config
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from replica_here import replica_here
from service.helpers import allocate
from test_replicas import POOL_CONFIG, claims, placed, replica_config
from workload import check_pool

IDS = ["r0", "r1"]
#: every replica's max_message_bytes here: a message past it is refused unread
LIMIT = 256 * 1024
#: blocks of the large pool
BLOCKS = 8192
BIG = pb.PoolConfig(
    num_blocks=BLOCKS, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0", enable_caching=True,
    groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
)  # fmt: skip
#: requests filling it, each of PROMPT_TOKENS tokens (250 blocks): 7,500 blocks held
REQUESTS = 30
PROMPT_TOKENS = 1000
#: a bound on every wait here (seconds), not a measurement
BOUND = 60.0
#: the sessions' lease: past every wait (nobody renews them meanwhile)
SESSION_LEASE = 120.0
LEASE = 2


def _lines(journal: str) -> tuple[str, str]:
    cluster = 'journal = "store"\n' if journal == "store" else ""
    return f"max_message_bytes = {LIMIT}\n", cluster


def _start(etcd: Etcd, replica: str, tmp: Path, name: str, journal: str, **kw: Any) -> ServerProcess:
    server, cluster = _lines(journal)
    text = replica_config(etcd, replica, tmp / replica, name, server, cluster, lease=LEASE)
    return start_server(text, env=kw.pop("env", None) or durable_server.env(), **kw)


Held = tuple[pb.AttachResponse, dict[str, list[int]]]


def _fill(address: str | list[str], pool: str, small: bool = False) -> Held:
    """Create ``pool`` (:data:`BIG`; ``small``: POOL_CONFIG, one request of 40 tokens)
    and hold :data:`REQUESTS` requests' blocks in it (distinct prompts: nothing
    shared); the session and each request's blocks."""
    config, requests, tokens = (POOL_CONFIG, 1, 40) if small else (BIG, REQUESTS, PROMPT_TOKENS)
    with KVCoordClient(address, timeout=30.0) as c:
        c.create_pool(pool, config)
        s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=SESSION_LEASE)
        held = {}
        for n in range(requests):
            rid = f"req{n}"
            prompt = list(range(n * tokens, (n + 1) * tokens))
            got = c.allocate(pool, allocate(rid, prompt, tokens).allocate, s.session_id, s.fence)
            assert not got.result.refused
            held[rid] = list(got.result.new_block_ids[0].block_ids)
        return s, held


def _intact(address: str | list[str], pool: str, filled: Held, replica: str) -> None:
    """``pool`` is served by ``replica`` with every request's blocks as acknowledged,
    its session alive, its blocks consistent (CheckPool and the free queue)."""
    s, held = filled
    with KVCoordClient(address, timeout=30.0) as c:
        assert c.get_pool(pool).pool.replica == replica
        view = c.inspect_pool(pool, request_ids=sorted(held))
        assert {r.request_id: list(r.groups[0].block_ids) for r in view.requests} == held
        c.heartbeat(s.session_id, s.fence)  # the session moved with the pool
        assert not c.check_pool(pool).violations
        num_blocks = BLOCKS if len(held) > 1 else POOL_CONFIG.num_blocks
        assert check_pool(c, pool, num_blocks) == len(held)


def _until(what: Any, message: str, bound: float = BOUND) -> None:
    deadline = time.monotonic() + bound
    while not what():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)


@pytest.mark.parametrize(("move", "journal"), [("leave", "local"), ("join", "store")])
def test_a_pool_larger_than_a_message_is_handed_over(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, move: str, journal: str
) -> None:
    """``leave``: r1 holds the pool and stops gracefully (SIGTERM): r0 serves it, its
    blocks and session intact (was: refused RESOURCE_EXHAUSTED, the pool left unclaimed
    with r1's lease). ``join``: r0 holds a pool placed on r1, and r1 joins: the
    rebalance hands it over (was: refused at every pass, kept on r0 for good)."""
    name = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("big", "r1", IDS)
    procs: list[ServerProcess] = []
    try:
        procs.append(_start(etcd, "r0", tmp_path, name, journal))
        if move == "leave":
            procs.append(_start(etcd, "r1", tmp_path, name, journal))
        filled = _fill([p.address for p in procs], pool)
        if move == "leave":
            assert claims(etcd, name) == {pool: "r1"}
            leaving = procs.pop()
            assert leaving.stop() == 0
            assert claims(etcd, name) == {pool: "r0"}, leaving.log()[-3000:]
            _intact(procs[0].address, pool, filled, "r0")
        else:
            assert claims(etcd, name) == {pool: "r0"}
            procs.append(_start(etcd, "r1", tmp_path, name, journal))
            _until(lambda: claims(etcd, name) == {pool: "r1"}, f"never handed over: {procs[0].log()[-3000:]}")
            _intact(procs[1].address, pool, filled, "r1")
    finally:
        for p in procs:
            p.stop()


class _Broken(grpc.aio.StreamUnaryClientInterceptor):
    """Breaks each AdoptPoolParts stream the sender's peer channel sends until
    :attr:`allow` (``kind``: a piece left out at the end, sent twice, two pieces
    swapped, or one byte of a piece changed)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.allow = False
        self.broken = 0

    async def intercept_stream_unary(self, continuation: Any, details: Any, parts: Any) -> Any:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        if method.endswith("/AdoptPoolParts") and not self.allow:
            self.broken += 1
            parts = self._broken(parts)
        return await continuation(details, parts)

    async def _broken(self, parts: AsyncIterator[pb.AdoptPoolPart]) -> AsyncIterator[pb.AdoptPoolPart]:
        stream = aiter(parts)
        yield await anext(stream)  # the header as it is: the callee accepts it before the pieces come
        got = [p async for p in stream]  # the pieces
        assert len(got) >= 3, f"{len(got)} pieces: the state fits fewer parts than the test needs"
        if self.kind == "truncated":
            got = got[:-1]
        elif self.kind == "duplicated":
            got = [*got[:2], got[1], *got[2:]]
        elif self.kind == "reordered":
            got = [got[1], got[0], *got[2:]]
        else:  # corrupt: same size and order, one byte changed
            changed = bytearray(got[1].data)
            changed[len(changed) // 2] ^= 0xFF
            got[1] = pb.AdoptPoolPart(offset=got[1].offset, data=bytes(changed))
        for part in got:
            yield part


#: what the receiver names, for each broken stream
WHY = {"truncated": "the stream ended after", "duplicated": "out of order", "reordered": "out of order",
       "corrupt": "its SHA-256 differs"}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(WHY))
def test_a_broken_stream_of_parts_adopts_nothing_and_the_pool_stays_served(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    """r0 (in the test's process) holds a large pool placed on r1; r1 joins. Each
    AdoptPoolParts stream r0 sends is broken on its way (a channel interceptor) until
    the test allows it: r1 refuses it (INVALID_ARGUMENT) before adopting anything, r0
    serves the pool again (r1 redirects to it), with every block; once the streams
    pass, the next pass hands the pool over, and r1 serves it, intact."""
    name = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("big", "r1", IDS)
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(
        f'[server]\nlisten = ["{address}"]\ndata_dir = "{tmp_path / "r0"}"\nsynchronous = "NORMAL"\n'
        f"grace_seconds = 5\nmax_message_bytes = {LIMIT}\n"
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{name}"\nreplica_id = "r0"\n'
        f'lease_seconds = {LEASE}\nstore_timeout_seconds = 2.0\njournal = "store"\n'
    )
    broken = _Broken(kind)

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster):
            plain = cluster.peer_channel
            options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
            cluster.peer_channel = lambda peer: grpc.aio.insecure_channel(  # type: ignore[method-assign]
                peer, options=options, interceptors=[broken]
            )
            filled = await asyncio.to_thread(_fill, address, pool)
            r1 = await asyncio.to_thread(_start, etcd, "r1", tmp_path, name, "store")
            try:
                refused = f"the handed-over state of pool {pool!r} is refused, nothing adopted: "
                for _ in range(int(BOUND / 0.1)):  # bounded: a broken stream was refused
                    if re.search(re.escape(refused) + rf".*{WHY[kind]}", caplog.text):
                        break
                    await asyncio.sleep(0.1)
                assert re.search(re.escape(refused) + rf".*{WHY[kind]}", caplog.text), caplog.text[-3000:]
                assert "StatusCode.INVALID_ARGUMENT" in caplog.text and broken.broken >= 1
                # tried again after a pause growing from 1 s, not at each pass of the watch
                # (which the failure's claim, put again, starts at once: 10-20 tries a second)
                tries = broken.broken
                await asyncio.sleep(3.0)
                assert broken.broken - tries <= 3, f"{broken.broken - tries} tries in 3 s"
                for _ in range(int(BOUND / 0.1)):  # bounded: served here again
                    if pool not in cluster.view.moving:
                        break
                    await asyncio.sleep(0.1)
                assert f"adopted pool {pool}" not in r1.log()
                await asyncio.to_thread(_intact, address, pool, filled, "r0")
                async with grpc.aio.insecure_channel(r1.address) as channel:  # r1 sends callers to r0
                    with pytest.raises(grpc.aio.AioRpcError) as redirect:
                        await pb_grpc.AllocatorStub(channel).GetPool(pb.GetPoolRequest(name=pool), timeout=10)
                told = error_from_rpc(redirect.value)
                assert isinstance(told, NotOwnerError) and told.owner == address, told
                assert (await asyncio.to_thread(claims, etcd, name)) == {pool: "r0"}
                broken.allow = True
                for _ in range(int(BOUND / 0.2)):  # bounded: the next pass hands it over
                    if (await asyncio.to_thread(claims, etcd, name)) == {pool: "r1"}:
                        break
                    await asyncio.sleep(0.2)
                assert (await asyncio.to_thread(claims, etcd, name)) == {pool: "r1"}, r1.log()[-3000:]
                await asyncio.to_thread(_intact, r1.address, pool, filled, "r1")
                assert pool not in cluster.local_pools()
            finally:
                cluster.peer_channel = plain  # type: ignore[method-assign]
                await asyncio.to_thread(r1.stop)

    asyncio.run(run())


HOLD = """
import asyncio
import os

hold = os.environ.get("KVCOORD_TEST_HOLD_PARTS")
if hold:  # this replica's AdoptPoolParts waits after the first piece while the file exists
    import kvcoord.service.handover_parts as hp

    assemble = hp.assemble

    async def _assemble(parts, header):
        async def held():
            n = 0
            async for part in parts:
                yield part
                n += 1
                if n == 1:
                    open(hold + ".entered", "w").close()
                    while os.path.exists(hold):
                        await asyncio.sleep(0.01)

        return await assemble(held(), header)

    hp.assemble = _assemble
"""


def test_a_sender_killed_mid_stream_leaves_the_pool_served_once(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r0 holds a large pool placed on r1 (journal = "store") and r1 joins; r1's
    AdoptPoolParts holds after the first piece (a server hook) and r0 is SIGKILLed
    there. r1 adopts nothing from the cut stream; r0's lease ends and r1 takes the pool
    over from the store: served once, by r1, every block as acknowledged."""
    name = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("big", "r1", IDS)
    durable_server.with_sitecustomize(tmp_path, HOLD + earlier_release.HOOK, monkeypatch)
    hold = tmp_path / "hold"
    hold.touch()
    procs: list[ServerProcess] = []
    try:
        procs.append(_start(etcd, "r0", tmp_path, name, "store"))
        filled = _fill(procs[0].address, pool)
        e = durable_server.env()
        e["KVCOORD_TEST_HOLD_PARTS"] = str(hold)
        procs.append(_start(etcd, "r1", tmp_path, name, "store", env=e))
        _until(lambda: Path(f"{hold}.entered").exists(), "r0 never sent the pool's parts")
        os.kill(procs[0].proc.pid, signal.SIGKILL)
        procs[0].proc.wait(timeout=BOUND)
        hold.unlink()
        _until(lambda: claims(etcd, name) == {pool: "r1"}, f"never taken over: {procs[1].log()[-3000:]}")
        _intact(procs[1].address, pool, filled, "r1")
        assert f"adopted pool {pool}" not in procs[1].log()
    finally:
        for p in procs:
            p.stop()


def _failed(server: ServerProcess) -> dict[str, float]:
    """kvcoord_handovers_failed_total from the replica's /metrics: reason -> count."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10) as r:
        body = r.read().decode()
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(body)
        if f.name == "kvcoord_handovers_failed"
        for s in f.samples
        if s.name.endswith("_total")
    }


def test_a_replica_of_the_previous_release_gets_small_pools_and_a_large_one_fails_loudly_once(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rolling upgrade: r0 (this release) holds a small pool and a large one, both
    placed on r1, which joins running a release without AdoptPoolParts (UNIMPLEMENTED).
    The small pool goes with AdoptPool as before; the large one cannot: r0 says why
    (log: upgrade that replica; kvcoord_handovers_failed{reason="peer_release"}),
    serves it again, intact, and does not send it again at every pass (the watch
    passes at least every lease, 2 s here) but only after a pause."""
    name = request.node.name.replace("[", "-").rstrip("]")
    small, large = placed("small", "r1", IDS), placed("big", "r1", IDS)
    durable_server.with_sitecustomize(tmp_path, HOLD + earlier_release.HOOK, monkeypatch)
    procs: list[ServerProcess] = []
    try:
        procs.append(_start(etcd, "r0", tmp_path, name, "local", metrics=True))
        small_filled = _fill(procs[0].address, small, small=True)
        large_filled = _fill(procs[0].address, large)
        e = durable_server.env()
        e.update(earlier_release.env_of("AdoptPool", "ScoreForTenant"))
        procs.append(_start(etcd, "r1", tmp_path, name, "local", env=e))
        _until(
            lambda: claims(etcd, name).get(small) == "r1", f"small pool not moved: {procs[0].log()[-3000:]}"
        )
        _until(
            lambda: _failed(procs[0]).get("peer_release", 0) >= 1,
            f"no failure told: {procs[0].log()[-3000:]}",
        )
        log = procs[0].log()
        assert re.search(
            rf"pool {large} cannot be handed over to replica r1 .*UNIMPLEMENTED.*upgrade that replica", log
        )
        _intact(procs[1].address, small, small_filled, "r1")
        before = _failed(procs[0])
        assert before["peer_release"] == 1 and before["peer_limit"] == 0, before
        time.sleep(5 * LEASE)  # passes of the watch: none sends the large pool again
        assert _failed(procs[0]) == before
        assert claims(etcd, name) == {small: "r1", large: "r0"}
        _intact([p.address for p in procs], large, large_filled, "r0")
    finally:
        for p in procs:
            p.stop()


def test_a_tenant_cannot_send_a_pool_in_parts(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """``Replicas.AdoptPoolParts`` is between replicas: a tenant's token is refused
    (PERMISSION_DENIED), no token is not authenticated, before any part is read; the
    replicas' full-access token reaches the handler (a stream without a header refused)."""
    name = request.node.name.replace("[", "-").rstrip("]")
    tenants = '[tenants.alice]\ntokens = ["tok-alice"]\ngrants = [{ pools = ["a*"], roles = ["use", "observe", "administer"] }]\n'
    text = replica_config(etcd, "r0", tmp_path / "r0", name, 'auth_tokens = ["tok-root"]\n', lease=LEASE)
    r0 = start_server(text + tenants, env=durable_server.env())
    parts = [
        pb.AdoptPoolPart(
            header=pb.AdoptPoolHeader(
                pool="a1", from_replica="r9", state_bytes=1, part_bytes=1, state_sha256=b"\0" * 32
            )
        ),
        pb.AdoptPoolPart(offset=0, data=b"x"),
    ]
    try:
        with grpc.insecure_channel(r0.address) as channel:
            call = pb_grpc.ReplicasStub(channel).AdoptPoolParts  # type: ignore[no-untyped-call]
            for token, code in (
                ("tok-alice", grpc.StatusCode.PERMISSION_DENIED),
                ("", grpc.StatusCode.UNAUTHENTICATED),
            ):
                metadata = (("authorization", f"Bearer {token}"),) if token else None
                with pytest.raises(grpc.RpcError) as refused:
                    call(iter(parts), metadata=metadata, timeout=10)
                assert refused.value.code() is code, refused.value
                if token:
                    assert "between replicas" in (refused.value.details() or "")
            with pytest.raises(grpc.RpcError) as reached:
                call(iter(parts[1:]), metadata=(("authorization", "Bearer tok-root"),), timeout=10)
            assert reached.value.code() is grpc.StatusCode.INVALID_ARGUMENT, reached.value
            assert "starts with its header" in (reached.value.details() or "")
    finally:
        r0.stop()
