"""A reserving ScorePools in a cluster whose best pool's owner is slow to answer (its
journal's commit held, as on a slow disk): the owner makes the reservation and keeps
it under the call's key, but the replica the call reached gives up on it first and
answers UNAVAILABLE (its outcome unknown). The client retries under the same key.

Two pools hold the prompt's whole hit; the first is best by one free block. The first
reservation holds its 10 blocks (no longer free), so scored again the other pool ranks
first, and the retry reserved there too: two reservations for one keyed call, the
first held (its blocks kept from eviction, counted against the tenant's limit) until
its time ran out. Now the replica reached keeps the pool it asked under the key before
asking, and the retry asks that pool's owner again, which answers from its kept
answer: one reservation.

Real etcd, two real ``kvcoord serve`` replicas, real gRPC; the owner's journal writes
held by a server hook (durable_server.with_sitecustomize) while a file exists in its
data directory."""

from __future__ import annotations

from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.api import Api
from kvcoord.client.errors import UnavailableError
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from test_handover import wait_placed
from test_replicas import POOL_CONFIG, placed, replica_config
from test_score_cluster import PROMPT, _cache, _prompt

HOOK = """
import time

from kvcoord.service import journal

_real = journal.JournalStore.write


def _write(self, records, chunk=None):  # held while <data_dir>/slow exists
    slow = self.path.parent / "slow"
    while slow.exists():
        time.sleep(0.01)
    return _real(self, records, chunk)


journal.JournalStore.write = _write
"""

IDS = ["r0", "r1"]
#: the pool on r0 (one block fewer free), the one on r1 (best at first)
A0, A1 = placed("retry", "r0", IDS), placed("retry", "r1", IDS)


def created_and_placed(targets: list[str], placement: dict[str, str]) -> None:
    """Each pool of ``placement`` (pool -> replica id) created, and served where placed."""
    with KVCoordClient(targets, timeout=10.0) as c:
        for pool in placement:
            c.create_pool(pool, POOL_CONFIG)
    wait_placed(targets, placement)


def test_a_keyed_reservation_retried_after_its_owner_answered_late_is_made_once(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    cluster = request.node.name
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    procs: list[ServerProcess] = []
    slow = tmp_path / "r1" / "slow"
    try:
        for r in IDS:
            procs.append(
                start_server(
                    replica_config(etcd, r, tmp_path / r, cluster, lease=5), env=durable_server.env()
                )
            )
        r0, r1 = procs
        targets = [r0.address, r1.address]
        created_and_placed(targets, {A0: "r0", A1: "r1"})
        with KVCoordClient(targets, timeout=10.0) as c:
            _cache(c, A0, PROMPT, "whole")
            _cache(c, A1, PROMPT, "whole")
            s = c.attach(A0, "sha256_cbor", 4, "0")  # A0: one block held, one fewer free
            c.allocate(A0, allocate("pin", [9000, 9001, 9002, 9003], 4).allocate, s.session_id, s.fence)  # type: ignore[arg-type]
            before = c.score_pools(len(PROMPT), [_prompt()])
        free = before.scores[0].num_free_blocks
        assert [(x.pool, x.hit_tokens, x.num_free_blocks) for x in before.scores] == [
            (A1, 40, free),
            (A0, 40, free - 1),
        ]

        call = pb.ScorePoolsRequest(
            num_tokens=len(PROMPT), prompts=[_prompt()], reserve_seconds=30.0, idempotency_key="k-slow-owner"
        )
        slow.touch()  # r1 reserves in A1 and keeps the answer; its commit is held
        try:
            with KVCoordClient(r0.address, timeout=10.0, retry=NO_RETRY) as c:
                with pytest.raises(UnavailableError) as lost:  # r0 gave up on r1 after 2 s
                    c.unary(Api.score_pools, call)  # type: ignore[arg-type]
            assert "may or may not be made" in str(lost.value), lost.value
        finally:
            slow.unlink()
        with KVCoordClient(r0.address, timeout=10.0, retry=NO_RETRY) as c:
            again = c.unary(Api.score_pools, call)  # type: ignore[arg-type]
            assert again.reservation.pool == A1, again  # (was: A0, a second reservation)
            assert again.reservation.hit_tokens == 40
            once_more = c.unary(Api.score_pools, call)  # type: ignore[arg-type]
            assert once_more.reservation.reservation_id == again.reservation.reservation_id
        with KVCoordClient(targets, timeout=10.0) as c:
            one, other = c.get_stats(A1).reservations, c.get_stats(A0).reservations
        assert (one.made, one.live, other.made) == (1, 1, 0), (one, other)
    finally:
        slow.unlink(missing_ok=True)
        for p in procs:
            p.stop()
