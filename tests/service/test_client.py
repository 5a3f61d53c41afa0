"""The client library against a real server: RemoteKVCacheManager equals the in-process
engine call for call; the step batcher, the asyncio client and retries."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import subprocess
import sys
import textwrap
from typing import Any

import grpc
import pytest
from helpers import allocate
from kvcoord.client import (
    NO_RETRY,
    AbortedError,
    AsyncKVCoordClient,
    InvalidArgumentError,
    KVCoordClient,
    NotFoundError,
    RandomSeedError,
    RemoteKVCacheManager,
    RequestUnknownError,
    RetryPolicy,
    UnavailableError,
)
from kvcoord.client.errors import error_from_code
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import CacheHit, FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.service.testing import InProcessServer
from support import Req


def test_remote_manager_equals_engine(server: InProcessServer, client: KVCoordClient) -> None:
    """Hits, new blocks, refusals, frees and usage equal an in-process pool's, step by step."""
    remote = RemoteKVCacheManager(client, "p", hash_seed="0", client_name="test")
    local = KVCachePool(
        KVCacheConfig(
            num_blocks=64,
            groups=(FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
            hash_block_size=4,
            enable_kv_cache_events=True,
            max_model_len=256,
        )  # fmt: skip
    )
    none = none_hash("sha256_cbor", "0")
    hashers: dict[str, BlockHasher] = {}
    rnd = random.Random(3)
    prefixes = [[rnd.randrange(50) for _ in range(n)] for n in (0, 6, 13, 24)]
    live: dict[str, Req] = {}
    running: set[str] = set()
    checks = {"hits": 0, "refusals": 0, "allocs": 0}
    for step in range(150):
        if rnd.random() < 0.4:
            rid = f"r{step}"
            tokens = (rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randint(1, 30))])[:60]
            live[rid] = Req(rid, tokens)
            hashers[rid] = BlockHasher("sha256_cbor", 4, none)
            local.add_request(rid, tokens, hashers[rid].extend(tokens))
        for rid in sorted(live):
            r = live[rid]
            if rnd.random() < 0.08:
                remote.free(r)
                local.free(rid)
                del live[rid]
                running.discard(rid)
                continue
            if rid not in running:
                hit_ids, hit_tokens = remote.get_computed_blocks(r)
                want = local.get_computed_blocks(rid)
                assert (hit_ids.get_block_ids(), hit_tokens) == (
                    tuple(list(x) for x in want.block_ids),
                    want.num_tokens,
                )
                n = min(len(r.all_token_ids) - hit_tokens, rnd.choice([4, 16, 64]))
                got = remote.allocate_slots(r, n, hit_tokens, hit_ids)
                exp = local.allocate_slots(rid, n, want.num_tokens, want)
                checks["hits"] += hit_tokens > 0
            else:
                n = min(len(r.all_token_ids) - r.num_computed_tokens, 16)
                if n == 0 or r.num_computed_tokens + n >= 250:
                    continue
                got = remote.allocate_slots(r, n)
                exp = local.allocate_slots(rid, n)
            assert (None if got is None else got.get_block_ids()) == (
                None if exp is None else tuple(list(x) for x in exp)
            )
            if exp is None:
                checks["refusals"] += 1
                continue
            checks["allocs"] += 1
            running.add(rid)
            r.num_computed_tokens += n
            new = [step % 50] if r.num_computed_tokens == len(r.all_token_ids) else []
            r.all_token_ids = r.all_token_ids + new
            local.update_request(rid, num_computed_tokens=r.num_computed_tokens, append_token_ids=new,
                                 append_block_hashes=hashers[rid].extend(new))  # fmt: skip
        assert remote.usage == local.usage
    assert [e.SerializeToString() for e in remote.take_events()] and local.take_events()
    stats = remote.make_prefix_cache_stats()
    want_stats = local.make_prefix_cache_stats()
    assert stats is not None and want_stats is not None
    assert (stats.queries, stats.hits, stats.requests) == (
        want_stats.queries,
        want_stats.hits,
        want_stats.requests,
    )
    # GetStats reports the pool's lifetime lookup totals: the same numbers, and not reset
    # by make_prefix_cache_stats (which reset only this session's own statistics)
    lifetime = client.get_stats("p").prefix_cache_stats
    assert (lifetime.requests, lifetime.queries, lifetime.hits) == (stats.requests, stats.queries, stats.hits)
    again = remote.make_prefix_cache_stats()
    assert again is not None and (again.requests, again.queries, again.hits) == (0, 0, 0)
    assert client.get_stats("p").prefix_cache_stats == lifetime
    assert checks["hits"] > 10 and checks["refusals"] > 0 and checks["allocs"] > 100, checks
    remote.close()


def test_step_batcher_one_round_trip(client: KVCoordClient) -> None:
    """A batch's calls resolve after flush; after a failed call the rest are aborted. An
    aborted free is sent again (the manager forgot its request when it was freed: a
    batch's free frees whatever happens to the batch), so the server no longer holds
    the request, as the manager believes (before: the server kept "a" until the session
    ended, and a free called again found nothing to free)."""
    m = RemoteKVCacheManager(client, "p", hash_seed="0")
    a, b = Req("a", list(range(10))), Req("b", list(range(10)))
    with m.batch() as batch:
        pa = batch.allocate_slots(a, 10)
        pb_ = batch.allocate_slots(b, 10)
        with pytest.raises(RuntimeError, match="not been flushed"):
            pa.result()
    assert pa.result() is not None and pb_.result() is not None
    assert pa.result().get_block_ids() == ([1, 2, 3], [4, 5, 6])  # type: ignore[union-attr]
    batch = m.batch()
    p1 = batch.get_block_ids("a")
    p2 = batch.get_block_ids("ghost")
    p3 = batch.free(a)
    batch.flush()
    assert p1.result() == ([1, 2, 3], [4, 5, 6])
    with pytest.raises(NotFoundError):
        p2.result()
    with pytest.raises(AbortedError):  # (not applied by that Step)
        p3.result()
    assert [r.request_id for r in client.inspect_pool("p", all_requests=True).requests] == ["b"]
    with pytest.raises(RequestUnknownError):
        m.get_block_ids("a")
    m.free(Req("never-sent", [1, 2]))  # aborted while waiting: valid, nothing to free
    m.close()


def test_manager_refuses_without_seed(client: KVCoordClient, monkeypatch: pytest.MonkeyPatch) -> None:
    """With caching on and no PYTHONHASHSEED the manager refuses: hashes could never match."""
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(RandomSeedError):
        RemoteKVCacheManager(client, "p")


def test_async_client(server: InProcessServer) -> None:
    """The asyncio client makes the same calls."""

    async def main() -> tuple[int, int]:
        async with AsyncKVCoordClient(server.address) as c:
            session = await c.attach("p", "sha256_cbor", 4, "0")
            r = await c.allocate("p", allocate("a", list(range(10)), 10).allocate, session.session_id,
                                 session.fence)  # fmt: skip
            s = await c.get_stats("p")
            return len(r.result.new_block_ids[0].block_ids), s.num_requests

    assert asyncio.run(main()) == (3, 1)


def test_retries_stop_at_the_deadline() -> None:
    """UNAVAILABLE is retried with backoff, then surfaced as UnavailableError."""
    policy = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, deadline=0.5, max_attempts=4)
    with KVCoordClient("127.0.0.1:1", timeout=0.2, retry=policy) as c:
        with pytest.raises(UnavailableError):
            c.get_stats("p")


def test_backoffs_are_drawn_only_when_a_call_fails(
    server: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call that succeeds at once draws no backoffs (seeding their generator cost about
    10 us on every call); one that fails with UNAVAILABLE draws them once and is retried."""
    import grpc
    from kvcoord.client.errors import LocalRpcError
    from kvcoord.v1 import allocator_pb2 as pb

    drawn: list[int] = []
    draw = RetryPolicy.backoffs

    def counted(self: RetryPolicy, rnd: random.Random | None = None, count: int | None = None) -> list[float]:
        drawn.append(1)
        return draw(self, rnd, count)

    class FailOnce(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
        armed = False

        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            if self.armed:
                self.armed = False
                raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: one lost call")
            return continuation(details, request)

    monkeypatch.setattr(RetryPolicy, "backoffs", counted)
    fail = FailOnce()
    with KVCoordClient(server.address, retry=RetryPolicy(initial_backoff=0.001), interceptors=[fail]) as c:
        c.create_pool("lazy", pb.PoolConfig(num_blocks=8, hash_block_size=4, groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))]))  # fmt: skip
        for _ in range(20):
            assert c.get_stats("lazy").num_free_blocks == 7
        assert drawn == []
        fail.armed = True
        assert c.get_stats("lazy").num_free_blocks == 7  # retried after one backoff
        assert drawn == [1] and not fail.armed


def test_retry_policy_is_a_value() -> None:
    """Backoffs grow to the cap with full jitter; policies are frozen."""
    p = RetryPolicy(initial_backoff=0.1, max_backoff=0.4, multiplier=2.0, max_attempts=5)
    b = p.backoffs(random.Random(0))
    assert len(b) == 4 and all(0 <= x <= cap for x, cap in zip(b, [0.1, 0.2, 0.4, 0.4], strict=True))
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.deadline = 1  # type: ignore[misc]
    assert dataclasses.replace(p, deadline=1.0).deadline == 1.0


def test_health_serving(client: KVCoordClient) -> None:
    """The standard health service answers SERVING for the server and the Allocator."""
    assert client.health() == "SERVING"
    assert client.health("kvcoord.v1.Allocator") == "SERVING"


def test_cache_hit_type_roundtrip() -> None:
    """CacheHit.is_empty treats null blocks as entries (vLLM's rule)."""
    assert CacheHit(((), ()), 0).is_empty
    assert not CacheHit(((), (0,)), 4).is_empty


def test_a_closed_client_fails_calls_instead_of_crashing(tmp_path: Any) -> None:
    """grpcio crashes the process (SIGSEGV) when an intercepted channel is used after
    close. A closed KVCoordClient raises ValueError instead, and a manager's lease thread
    stops renewing: run in a child process, which must exit normally."""
    script = tmp_path / "closed.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            from kvcoord.client import KVCoordClient, RemoteKVCacheManager
            from kvcoord.client.faults import FaultInjector
            from kvcoord.service.testing import InProcessServer
            from kvcoord.v1 import allocator_pb2 as pb

            srv = InProcessServer("").start()
            c = KVCoordClient(srv.address, interceptors=[FaultInjector(1)])
            c.create_pool("p", pb.PoolConfig(
                num_blocks=16, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0",
                enable_caching=True, max_model_len=64,
                groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))]))
            m = RemoteKVCacheManager(c, "p", hash_seed="0", exclusive=True, lease_seconds=0.6)
            c.close()
            time.sleep(1.0)  # several renewal periods
            try:
                c.list_pools()
            except ValueError as e:
                print("refused:", e)
            srv.stop()
            """
        )
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: ListPools on a closed KVCoordClient" in done.stdout


def test_a_failed_call_does_not_move_an_earlier_calls_position(client: KVCoordClient) -> None:
    """Two calls for one request in one Step, each with its own sync; the first is
    applied, the second fails (a bad count). The client's idea of the request is where
    the first left it, so the next call syncs from there and succeeds."""
    m = RemoteKVCacheManager(client, "p", hash_seed="0")
    r = Req("a", list(range(8)))
    with m.batch() as b:
        first = b.allocate_slots(r, 8)
    assert first.result() is not None
    r.num_computed_tokens = 8
    r.all_token_ids = r.all_token_ids + [1, 2, 3, 4]  # completes a block
    b = m.batch()
    applied = b.allocate_slots(r, 4)
    r.all_token_ids = r.all_token_ids + [5]
    refused = b.cache_blocks(r, 10**6)  # more tokens than the request has
    b.flush()
    assert applied.result() is not None
    with pytest.raises(InvalidArgumentError):
        refused.result()
    r.num_computed_tokens = 12
    assert m.allocate_slots(r, 1) is not None  # syncs token 5 from the right position
    (held,) = [q for q in client.inspect_pool("p", all_requests=True).requests if q.request_id == "a"]
    assert (held.num_tokens, held.num_computed_tokens) == (13, 12)
    assert m.lost_requests == 0
    m.close()


class _CancelFirstAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The server applies the first Step, then its answer is lost as CANCELLED (what a
    server that stops serving mid-call, or a proxy dropping it, tells a caller)."""

    def __init__(self) -> None:
        self.cancelled = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        answer = continuation(details, request)
        if details.method.endswith("/Step") and not self.cancelled:
            answer.result()  # applied on the server
            self.cancelled += 1
            from kvcoord.client.errors import LocalRpcError

            raise LocalRpcError(grpc.StatusCode.CANCELLED, "CANCELLED")
        return answer


def test_a_cancelled_answer_is_an_unknown_outcome_and_a_keyed_call_is_retried(
    server: InProcessServer,
) -> None:
    """Issue 26's chaos run: a server stopping on a full disk cancels the calls in
    flight. CANCELLED (the client never cancels its own calls) says nothing of whether
    the call was applied: a keyed Step is retried with its key and applied once; a
    once-only call would raise OutcomeUnknownError. (Before, CANCELLED was an InternalError
    that reached the worker as a failure, its request's fate unknown.)"""
    cancel = _CancelFirstAnswer()
    # (step_stream=False: the interceptor sees unary Steps; test_step_stream_client.py has the stream's)
    with KVCoordClient(server.address, timeout=10, interceptors=[cancel], step_stream=False) as c:
        s = c.attach("p", "sha256_cbor", 4, "0", "w")
        answer = c.step("p", [allocate("a", list(range(8)), 8)], s.session_id, s.fence)
        assert cancel.cancelled == 1
        given = list(answer.results[0].allocate.new_block_ids[0].block_ids)
        (held,) = c.inspect_pool("p", all_requests=True).requests
        assert held.request_id == "a" and list(held.groups[0].block_ids) == given
    assert isinstance(error_from_code(grpc.StatusCode.CANCELLED, "CANCELLED"), UnavailableError)


def test_a_read_whose_remembered_owner_swallows_packets_goes_to_another_replica() -> None:
    """A stopped replica's address (a pod gone, a container stopped on a bridge network)
    may accept or drop packets without ever answering: a read routed to it by the
    client's memory of the pool's owner ends in DEADLINE_EXCEEDED, which no retry
    policy repeats. The client forgets that owner and, the read being safe to send
    again, asks the replica the set now routes it to, within the same call."""
    import socket

    from kvcoord.v1 import allocator_pb2 as pb

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(1)  # the kernel completes connections; nobody ever answers on them
    black = f"127.0.0.1:{hole.getsockname()[1]}"
    srv = InProcessServer("").start()
    try:
        with KVCoordClient([srv.address, black], timeout=1.0, retry=NO_RETRY) as c:
            c.create_pool("p", pb.PoolConfig(
                num_blocks=16, hash_block_size=4, hash_algo="sha256_cbor", hash_seed="0",
                enable_caching=True, max_model_len=64,
                groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))]))  # fmt: skip
            c.routes.redirected("p", black)  # as if that replica had owned "p"
            assert c.get_pool("p").pool.name == "p"
            assert c.routes.route("p") == srv.address
    finally:
        srv.stop()
        hole.close()


class _Outcomes(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Passes every call on and records the status gRPC itself ended it with."""

    def __init__(self) -> None:
        self.seen: list[tuple[grpc.StatusCode, str]] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        try:
            outcome.result()
        except grpc.RpcError as exc:
            self.seen.append((exc.code(), exc.details() or ""))
        return outcome


def test_a_call_never_sent_has_a_known_outcome(tmp_path: Any) -> None:
    """A call whose channel could not connect (nothing listens at the address, or no
    such unix socket) was never sent: it applied nothing, so a once-only or keyed call
    ends in UnavailableError, not in OutcomeUnknownError (before, every UNAVAILABLE
    counted as an attempt that may have been applied). Since it applied nothing, the
    once-only call is retried as the keyed one is (before: sent once)."""
    from kvcoord.client.errors import OutcomeUnknownError
    from kvcoord.v1 import allocator_pb2 as pb

    policy = RetryPolicy(initial_backoff=0.001, max_backoff=0.002, deadline=2.0, max_attempts=3)
    for target in ("127.0.0.1:1", f"unix:{tmp_path}/nobody.sock"):
        seen = _Outcomes()
        with KVCoordClient(target, timeout=5, retry=policy, interceptors=[seen]) as c:
            with pytest.raises(UnavailableError) as once:
                c.delete_pool("p")
            with pytest.raises(UnavailableError) as keyed:
                c.allocate("p", pb.AllocateOp(num_new_tokens=4), "s")
        assert not isinstance(once.value, OutcomeUnknownError), once.value
        assert not isinstance(keyed.value, OutcomeUnknownError), keyed.value
        # gRPC itself failed each attempt (3 once-only, 3 keyed), none of them sent
        assert len(seen.seen) == 6
        assert {code for code, _ in seen.seen} == {grpc.StatusCode.UNAVAILABLE}


def test_a_call_sent_and_lost_still_has_an_unknown_outcome(server: InProcessServer) -> None:
    """The other side of the line: DeletePool sent and applied, its answer lost
    (UNAVAILABLE after the server answered), is OutcomeUnknownError."""
    from kvcoord.client.errors import OutcomeUnknownError
    from kvcoord.client.faults import FaultInjector

    lose = FaultInjector(0, drop=1.0, methods=("DeletePool",))
    with KVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:
        with pytest.raises(OutcomeUnknownError):
            c.delete_pool("p")
    assert lose.counts["dropped"] == 1


def test_an_attach_whose_answer_was_lost_is_retried_into_the_same_session(server: InProcessServer) -> None:
    """An exclusive Attach applied on the server whose answer is lost is retried with
    the same attach_key: the retry gets the session the first made (old code: that
    session held the pool, so the retry was refused POOL_EXCLUSIVE until its lease ran
    out), and the pool has that one session."""
    from kvcoord.client.faults import FaultInjector

    class FirstAttachLost(FaultInjector):
        def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
            try:
                return super().intercept_unary_unary(continuation, details, request)
            finally:
                self.enabled = False  # only the first answer is lost

    lose = FirstAttachLost(0, drop=1.0, methods=("Attach",))
    with KVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:
        got = c.attach("p", "sha256_cbor", 4, "0", client_name="engine-0", exclusive=True)
        assert lose.counts["dropped"] == 1
        assert got.exclusive
        assert [s.session_id for s in c.list_sessions("p").sessions] == [got.session_id]
        assert c.get_stats("p").num_sessions == 1


class _CancelFirstAttach(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The first Attach ends CANCELLED, as a server that stops mid-call ends it: after
    the server made its session (``applied``), or before the call reached it."""

    def __init__(self, applied: bool) -> None:
        self.applied = applied
        self.cancelled = 0

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if not details.method.endswith("/Attach") or self.cancelled:
            return continuation(details, request)
        self.cancelled += 1
        if self.applied:
            continuation(details, request).result()  # the session is made (and journaled)
        from kvcoord.client.errors import LocalRpcError

        raise LocalRpcError(grpc.StatusCode.CANCELLED, "CANCELLED")


@pytest.mark.parametrize("applied", [True, False], ids=["after-applied", "before-applied"])
def test_a_cancelled_attach_is_retried_into_one_session(server: InProcessServer, applied: bool) -> None:
    """An Attach cut by a stopping server ends CANCELLED, which does not tell whether
    its session was made. It carries its attach_key, and the server answers a retry
    under that key with the session the first made (the key is journaled with it, so a
    restarted server does too), so the client retries it: the pool ends with exactly
    one session, the one answered (old code: CANCELLED was not retried for an Attach,
    the worker's start failed and the session made lived out its lease, empty)."""
    cancel = _CancelFirstAttach(applied)
    with KVCoordClient(server.address, timeout=10, interceptors=[cancel]) as c:
        got = c.attach("p", "sha256_cbor", 4, "0", client_name="engine-0", exclusive=True)
        assert cancel.cancelled == 1
        assert [s.session_id for s in c.list_sessions("p").sessions] == [got.session_id]
        assert c.get_stats("p").num_sessions == 1
        assert got.exclusive


def test_a_refusal_names_the_replica_that_gave_it(server: InProcessServer, client: KVCoordClient) -> None:
    """A refused call's error carries the address its answer came from (in a cluster,
    which replica said it), with both clients."""
    with pytest.raises(NotFoundError) as refused:
        client.get_stats("no-such-pool")
    assert refused.value.address == server.address

    async def main() -> str:
        async with AsyncKVCoordClient(server.address) as c:
            try:
                await c.get_stats("no-such-pool")
            except NotFoundError as exc:
                return exc.address
        return "not refused"

    assert asyncio.run(main()) == server.address


def test_a_call_meant_for_another_replica_is_refused_before_it_is_read(
    server: InProcessServer, client: KVCoordClient
) -> None:
    """A server that is not the replica a call names (``kvcoord-replica``, as a redirect
    named the owner at this address) refuses it, WRONG_REPLICA, nothing applied: here a
    single node (named "") got calls meant for replica r9 of cluster k, with both clients
    and on the Step stream; the same calls naming nobody are served."""
    from kvcoord.client import WrongReplicaError

    with KVCoordClient(server.address, timeout=10, retry=NO_RETRY) as misled:
        misled.routes.named[server.address] = "k/r9"
        with pytest.raises(WrongReplicaError) as refused:
            misled.attach("p", "sha256_cbor", 4, "0")
        assert refused.value.reason == "WRONG_REPLICA" and "'k/r9'" in refused.value.message
        with pytest.raises(WrongReplicaError):
            misled.get_stats("p")
        assert client.get_stats("p").num_sessions == 0  # nothing was attached
        misled.routes.named.clear()  # naming nobody: served
        session = misled.attach("p", "sha256_cbor", 4, "0")
        misled.routes.named[server.address] = "k/r9"
        with pytest.raises(WrongReplicaError):  # a Step on the stream, opened naming r9
            misled.step("p", [allocate("a", list(range(8)), 8)], session.session_id, session.fence)
        assert misled._carrier.opened == 1
        assert client.get_stats("p").num_requests == 0

    async def main() -> str:
        async with AsyncKVCoordClient(server.address, retry=NO_RETRY) as c:
            c.routes.named[server.address] = "k/r9"
            try:
                await c.get_stats("p")
            except WrongReplicaError as exc:
                return exc.reason
        return "served"

    assert asyncio.run(main()) == "WRONG_REPLICA"


def test_a_client_given_a_cluster_name_is_refused_by_a_server_of_none(server: InProcessServer) -> None:
    """``cluster="k"``: every call names any replica of cluster k (``k/*``) until an
    answer names one, so a single node (or another cluster's replica) refuses the very
    first call; a name that cannot travel in metadata is refused at once."""
    from kvcoord.client import WrongReplicaError

    with KVCoordClient(server.address, timeout=10, retry=NO_RETRY, cluster="k") as c:
        with pytest.raises(WrongReplicaError):
            c.attach("p", "sha256_cbor", 4, "0")
    for bad in ("a b", "k/r1", "caf\u00e9"):
        with pytest.raises(ValueError, match="cluster"):
            KVCoordClient(server.address, cluster=bad)


def test_a_watch_and_a_listing_refused_as_another_replica(
    server: InProcessServer, client: KVCoordClient
) -> None:
    """WatchEvents refused WRONG_REPLICA names the address and tells the routes (the name
    there becomes its cluster's); a listing over a replica set asks such an address once
    more under that name, then leaves it out (a server of no cluster: no replica)."""
    from kvcoord.client import WrongReplicaError
    from kvcoord.v1 import allocator_pb2 as pb

    config = pb.PoolConfig(num_blocks=8, hash_block_size=4, groups=[
        pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))])  # fmt: skip
    client.create_pool("w1", config)
    other = InProcessServer().start()
    try:
        with KVCoordClient(other.address) as o:
            o.create_pool("w2", config)
        with KVCoordClient([server.address, other.address], timeout=10, retry=NO_RETRY) as c:
            c.routes.named[server.address] = "k/r9"
            with pytest.raises(WrongReplicaError) as refused:
                next(iter(c.watch_events("w1", timeout=5)))
            assert refused.value.address == server.address and c.routes.named[server.address] == "k/*"
            c.routes.named[server.address] = "k/r9"
            assert [p.name for p in c.list_pools().pools] == ["w2"]
            assert c.routes.named[server.address] == "k/*"
    finally:
        other.stop()
