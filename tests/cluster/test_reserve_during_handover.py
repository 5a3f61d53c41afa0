"""A reserving ScorePools sent to a pool's old owner while the pool is being handed
over.

The old owner has sent the pool's state (AdoptPool) and waits for the adopter's answer;
every call of the pool is told OWNER_CHANGING meanwhile. A reserving ScorePools is a
mutation of the pool too (the reservation holds blocks of its engine and is journaled),
but it scored and reserved in every pool whose claim the replica still held, moving or
not: the reservation was made in the old owner's copy after that copy's state had
been sent, the router was answered with it, and the new owner, serving the state it was
sent, never had it (the blocks it held were free there). Then the best pool's
reservation was refused like any other call of a moving pool (UNAVAILABLE,
OWNER_CHANGING); now a pool being handed over is not scored by its old owner at all
(unscored, OWNER_UNREACHABLE: test_score_owner_changes.py), so it is never its best
pool there, and nothing is held in the old owner's copy.

Real etcd, two real ``kvcoord serve`` replicas, both journal modes. A server hook
(durable_server.with_sitecustomize) holds the adopter's AdoptPool, before it loads
anything, while a file exists."""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate, hashes
from test_handover_late_swap import _config, _created_with_one_request, _served, _until
from test_replicas import placed

HOOK = """
import asyncio
import os

hold = os.environ.get("KVCOORD_TEST_HOLD_ADOPT")
if hold:  # this replica's AdoptPool waits, before it loads anything, while the file exists
    import kvcoord.service.cluster_placement as cp

    adopt = cp.ClusterPlacement.adopt

    async def _adopt(self, *args, **kwargs):
        open(hold + ".entered", "w").close()
        while os.path.exists(hold):
            await asyncio.sleep(0.01)
        return await adopt(self, *args, **kwargs)

    cp.ClusterPlacement.adopt = _adopt
"""

#: r1's prompt (two full blocks of 4, cached at a) and one more token: a hit of 8 tokens
PROMPT = list(range(8)) + [99]


def _reserve(address: str, pool: str) -> pb.ScorePoolsResponse | KVCoordError:
    """A reserving ScorePools of PROMPT in ``pool`` at ``address`` (one try)."""
    prompt = pb.HashedPrompt(
        hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes(PROMPT, 4)
    )
    try:
        with KVCoordClient(address, timeout=5.0, retry=NO_RETRY) as c:
            return c.score_pools(len(PROMPT), [prompt], [pool], reserve_seconds=20.0)
    except KVCoordError as err:
        return err


@pytest.mark.parametrize("journal", ["local", "store"])
def test_a_reservation_is_not_made_in_a_pool_being_handed_over(
    etcd: Etcd,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    journal: str,
) -> None:
    """a holds the pool (r1 cached: a hit of 8 tokens); b joins and a hands the pool
    over; b's AdoptPool waits. A reserving ScorePools at a then must not be answered with
    a reservation b never gets (the pool is unscored there, nothing reserved); once b serves the
    pool, r1 is there, the reservation made before the handover is held there for the
    rest of its time (was: released by b's reaper at once, its lease not sent), and a
    new request is given none of r1's blocks."""
    cluster = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("reserving", "b", ["a", "b"])  # placement moves it to b once b joins
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    hold = tmp_path / "hold-adopt"
    a = start_server(_config(etcd.endpoint, "a", tmp_path / "a", cluster, journal), env=durable_server.env())
    b: ServerProcess | None = None
    try:
        s, acknowledged = _created_with_one_request(a.address, pool)
        before = _reserve(a.address, pool)  # a holds the pool: reserved there (and released below)
        assert isinstance(before, pb.ScorePoolsResponse) and before.reservation.hit_tokens == 8, before

        hold.touch()
        b = start_server(
            _config(etcd.endpoint, "b", tmp_path / "b", cluster, journal),
            env={**durable_server.env(), "KVCOORD_TEST_HOLD_ADOPT": str(hold)},
        )
        _until(lambda: Path(f"{hold}.entered").exists() or None, 30, "a sent the pool to b")
        during = _reserve(a.address, pool)  # the pool is moving: a's state of it was sent
        assert isinstance(during, pb.ScorePoolsResponse), during
        assert not during.HasField("reservation") and not during.scores, during
        assert [(u.pool, u.reason) for u in during.unscored] == [(pool, "OWNER_UNREACHABLE")], during
        hold.unlink()

        assert _until(lambda: _served([b.address], pool), 30, "b serves the pool") == acknowledged
        time.sleep(2.5)  # (b's reaper of reservations runs every second)
        with KVCoordClient(b.address, timeout=5.0) as c:  # the one made before: held for its time
            assert c.get_stats(pool).reservations.live == 1, c.get_stats(pool).reservations
        with KVCoordClient([a.address, b.address], timeout=5.0) as c:
            r2 = c.allocate(pool, allocate("r2", list(range(300, 308)), 8).allocate, s.session_id, s.fence)
        assert not set(r2.result.new_block_ids[0].block_ids) & set(acknowledged["r1"])
    finally:
        hold.unlink(missing_ok=True)
        for p in (a, b):
            if p is not None:
                p.stop()
