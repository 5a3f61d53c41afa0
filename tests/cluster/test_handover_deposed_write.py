"""A handover during which the old owner gives the pool up: the adopter's swap of the
claim deposes a write of the pool's journal to the store that the old owner had in
flight, so the old owner removes the pool (PoolStreams.on_lost: its sessions are
redirected); then the adopter's AdoptPool answer arrives, and the handover ends on a
pool no longer held there.

Before, that end raised KeyError (the pool removed twice) before the pool left the old
owner's ``moving`` set: the old owner answered OWNER_CHANGING ("retry here") for the
pool and its sessions until it restarted, so clients that last reached it never
reached the new owner, and their sessions' leases ran out there (their requests
freed). Now the old owner sends them to the new owner (NOT_OWNER).

Real etcd, two real ``kvcoord serve`` replicas, the journal in the store. A server
hook (durable_server.with_sitecustomize) opens the race deterministically: the old
owner's store writes wait while a file exists, and the adopter's AdoptPool answer
waits (after its swap) while another one exists."""

from __future__ import annotations

import threading
from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.errors import NotOwnerError
from kvcoord.client.testing import ServerProcess, start_server
from service.helpers import allocate
from test_handover_late_swap import _config, _created_with_one_request, _served, _until
from test_replicas import placed

HOOK = """
import asyncio
import os

hold = os.environ.get("KVCOORD_TEST_HOLD_STORE")
if hold:  # this replica's writes of pool journals to the store wait while the file exists
    import kvcoord.service.store_journal as sj

    txn = sj.PoolStreams._txn

    async def _txn(self, *args, **kwargs):
        while os.path.exists(hold):
            await asyncio.sleep(0.01)
        return await txn(self, *args, **kwargs)

    sj.PoolStreams._txn = _txn

answer = os.environ.get("KVCOORD_TEST_HOLD_ADOPT_ANSWER")
if answer:  # this replica's AdoptPool answers wait (after the swap) while the file exists
    import kvcoord.service.cluster_placement as cp

    adopt = cp.ClusterPlacement.adopt

    async def _adopt(self, *args, **kwargs):
        term = await adopt(self, *args, **kwargs)
        open(answer + ".swapped", "w").close()
        while os.path.exists(answer):
            await asyncio.sleep(0.01)
        if os.environ.get("KVCOORD_TEST_ADOPT_FAILS"):  # the old owner is told it failed
            raise RuntimeError("the answer of AdoptPool is lost (test hook)")
        return term

    cp.ClusterPlacement.adopt = _adopt
"""


def _told(
    address: str, call: str, *args: object, timeout: float = 5.0, **kwargs: object
) -> KVCoordError | None:
    """What ``address`` answers ``call`` (one try, ``timeout``): its error, None when it succeeds."""
    try:
        with KVCoordClient(address, timeout=timeout, retry=NO_RETRY) as c:
            getattr(c, call)(*args, **kwargs)
    except KVCoordError as err:
        return err
    return None


@pytest.mark.parametrize("answer_of_b", ["adopted", "failed"])
def test_a_pool_given_up_during_its_handover_is_sent_to_its_new_owner(
    etcd: Etcd,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    answer_of_b: str,
) -> None:
    """a holds the pool, a session and request r1; a's write of r2's record waits; b
    joins and adopts the pool (swaps the claim) and its answer waits; a's write goes
    on and is deposed (a gives the pool up); then b answers: adopted, or an error
    (a's handover failed, settled: b holds the claim). a must send the pool's calls
    and its session's to b (was: OWNER_CHANGING for good), and b serves r1."""
    cluster = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("deposed", "b", ["a", "b"])  # placement moves it to b once b joins
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    held, answer = tmp_path / "hold-store", tmp_path / "hold-answer"
    a = start_server(
        _config(etcd.endpoint, "a", tmp_path / "a", cluster, "store"),
        env={**durable_server.env(), "KVCOORD_TEST_HOLD_STORE": str(held)},
    )
    b: ServerProcess | None = None
    try:
        s, acknowledged = _created_with_one_request(a.address, pool)
        held.touch()
        outcome: list[object] = []

        def second() -> None:  # applied at a, its record held on its way to the store
            # a's answer awaited however long the hold lasts (b's start is in it): with a
            # 5 s deadline, on a loaded machine the client gave up first, and the check
            # of a's log below came before a had given the pool up
            outcome.append(_told(a.address, "allocate", pool, allocate("r2", list(range(100, 108)), 8).allocate,
                                 s.session_id, s.fence, timeout=120.0))  # fmt: skip

        writer = threading.Thread(target=second, daemon=True)
        writer.start()
        _until(lambda: "r2" in (_served([a.address], pool) or {}) or None, 20, "a applied r2")

        answer.touch()
        b = start_server(
            _config(etcd.endpoint, "b", tmp_path / "b", cluster, "store"),
            env={
                **durable_server.env(),
                "KVCOORD_TEST_HOLD_ADOPT_ANSWER": str(answer),
                "KVCOORD_TEST_ADOPT_FAILS": "1" if answer_of_b == "failed" else "",
            },
        )
        swapped = Path(f"{answer}.swapped")
        _until(lambda: swapped.exists() or None, 30, "b adopted the pool and swapped its claim")
        held.unlink()  # a's held write goes on: deposed by b's claim, so a gives the pool up
        writer.join(30)
        assert not writer.is_alive() and outcome and outcome[0] is not None, outcome  # r2 not acknowledged
        assert f"the journal of pool {pool} could not be written to the store" in a.log()  # given up at a
        answer.unlink()  # b's AdoptPool answer reaches a now

        settled = (
            "handed pool" if answer_of_b == "adopted" else "the handover's answer was lost, but replica b"
        )
        _until(lambda: (settled in a.log() or "KeyError" in a.log()) or None, 20, "a got b's answer")
        # a client that knows only a, and does not retry: a's redirect (NOT_OWNER, followed
        # at once) takes its calls to b; OWNER_CHANGING would be its answer (old code)
        assert _told(a.address, "get_pool", pool) is None
        assert _told(a.address, "heartbeat", s.session_id, s.fence, pool=pool) is None  # the session's too
        unnamed = _told(a.address, "heartbeat", s.session_id, s.fence)  # its pool known to a (moved_sessions)
        assert isinstance(unnamed, NotOwnerError) and unnamed.owner == b.address, repr(unnamed)
        with KVCoordClient(a.address, timeout=5.0, retry=NO_RETRY) as c:
            held_at_b = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool(pool, all_requests=True).requests
            }
        assert held_at_b["r1"] == acknowledged["r1"], held_at_b
        assert "KeyError" not in a.log()
    finally:
        for flag in (held, answer):
            flag.unlink(missing_ok=True)
        for p in (a, b):
            if p is not None:
                p.stop()
