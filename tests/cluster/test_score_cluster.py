"""ScorePools in a cluster answers as one server holding every pool would (real replica
processes, real etcd, real gRPC): the replica a call reaches scores its own pools and
asks the other owners for theirs, so the best pool is found wherever it is served; a
reservation is made on the best pool's owner (a following allocation there adopts it);
each tenant sees only the pools it may observe; and an owner that does not answer
(SIGSTOP) leaves its pools unscored, OWNER_UNREACHABLE, within the call's deadline.

It used to answer for the reached replica's pools only: a router given the replica set
picked the best pool of the first replica, never the better one served elsewhere."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import env
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, PermissionDeniedError
from kvcoord.client.api import Api
from kvcoord.client.routing import PoolRouter
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import hashes
from test_handover import secured, wait_placed
from test_replicas import POOL_CONFIG, claims, placed, replica_config

ROOT = "tok-root"
TOKENS = {"alice": "tok-alice", "bob": "tok-bob"}
IDS = ["r0", "r1"]
#: alice's pools, one on each replica; bob's, on r1
A0, A1, B1 = placed("sa", "r0", IDS), placed("sa", "r1", IDS), placed("sb", "r1", IDS)
PROMPT = [7000 + i for i in range(41)]  # 10 full blocks of 4 tokens: a hit of at most 40
TENANTS = (
    '[tenants.alice]\ntokens = ["tok-alice"]\n'
    'grants = [{ pools = ["sa*"], roles = ["use", "observe"] }]\n'
    '[tenants.bob]\ntokens = ["tok-bob"]\n'
    'grants = [{ pools = ["sb*"], roles = ["use", "observe"] }]\n'
)


def _cluster(etcd: Etcd, tmp_path: Path, name: str, lease: int) -> Iterator[list[ServerProcess]]:
    procs: list[ServerProcess] = []
    try:
        for r in IDS:
            text = replica_config(etcd, r, tmp_path / r, name, f'auth_tokens = ["{ROOT}"]\n', lease=lease)
            procs.append(start_server(text + TENANTS, env=env()))
        addresses = [p.address for p in procs]
        with KVCoordClient(addresses, token=ROOT) as admin:
            for pool in (A0, A1, B1):
                admin.create_pool(pool, POOL_CONFIG)
        wait_placed(addresses, {A0: "r0", A1: "r1", B1: "r1"}, token=ROOT)
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                os.kill(p.proc.pid, signal.SIGCONT)  # (a test failing while it is stopped)
            p.stop()


@pytest.fixture
def two(etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[list[ServerProcess]]:
    yield from _cluster(etcd, tmp_path, request.node.name.replace("[", "-").rstrip("]"), lease=2)


@pytest.fixture
def two_long_lease(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[list[ServerProcess]]:
    """A lease longer than the test stops a replica for: its claims stay (its pools are
    claimed by a replica that does not answer)."""
    yield from _cluster(etcd, tmp_path, request.node.name.replace("[", "-").rstrip("]"), lease=20)


def _cache(client: KVCoordClient, pool: str, tokens: list[int], rid: str) -> None:
    """``tokens`` cached in ``pool`` for the client's tenant (allocated, then freed)."""
    s = client.attach(pool, "sha256_cbor", 4, "0")
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=tokens, append_block_hashes=hashes(tokens), new_request=True
    )
    got = client.allocate(
        pool, pb.AllocateOp(request=sync, num_new_tokens=len(tokens)), s.session_id, s.fence
    )
    assert not got.result.refused
    client.free(pool, [rid], session_id=s.session_id, fence=s.fence)
    client.detach(s.session_id, s.fence)


def _prompt() -> pb.HashedPrompt:
    return pb.HashedPrompt(
        hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes(PROMPT)
    )


@pytest.mark.parametrize("first", ["r0", "r1"])
def test_the_best_pool_is_found_and_reserved_on_whichever_replica_serves_it(
    two: list[ServerProcess], first: str
) -> None:
    """alice's prompt is cached whole in A1 (r1) and 8 tokens of it in A0 (r0). Reached
    first at r0 (the best pool elsewhere) or r1 (here), the answer is the same: A1 best,
    A0 second, bob's pool never named; the reservation is held in A1 on r1 (one
    reservation in all), a keyed retry gets the same one, and alice's next request of
    the prompt in A1 adopts it with the whole hit."""
    r0, r1 = two
    targets = [r0.address, r1.address] if first == "r0" else [r1.address, r0.address]
    with KVCoordClient(targets, token=TOKENS["alice"]) as alice:
        _cache(alice, A1, PROMPT, "whole")
        _cache(alice, A0, PROMPT[:9], "part")
        router = PoolRouter(alice)
        assert sorted(router.pools()) == [A0, A1]  # (ListPools: every replica's)
        answer = router.score(PROMPT)
        # (was, reached at r0: [(A0, 8)] alone: A1, on r1, never scored)
        assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(A1, 40), (A0, 8)]
        assert list(answer.unscored) == []
        assert router.pick(PROMPT).pool == A1  # type: ignore[union-attr]
        # the same with candidates naming both, and with block ids
        named = alice.score_pools(len(PROMPT), [_prompt()], [A0, A1], include_block_ids=True)
        assert [(s.pool, s.hit_tokens, len(s.hit.groups[0].block_ids)) for s in named.scores] == [
            (A1, 40, 10),
            (A0, 8, 2),
        ]
        with pytest.raises(PermissionDeniedError):
            alice.score_pools(len(PROMPT), [_prompt()], [A0, B1])

        request = pb.ScorePoolsRequest(
            num_tokens=len(PROMPT), prompts=[_prompt()], reserve_seconds=30.0, idempotency_key="k-route-1"
        )
        reserved = alice.unary(Api.score_pools, request)  # type: ignore[arg-type]
        assert reserved.reservation.pool == A1 and reserved.reservation.hit_tokens == 40
        assert [s.pool for s in reserved.scores] == [A1, A0]
        again = alice.unary(Api.score_pools, request)  # type: ignore[arg-type]
        assert again.reservation.reservation_id == reserved.reservation.reservation_id
        # the same keyed call retried at the other replica (the first one lost): the same
        # reservation (was: KEY_REUSED there, the key kept with the owner's part's body)
        with KVCoordClient(targets[::-1], token=TOKENS["alice"]) as other:
            elsewhere = other.unary(Api.score_pools, request)  # type: ignore[arg-type]
        assert elsewhere.reservation.reservation_id == reserved.reservation.reservation_id
        assert alice.get_stats(A1).reservations.live == 1  # held on its owner, once
        assert alice.get_stats(A0).reservations.made == 0
        s = alice.attach(A1, "sha256_cbor", 4, "0")
        sync = pb.RequestSync(
            request_id="next", append_token_ids=PROMPT, append_block_hashes=hashes(PROMPT), new_request=True
        )
        op = pb.AllocateOp(request=sync, num_new_tokens=len(PROMPT), lookup=True)
        got = alice.allocate(A1, op, s.session_id, s.fence)
        assert got.result.hit.num_tokens == 40
        stats = alice.get_stats(A1).reservations
        assert (stats.live, stats.adopted, stats.got_tokens) == (0, 1, 40)
    with KVCoordClient(targets, token=TOKENS["bob"]) as bob:
        # bob's only pool is on r1; alice's hits are not his (another tenant's namespace)
        seen = bob.score_pools(len(PROMPT), [_prompt()])
        assert [(s.pool, s.hit_tokens) for s in seen.scores] == [(B1, 0)]
        assert list(seen.unscored) == []


def test_an_owner_that_does_not_answer_leaves_its_pools_unscored_within_the_deadline(
    two_long_lease: list[ServerProcess],
) -> None:
    """r1 is SIGSTOPped (its sockets open, nothing answers; its claims stay with its
    lease): a ScorePools reaching r0 answers within the call's deadline, r0's pool
    scored, r1's named unscored, OWNER_UNREACHABLE; a reservation goes to the best pool
    that was scored. Once r1 runs again, its pools are scored again."""
    r0, r1 = two_long_lease
    targets = [r0.address, r1.address]
    with KVCoordClient(targets, token=TOKENS["alice"]) as alice:
        _cache(alice, A1, PROMPT, "whole")
        _cache(alice, A0, PROMPT[:9], "part")
    os.kill(r1.proc.pid, signal.SIGSTOP)
    try:
        # no retry: the first answer is the one checked (a hang is DEADLINE_EXCEEDED)
        with KVCoordClient(targets, token=TOKENS["alice"], timeout=6.0, retry=NO_RETRY) as alice:
            answer = alice.score_pools(len(PROMPT), [_prompt()], reserve_seconds=10.0)
            assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(A0, 8)]
            assert [(u.pool, u.reason) for u in answer.unscored] == [(A1, "OWNER_UNREACHABLE")]
            assert r1.address in answer.unscored[0].message
            assert answer.reservation.pool == A0
    finally:
        os.kill(r1.proc.pid, signal.SIGCONT)
    with KVCoordClient(targets, token=TOKENS["alice"]) as alice:
        answer = alice.score_pools(len(PROMPT), [_prompt()])
        assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(A1, 40), (A0, 8)]


def test_a_pool_nobody_serves_is_named_unscored_not_left_out(
    etcd: Etcd, two: list[ServerProcess], request: pytest.FixtureRequest
) -> None:
    """r1 is SIGKILLed (local journals: its pools wait for it, claimed by nobody once
    its lease ends): a ScorePools reaching r0 scores A0 and names A1 unscored,
    OWNER_UNREACHABLE, rather than answering as if A1 did not exist."""
    r0, r1 = two
    with KVCoordClient([r0.address, r1.address], token=TOKENS["alice"]) as alice:
        _cache(alice, A0, PROMPT[:9], "part")
    r1.proc.kill()
    r1.proc.wait(10)
    cluster = request.node.name.replace("[", "-").rstrip("]")
    deadline = time.monotonic() + 30
    while claims(etcd, cluster) != {A0: "r0"} and time.monotonic() < deadline:  # bounded: r1's lease ends
        time.sleep(0.2)
    assert claims(etcd, cluster) == {A0: "r0"}
    with KVCoordClient(r0.address, token=TOKENS["alice"], retry=NO_RETRY) as alice:
        for _ in range(50):  # bounded: r0's watch reads the claims' end
            answer = alice.score_pools(len(PROMPT), [_prompt()])
            if any("no live replica" in u.message for u in answer.unscored):
                break
            time.sleep(0.1)
        assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(A0, 8)]
        assert [(u.pool, u.reason) for u in answer.unscored] == [(A1, "OWNER_UNREACHABLE")]
        assert "no live replica serves the pool" in answer.unscored[0].message


def test_a_tenant_known_by_its_certificate_is_scored_over_mutual_tls(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, certs: Any
) -> None:
    """Replicas serving mutual TLS to a tenant known by its client certificate (no token
    to pass on): the replica reached asks the other over TLS with the replicas' token,
    naming the tenant, and the other scores its pool in that tenant's cache."""
    from kvcoord.client import TLSOptions

    cluster = request.node.name
    tls = TLSOptions(ca_file=certs.ca, cert_file=certs.client_cert, key_file=certs.client_key)
    m0, m1 = placed("m", "r0", IDS), placed("m", "r1", IDS)
    procs: list[ServerProcess] = []
    try:
        for r in IDS:
            procs.append(
                start_server(secured(replica_config(etcd, r, tmp_path / r, cluster), certs), env=env())
            )
        targets = [p.address for p in procs]
        with KVCoordClient(targets, tls=tls) as team:
            for pool in (m0, m1):
                team.create_pool(pool, POOL_CONFIG)
            wait_placed(targets, {m0: "r0", m1: "r1"}, tls=tls)
            _cache(team, m1, PROMPT, "whole")
            _cache(team, m0, PROMPT[:9], "part")
            answer = team.score_pools(len(PROMPT), [_prompt()])
            assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(m1, 40), (m0, 8)]
            assert list(answer.unscored) == []
    finally:
        for p in procs:
            p.stop()


@pytest.mark.parametrize("token", ["tok-alice", "tok-bob", ""])
def test_a_tenant_cannot_ask_a_replica_for_another_tenant_s_scores(
    two: list[ServerProcess], token: str
) -> None:
    """``Replicas.ScoreForTenant`` names the tenant it scores for, so only another replica
    (a full-access token) may call it: a tenant's token naming itself, another tenant or
    full access is refused (PERMISSION_DENIED), a call without a token is not
    authenticated; the replicas' token is answered."""
    r0, r1 = two
    with KVCoordClient([r0.address, r1.address], token=TOKENS["bob"]) as bob:
        _cache(bob, B1, PROMPT, "bob's")
    request = pb.ScoreForTenantRequest(
        tenant="bob",
        request=pb.ScorePoolsRequest(num_tokens=len(PROMPT), prompts=[_prompt()], candidate_pools=[B1]),
    )
    with grpc.insecure_channel(r1.address) as channel:
        call = pb_grpc.ReplicasStub(channel).ScoreForTenant  # type: ignore[no-untyped-call]
        for tenant in ("bob", "alice", ""):
            request.tenant = tenant
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            with pytest.raises(grpc.RpcError) as refused:
                call(request, metadata=metadata, timeout=10)
            if token:
                assert refused.value.code() is grpc.StatusCode.PERMISSION_DENIED, refused.value
                assert "between replicas" in (refused.value.details() or "")
            else:
                assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED, refused.value
        request.tenant = "bob"
        answer = call(request, metadata=(("authorization", f"Bearer {ROOT}"),), timeout=10)
    assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(B1, 40)]
