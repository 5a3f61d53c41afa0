"""ScorePools in a cluster while a pool changes owner, and while the replica reached
loses its lease in the middle of the call.

1. A pool's old owner hands it over: the adopter swaps the claim and serves it (and
   changes it), while the old owner has not heard the AdoptPool's answer yet and its
   watch has not read the swap (its link to the store is slow). The old owner scored
   the pool from its own copy then: a hit and free blocks the pool no longer had,
   answered as the pool's (a router sent the prompt where its cache was not). Now a
   pool being handed over is not scored by its old owner: it is named unscored,
   OWNER_UNREACHABLE, until the new owner answers for it.
2. The replica a reserving ScorePools reaches scores its own pools, then waits for a
   slow owner's part; its lease lapses meanwhile (cut off from the store). It then
   reserved in its best pool of its own and, finding it no longer served, answered
   NOT_FOUND, "pool ... does not exist", for a pool that exists. Now: UNAVAILABLE (the
   client asks another replica), nothing reserved.

Real etcd, real ``kvcoord serve`` replicas, real gRPC; the old owner's (1) and the
replica's (2) link to etcd through a proxy that the test cuts; the adopter's AdoptPool
answer held by a server hook (durable_server.with_sitecustomize) while a file exists;
the frozen owner SIGSTOPped."""

from __future__ import annotations

from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.errors import UnavailableError
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate, hashes
from tcp_proxy import Proxy
from test_handover import wait_placed
from test_handover_late_swap import _config, _until
from test_replicas import POOL_CONFIG, placed, replica_config

HOOK = """
import asyncio
import os

hold = os.environ.get("KVCOORD_TEST_HOLD_ADOPT")
if hold:  # this replica's AdoptPool begins once <hold>.in is gone, and, done (the claim swapped,
    # the pool served here), answers once <hold> is gone
    import kvcoord.service.cluster_placement as cp

    adopt_pool = cp.ReplicasServicer.AdoptPool

    async def _adopt_pool(self, request, context):
        open(hold + ".entered", "w").close()
        while os.path.exists(hold + ".in"):
            await asyncio.sleep(0.01)
        answer = await adopt_pool(self, request, context)
        open(hold + ".swapped", "w").close()
        while os.path.exists(hold):
            await asyncio.sleep(0.01)
        return answer

    cp.ReplicasServicer.AdoptPool = _adopt_pool
"""

SLOW_OWNER = """
import asyncio
import os

hold = os.environ.get("KVCOORD_TEST_HOLD_SCORES")
if hold:  # this replica answers ScoreForTenant only once the file is gone
    from kvcoord.service import score_peers

    score_for_tenant = score_peers.ScoringReplicas.ScoreForTenant

    async def _score_for_tenant(self, request, context):
        while os.path.exists(hold):
            await asyncio.sleep(0.01)
        return await score_for_tenant(self, request, context)

    score_peers.ScoringReplicas.ScoreForTenant = _score_for_tenant
"""

#: r2's prompt at the new owner (two full blocks of 4) and one more token: a hit of 8 there
PROMPT = list(range(100, 108)) + [99]


def _prompt(tokens: list[int]) -> pb.HashedPrompt:
    return pb.HashedPrompt(
        hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes(tokens)
    )


def _scores(address: str, pool: str | None) -> pb.ScorePoolsResponse:
    """PROMPT scored at ``address`` alone (one try), in ``pool`` (None: every pool)."""
    with KVCoordClient(address, timeout=5.0, retry=NO_RETRY) as c:
        return c.score_pools(len(PROMPT), [_prompt(PROMPT)], [] if pool is None else [pool])


def _tried(address: str, pool: str | None) -> pb.ScorePoolsResponse:
    """:func:`_scores`, empty when the call fails (a replica changing its view)."""
    try:
        return _scores(address, pool)
    except KVCoordError:
        return pb.ScorePoolsResponse()


def _scored(answer: pb.ScorePoolsResponse) -> list[tuple[str, int, int]]:
    return [(s.pool, s.hit_tokens, s.num_free_blocks) for s in answer.scores]


def test_a_pool_being_handed_over_is_not_scored_from_its_old_owners_copy(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """a holds the pool (r1 allocated); b joins, adopts it, swaps its claim and allocates
    r2 (PROMPT's blocks) there, its AdoptPool answer held; a's link to etcd is cut
    before the swap (its lease of 20 s still valid). b scores PROMPT 8 tokens; a must
    not answer its own copy's score (0 tokens, two more free blocks) but name the pool
    unscored, OWNER_UNREACHABLE; once the handover ends, a asks b."""
    cluster = request.node.name
    pool = placed("moving", "b", ["a", "b"])  # placement moves it to b once b joins
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    hold = tmp_path / "hold-adopted"
    link = Proxy(etcd.endpoint)  # a's link to etcd
    a = start_server(
        _config(link.address, "a", tmp_path / "a", cluster, "local").replace(
            "lease_seconds = 10", "lease_seconds = 20"
        ),
        env=durable_server.env(),
    )
    b: ServerProcess | None = None
    try:
        with KVCoordClient(a.address, timeout=5.0) as c:
            c.create_pool(pool, POOL_CONFIG)
            s = c.attach(pool, "sha256_cbor", 4, "0", lease_seconds=120)
            c.allocate(pool, allocate("r1", list(range(8)), 8).allocate, s.session_id, s.fence)  # type: ignore[arg-type]
        first = _scored(_scores(a.address, pool))
        assert [(p, hit) for p, hit, _ in first] == [(pool, 0)]

        hold.touch()
        held_in = Path(f"{hold}.in")
        held_in.touch()
        b = start_server(
            _config(etcd.endpoint, "b", tmp_path / "b", cluster, "local"),
            env={**durable_server.env(), "KVCOORD_TEST_HOLD_ADOPT": str(hold)},
        )
        _until(lambda: Path(f"{hold}.entered").exists() or None, 30, "a sent the pool to b")
        # a's watch never reads the swap from here on (its lease stays valid for 13 s and more)
        link.cut()
        held_in.unlink()
        _until(lambda: Path(f"{hold}.swapped").exists() or None, 30, "b swapped the pool's claim")
        with KVCoordClient(b.address, timeout=5.0, retry=NO_RETRY) as c:  # b serves the pool: r2 there
            got = c.allocate(pool, allocate("r2", PROMPT[:8], 8).allocate, s.session_id, s.fence)  # type: ignore[arg-type]
        assert not got.result.refused
        at_b = _scored(_scores(b.address, pool))
        assert [(p, hit) for p, hit, _ in at_b] == [(pool, 8)]

        for named in (pool, None):  # named, and among every pool
            at_a = _scores(a.address, named)  # (was: [(pool, 0, <two blocks more than b's>)])
            assert _scored(at_a) == [], (named, at_a)
            assert [(u.pool, u.reason) for u in at_a.unscored] == [(pool, "OWNER_UNREACHABLE")]
            assert "changing owner" in at_a.unscored[0].message
        hold.unlink()  # the handover ends: a learns b's claim from its answer
        link.heal()
        assert _until(lambda: _scored(_tried(a.address, pool)) or None, 30, "a asks b") == at_b
    finally:
        for f in (hold, Path(f"{hold}.in")):
            f.unlink(missing_ok=True)
        for p in (a, b):
            if p is not None:
                p.stop()
        link.close()


def test_a_lease_lapsing_while_other_owners_are_asked_is_unavailable_not_not_found(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """r0 (a lease of 2 s, its link to etcd through a proxy) holds A0, where PROMPT's
    first 8 tokens are cached; r1 holds A1 and holds every ScoreForTenant it is asked
    (a slow owner: r0 waits 2 s for its part, then names A1 unscored). r0's link is cut
    and a reserving ScorePools sent to r0 at once: r0 scores A0 under its lease, waits
    2 s for r1's part, and its lease has lapsed by then (its last renewal was sent
    before the cut). The reservation of A0 is refused UNAVAILABLE, saying the lease
    ended during the call (was: NOT_FOUND, "pool A0 does not exist")."""
    cluster = request.node.name
    ids = ["r0", "r1"]
    a0, a1 = placed("lapse", "r0", ids), placed("lapse", "r1", ids)
    durable_server.with_sitecustomize(tmp_path, SLOW_OWNER, monkeypatch)
    hold = tmp_path / "hold-scores"
    link = Proxy(etcd.endpoint)  # r0's link to etcd
    r0 = start_server(
        replica_config(link.address, "r0", tmp_path / "r0", cluster, lease=2), env=durable_server.env()
    )
    r1 = start_server(
        replica_config(etcd, "r1", tmp_path / "r1", cluster, lease=20),
        env={**durable_server.env(), "KVCOORD_TEST_HOLD_SCORES": str(hold)},
    )
    try:
        targets = [r0.address, r1.address]
        with KVCoordClient(targets, timeout=10.0) as c:
            for pool in (a0, a1):
                c.create_pool(pool, POOL_CONFIG)
            wait_placed(targets, {a0: "r0", a1: "r1"})
            s = c.attach(a0, "sha256_cbor", 4, "0")
            c.allocate(a0, allocate("cached", PROMPT[:8], 8).allocate, s.session_id, s.fence)  # type: ignore[arg-type]
        every = {a0, a1}  # r0's view holds A1's claim (its watch read it): r1 is asked for its part
        _until(lambda: {x.pool for x in _tried(r0.address, None).scores} == every or None, 30, "r0 sees A1")
        hold.touch()
        outcome: KVCoordError | pb.ScorePoolsResponse | None = None
        for _ in range(3):  # bounded: a round whose lease lapsed before the call began is tried again
            _until(lambda: _tried(r0.address, a0).scores or None, 30, "r0 holds its lease")
            link.cut()
            try:
                with KVCoordClient(r0.address, timeout=10.0, retry=NO_RETRY) as c:
                    outcome = c.score_pools(len(PROMPT), [_prompt(PROMPT)], reserve_seconds=10.0)
            except KVCoordError as err:
                outcome = err
            link.heal()
            if not (isinstance(outcome, UnavailableError) and "its lease is not renewed" in str(outcome)):
                break
        # (was: NotFoundError "pool 'lapse..' does not exist")
        assert isinstance(outcome, UnavailableError), outcome
        assert "its membership lease may have ended during the call" in str(outcome), outcome
        hold.unlink()
        with KVCoordClient(targets, timeout=10.0) as c:  # nothing was reserved in A0
            assert c.get_stats(a0).reservations.made == 0
    finally:
        hold.unlink(missing_ok=True)
        for p in (r0, r1):
            p.stop()
        link.close()
