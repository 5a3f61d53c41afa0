"""Score and reserve over real gRPC: a reserved hit survives a concurrent eviction storm
until a request adopts it (promised = got, in GetStats and /metrics) or its time runs
out; limits and refusals are typed."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
from kvcoord.client import KVCoordClient, RemoteKVCacheManager
from kvcoord.client.errors import FailedPreconditionError, InvalidArgumentError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig
from kvcoord.service import operations as op
from kvcoord.service.errors import ServiceError
from kvcoord.service.pool_service import Fence, Limits, PoolService
from kvcoord.service.scoring import Reserve, score_pools
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from support import admit_prompt, hashed_req, pool_toml, scrape_metrics
from tenancy import ROOT_TOKEN, TENANTS, TOKENS, Raw
from tenancy import pool_toml as tenant_pool_toml

NONE = none_hash("sha256_cbor", "0")
PROMPT = [7000 + i for i in range(41)]  # 10 full blocks of 4: the searchable hit is 40 tokens


def _hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher("sha256_cbor", 4, NONE).extend(tokens)


def _prompt() -> list[pb.HashedPrompt]:
    return [
        pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=_hashes(PROMPT)
        )
    ]


class Worker:
    """One session allocating requests with an atomic lookup (what a scheduler does)."""

    def __init__(self, address: str, name: str) -> None:
        self.client = KVCoordClient(address, timeout=10)
        r = self.client.attach("p", "sha256_cbor", 4, "0", client_name=name)
        self.sid, self.fence = r.session_id, r.fence
        self.name = name
        self.n = 0
        self.held: list[str] = []

    def admit(self, tokens: list[int]) -> pb.AllocateResult:
        rid = f"{self.name}-{self.n}"
        self.n += 1
        sync = pb.RequestSync(
            request_id=rid, append_token_ids=tokens, append_block_hashes=_hashes(tokens), new_request=True
        )
        op = pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=True)
        result = self.client.allocate("p", op, self.sid, self.fence).result
        if result.refused:
            self.client.free("p", [rid], session_id=self.sid, fence=self.fence)
        else:
            self.held.append(rid)
        return result

    def storm(self, rounds: int, seed: int) -> None:
        """Fill the pool with unrelated prompts until refused, free them, again."""
        rnd = random.Random(seed)
        for _ in range(rounds):
            self.held = []
            for _ in range(40):
                tokens = [rnd.randrange(1000) for _ in range(rnd.randint(8, 40))]
                if self.admit(tokens).refused:
                    break
            self.client.free("p", self.held, session_id=self.sid, fence=self.fence)

    def close(self) -> None:
        self.client.detach(self.sid, self.fence)
        self.client.close()


def _hit(client: KVCoordClient) -> int:
    return int(client.find_longest_cache_hit("p", _hashes(PROMPT), len(PROMPT)).hit.num_tokens)


def _adoption(client: KVCoordClient) -> tuple[int, int, int, int, int]:
    """GetStats: live and adopted reservations, hit tokens promised and got, short hits."""
    s = client.get_stats("p").reservations
    return (s.live, s.adopted, s.promised_tokens, s.got_tokens, s.short_hits)


def _storm(address: str, workers: int = 3, rounds: int = 6) -> Callable[[], None]:
    """Start concurrent storms; returns a function that waits for them."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        w = Worker(address, f"storm{i}")
        try:
            w.storm(rounds, seed=i)
        except BaseException as exc:  # noqa: BLE001 - reported by the waiter
            errors.append(exc)
        finally:
            w.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(workers)]
    for t in threads:
        t.start()

    def wait() -> None:
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors

    return wait


def _warm(address: str) -> None:
    w = Worker(address, "warm")
    w.admit(PROMPT)
    w.client.free("p", w.held, session_id=w.sid, fence=w.fence)
    w.close()


def test_a_reserved_hit_survives_a_concurrent_eviction_storm(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """Without a reservation the storm evicts the prompt's blocks (the control); with
    one, the prompt's hit never drops below the reserved hit while three workers
    fill and empty the pool concurrently, the request that then arrives adopts it and
    gets the promised hit (GetStats and /metrics: promised = got), and a reservation
    left alone ends when its time runs out, after which the storm evicts again."""
    server = make_server()
    with KVCoordClient(server.address, timeout=10) as client:
        _warm(server.address)
        assert _hit(client) == 40
        _storm(server.address)()
        assert _hit(client) == 0  # the control: a storm evicts an unreserved prefix

        _warm(server.address)
        r = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=5.0)
        assert r.reservation.pool == "p" and r.reservation.hit_tokens == 40 == r.scores[0].hit_tokens
        wait = _storm(server.address)
        seen = []
        for _ in range(200):
            seen.append(_hit(client))
        wait()
        seen.append(_hit(client))
        assert min(seen) >= 40, min(seen)
        assert client.check_pool("p").violations == []
        stats = client.get_stats("p").reservations
        assert (stats.live, stats.made, stats.adopted) == (1, 1, 0)

        arrival = Worker(server.address, "arrival")
        assert arrival.admit(PROMPT).hit.num_tokens == 40
        assert _adoption(client) == (0, 1, 40, 40, 0)
        metrics = scrape_metrics(server)
        assert metrics[("kvcoord_reservation_promised_tokens_total", (("pool", "p"),))] == 40
        assert metrics[("kvcoord_reservation_got_tokens_total", (("pool", "p"),))] == 40
        assert metrics[("kvcoord_reservations", (("pool", "p"),))] == 0
        arrival.client.free("p", arrival.held, session_id=arrival.sid, fence=arrival.fence)
        arrival.close()

        r = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=2.0)
        assert r.reservation.hit_tokens == 40
        expire = server.running.servicer.expire_reservations  # type: ignore[union-attr]
        clock.advance(1.0)
        assert server.call(expire) == 0
        clock.advance(1.5)
        assert server.call(expire) == 1
        stats = client.get_stats("p").reservations
        assert (stats.live, stats.expired) == (0, 1)
        assert client.check_pool("p").violations == []
        _storm(server.address)()
        assert _hit(client) == 0


def test_reservation_refusals(make_server: Callable[..., InProcessServer]) -> None:
    """A time to live out of (0, max] is INVALID_ARGUMENT; a pool with an exclusive
    session cannot hold one (FAILED_PRECONDITION); no hit reserves nothing and says why."""
    server = make_server()
    with KVCoordClient(server.address, timeout=10) as client:
        for seconds in (-1.0, 31.0, float("inf"), float("nan")):
            with pytest.raises(InvalidArgumentError):
                client.score_pools(len(PROMPT), _prompt(), reserve_seconds=seconds)
        r = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=1.0)
        assert not r.HasField("reservation") and "no hit" in r.reservation_skipped
        _warm(server.address)
        client.attach("p", "sha256_cbor", 4, "0", exclusive=True)
        with pytest.raises(FailedPreconditionError, match="exclusive"):
            client.score_pools(len(PROMPT), _prompt(), reserve_seconds=1.0)
        assert client.get_stats("p").reservations.made == 0


def test_reservations_are_bounded_per_tenant() -> None:
    """A tenant holding max_per_tenant live reservations (over every pool) is refused
    another (RESOURCE_EXHAUSTED); another tenant is not; reserving needs the use role
    (PERMISSION_DENIED); one ending frees a place."""
    cfg = KVCacheConfig(
        num_blocks=32, groups=(FullAttentionSpec(4),), hash_block_size=4, max_model_len=64, hash_length=32
    )
    clock = ManualClock()
    pools = {
        n: PoolService(
            n, cfg, ("sha256_cbor", 4, "0"), Fence("i", 1), Limits(), SessionTable(clock, 30.0, 60.0)
        )
        for n in ("a", "b")
    }
    hashes = _hashes(PROMPT[:20])
    for name, service in pools.items():  # cache the prompt in each pool, under both tenants' namespaces
        for tenant in ("t1", "t2"):
            s = service.attach("sha256_cbor", 4, "0", "w", 0, tenant=tenant)
            sync = op.RequestSync(f"{tenant}-{name}", PROMPT[:20], hashes, new_request=True)
            (o,) = service.apply(s, [op.Allocate(sync, 20)])
            assert o.error is None
            service.free_requests(s, [f"{tenant}-{name}"], False)

    def reserve(tenant: str, candidates: list[str]) -> object:
        return score_pools(
            pools,
            lambda _: True,
            candidates,
            20,
            [(("sha256_cbor", 4, "0"), hashes)],
            tenant,
            Reserve(1.0, lambda _: True, 30.0, 2),
        ).reservation

    assert reserve("t1", ["a"]) is not None
    assert reserve("t1", ["b"]) is not None
    with pytest.raises(ServiceError) as info:
        reserve("t1", ["a"])
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert reserve("t2", ["a"]) is not None
    with pytest.raises(ServiceError) as info:
        score_pools(pools, lambda _: True, ["a"], 20, [(("sha256_cbor", 4, "0"), hashes)], "t2",
                    Reserve(1.0, lambda _: False, 30.0, 2))  # fmt: skip
    assert info.value.code == grpc.StatusCode.PERMISSION_DENIED
    clock.advance(2.0)
    for service in pools.values():
        for rid in service.expired_reservations():
            service.release_reservation(rid)
    assert reserve("t1", ["a"]) is not None


def test_a_request_of_another_prompt_sharing_the_hit_leaves_the_reservation(
    make_server: Callable[..., InProcessServer], clock: ManualClock
) -> None:
    """A request of a shorter prompt made of the reserved hit's blocks only (its own hit
    stops a block earlier: at most num_tokens - 1 tokens) does not adopt the
    reservation made for the scored prompt: the reservation stays live through a
    concurrent eviction storm, the scored prompt's request then adopts it with the
    promised hit, and no short hit is counted (GetStats)."""
    server = make_server()
    with KVCoordClient(server.address, timeout=10) as client:
        _warm(server.address)
        r = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=5.0)
        assert r.reservation.hit_tokens == 40

        short = PROMPT[:40]
        expected = client.find_longest_cache_hit("p", _hashes(short), len(short)).hit.num_tokens
        assert expected < 40
        other = Worker(server.address, "other")
        assert other.admit(short).hit.num_tokens == expected
        other.client.free("p", other.held, session_id=other.sid, fence=other.fence)
        other.close()
        stats = client.get_stats("p").reservations
        assert (stats.live, stats.adopted, stats.short_hits) == (1, 0, 0)

        _storm(server.address)()
        assert _hit(client) == 40
        arrival = Worker(server.address, "arrival")
        assert arrival.admit(PROMPT).hit.num_tokens == 40
        assert _adoption(client) == (0, 1, 40, 40, 0)
        arrival.close()


class _LoseFirstAnswer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """The first ScorePools reaches the server and is applied; its answer is lost
    (UNAVAILABLE, as a connection reset after the server answered)."""

    def __init__(self) -> None:
        self.lost = 0
        self.sent: list[pb.ScorePoolsRequest] = []

    def intercept_unary_unary(
        self, continuation: Callable[..., object], details: object, request: object
    ) -> object:
        from kvcoord.client.errors import LocalRpcError

        if isinstance(request, pb.ScorePoolsRequest):
            self.sent.append(request)
        if isinstance(request, pb.ScorePoolsRequest) and not self.lost:
            self.lost += 1
            continuation(details, request).result()  # applied by the server
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: connection lost before the answer")
        return continuation(details, request)


def test_a_reserving_score_pools_whose_answer_is_lost_reserves_once(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A reserving ScorePools is a mutation: retried after its answer was lost, it is
    retried with its idempotency key and answered from the first call, so exactly one
    reservation is held (before, it was retried as a read and reserved twice). A
    scoring-only call carries no key (a read: nothing to keep)."""
    server = make_server()
    lose = _LoseFirstAnswer()
    with KVCoordClient(server.address, timeout=10, interceptors=[lose]) as client:
        _warm(server.address)
        r = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=5.0)
        assert lose.lost == 1 and len(lose.sent) == 2
        assert r.reservation.pool == "p" and r.reservation.hit_tokens == 40
        stats = client.get_stats("p").reservations
        assert (stats.live, stats.made) == (1, 1)
        assert lose.sent[0].idempotency_key and lose.sent[0] == lose.sent[1]
        # a new call is a new reservation
        again = client.score_pools(len(PROMPT), _prompt(), reserve_seconds=5.0)
        assert again.reservation.reservation_id != r.reservation.reservation_id
        assert client.get_stats("p").reservations.live == 2
        client.score_pools(len(PROMPT), _prompt())
        assert lose.sent[-1].idempotency_key == ""


def test_a_score_pools_key_is_bound_to_its_body_and_tenant(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The same key with another body is KEY_REUSED (nothing reserved); the same key
    and body is the first answer."""
    from kvcoord.client.errors import KeyReusedError, error_from_rpc

    server = make_server()
    with KVCoordClient(server.address, timeout=10) as client:
        _warm(server.address)
        first = pb.ScorePoolsRequest(
            num_tokens=len(PROMPT), prompts=_prompt(), reserve_seconds=5.0, idempotency_key="k1"
        )
        a = client.stub.ScorePools(first)
        b = client.stub.ScorePools(first)
        assert a == b and a.reservation.reservation_id
        other = pb.ScorePoolsRequest(
            num_tokens=len(PROMPT), prompts=_prompt(), reserve_seconds=4.0, idempotency_key="k1"
        )
        with pytest.raises(grpc.RpcError) as err:
            client.stub.ScorePools(other)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert isinstance(error_from_rpc(err.value), KeyReusedError)
        assert client.get_stats("p").reservations.made == 1


def test_a_reserving_score_pools_retried_after_a_restart_from_a_snapshot_reserves_anew(
    tmp_path: Path,
) -> None:
    """A reserving ScorePools' kept answer is not journaled: a restart releases the
    reservation it names, so a retry of the same key afterwards must reserve anew. A
    snapshot written between the call and the restart once carried the kept answer
    across it: the retry was answered with the released reservation and no reservation
    was live (a hit the router believed held could be evicted)."""
    from durable_server import DurableServer
    from support import POOL_TOML

    server = DurableServer(tmp_path, pools_toml=POOL_TOML, snapshot_every=1)
    server.start()
    try:
        _warm(server.address)
        req = pb.ScorePoolsRequest(
            num_tokens=len(PROMPT), prompts=_prompt(), reserve_seconds=30.0, idempotency_key="k1"
        )
        with KVCoordClient(server.address, timeout=10) as c:
            first = c.stub.ScorePools(req)
            assert first.HasField("reservation")
            assert c.get_stats("p").reservations.live == 1
            _warm(server.address)  # more journal records: a snapshot follows the call
        server.kill()
        server.start()
        with KVCoordClient(server.address, timeout=10) as c:
            again = c.stub.ScorePools(req)
            live = c.get_stats("p").reservations.live
        assert again.HasField("reservation")
        assert again.reservation.reservation_id != first.reservation.reservation_id
        assert live == 1
    finally:
        server.stop()


def test_a_reserved_hit_is_not_told_as_a_prefix_common_to_every_request(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A worker runs two requests of different prompts (no block in common) while a
    router reserves the first one's prompt. vLLM's scheduler asks
    get_num_common_prefix_blocks every step and its cascade attention reads that
    many leading blocks as every running request's: the server answers 0 for both
    requests, as with an extra request holding the reserved blocks (was 2 for the
    first: the reservation's reference made its blocks look held by every request).
    Once the other request is freed, the two blocks the reservation holds with it are
    common again."""
    server = make_server(pool_toml("p", 32))  # one full-attention group
    with KVCoordClient(server.address, timeout=10) as client:
        m = RemoteKVCacheManager(client, "p", hash_seed="0", renew=False)
        a = hashed_req("a", PROMPT[:12])
        admit_prompt(m, a)
        admit_prompt(m, hashed_req("b", [9000 + i for i in range(12)]))
        assert m.get_num_common_prefix_blocks("a") == [0]
        hashes = _hashes(PROMPT[:12])
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes
        )
        r = client.score_pools(12, [prompt], reserve_seconds=5.0)
        assert (r.reservation.pool, r.reservation.hit_tokens) == ("p", 8)
        assert m.get_num_common_prefix_blocks("a") == [0]
        assert m.get_num_common_prefix_blocks("b") == [0]
        m.free(hashed_req("b", []))
        assert m.get_num_common_prefix_blocks("a") == [2]  # a and the reservation hold 2 blocks
        assert client.check_pool("p").violations == []
        m.close()


def test_a_shared_cache_tenant_adopts_another_tenants_reservation(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A reservation is adopted by the first request of the scored prompt in the cache
    namespace it was made in, whoever's: in a pool whose cache two tenants share, a
    router tenant ("admin" here: use and observe) reserves the hit and a worker tenant's
    ("user") request of that prompt adopts it (the deploy's router layout; the docs
    said "same tenant", which would leave it held until its time ran out)."""
    server = make_server(TENANTS + tenant_pool_toml("a-pool", 'shared_cache_tenants = ["user", "admin"]'))
    raw = Raw(server.address)
    try:
        user = raw.ok(
            "Attach",
            pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
            TOKENS["user"],
        )

        def admit(rid: str) -> pb.AllocateResult:
            sync = pb.RequestSync(
                request_id=rid, append_token_ids=PROMPT, append_block_hashes=_hashes(PROMPT), new_request=True
            )
            request = pb.AllocateRequest(
                pool="a-pool",
                session_id=user.session_id,
                fence=user.fence,
                op=pb.AllocateOp(request=sync, num_new_tokens=len(PROMPT), lookup=True),
            )
            result = raw.ok("Allocate", request, TOKENS["user"]).result
            assert not result.refused
            free = pb.FreeRequest(
                pool="a-pool", session_id=user.session_id, fence=user.fence, request_ids=[rid]
            )
            raw.ok("Free", free, TOKENS["user"])
            return result

        def reservations() -> tuple[int, int, int, int]:
            s = raw.ok("GetStats", pb.GetStatsRequest(pool="a-pool"), ROOT_TOKEN).reservations
            return (s.live, s.adopted, s.promised_tokens, s.got_tokens)

        admit("warm")  # the prompt cached in the shared namespace
        score = pb.ScorePoolsRequest(num_tokens=len(PROMPT), prompts=_prompt(), reserve_seconds=5.0)
        made = raw.ok("ScorePools", score, TOKENS["admin"]).reservation
        assert (made.pool, made.hit_tokens) == ("a-pool", 40)
        assert reservations() == (1, 0, 0, 0)
        assert admit("arrival").hit.num_tokens == 40
        assert reservations() == (0, 1, 40, 40)
    finally:
        raw.close()
