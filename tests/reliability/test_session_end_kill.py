"""``kvcoord serve`` SIGKILLed in the middle of a large session's end, which frees its
requests a slice at a time (its pool held, other pools served between slices) and is
journaled once after the last slice.

The server process holds its session end after a chosen slice (a ``sitecustomize``
hook: the slices go on yielding to the event loop, so other pools are served, until
the kill), after the first slice, half-way and before the last. After the restart the
end is absent (never journaled): the ended session's requests are all there, no block
is held by two requests, and every allocation answered to the other sessions (on the
same pool before the end, on another pool during it) is there with its block ids."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import durable_server
import pytest
from durable_server import DurableServer
from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.v1 import allocator_pb2 as pb
from support import pool_toml

#: the ended session's requests (16 blocks each): its end takes N_REQ / 16 slices
#: (registry.END_SLICE_REQUESTS)
N_REQ = 16384
TOKENS = 64
BLOCKS = N_REQ * 16 + 1024
#: the slice after which the session's end is held until the kill, one round each
KILL_AFTER_SLICE = (1, 512, 1023)

#: the server process's ``sitecustomize``: once FLAG exists (holding a slice number n),
#: a session's end says so after its n-th slice (FLAG + ".held") and goes on yielding
#: to the event loop without freeing more (the kill comes meanwhile)
_HOLD_AFTER_SLICE = """
import os
import time

from kvcoord.service import registry

_real = registry.PoolRegistry.ending


def _ending(self, s, service=None, abandon=True):
    inner = _real(self, s, service, abandon)
    hold = int(open({flag!r}).read()) if os.path.exists({flag!r}) else -1
    done = 0
    while True:
        try:
            inner.send(None)
        except StopIteration as stop:
            return stop.value
        done += 1
        if done == hold:
            open({flag!r} + ".held", "w").close()
            for _ in range(120000):
                time.sleep(0.001)
                yield
        yield


registry.PoolRegistry.ending = _ending
"""


def _allocate(rid: str) -> pb.Operation:
    sync = pb.RequestSync(request_id=rid, append_token_ids=list(range(TOKENS)), new_request=True)
    return pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=TOKENS))


def _step(client: KVCoordClient, pool: str, att: pb.AttachResponse, rids: list[str]) -> dict[str, list[int]]:
    """Allocate ``rids`` in one Step: each one's block ids, as answered."""
    results = client.step(pool, [_allocate(r) for r in rids], att.session_id, att.fence).results
    assert not any(r.status_code for r in results), [r.status_message for r in results if r.status_code][:3]
    return {
        rid: [b for g in r.allocate.new_block_ids for b in g.block_ids]
        for rid, r in zip(rids, results, strict=True)
    }


def _tables(client: KVCoordClient, pool: str) -> dict[str, list[int]]:
    out = client.inspect_pool(pool, all_requests=True)
    return {r.request_id: [b for g in r.groups for b in g.block_ids] for r in out.requests}


def _detach(address: str, att: pb.AttachResponse, answered: list[bool]) -> None:
    """Detach ``att``'s session, once (whether it was answered, in ``answered``)."""
    with KVCoordClient(address, timeout=30, retry=NO_RETRY) as d:
        try:
            d.detach(att.session_id, att.fence)
            answered.append(True)
        except KVCoordError:
            answered.append(False)


def _allocate_until(
    address: str, pool: str, att: pb.AttachResponse, prefix: str, stop: threading.Event,
    acked: dict[tuple[str, str], list[int]],
) -> None:  # fmt: skip
    """Allocate one request a Step on ``pool`` until ``stop`` (or a call fails): each
    answered one's block ids in ``acked``."""
    with KVCoordClient(address, timeout=5, retry=NO_RETRY) as o:
        i = 0
        while not stop.is_set():
            try:
                acked.update({(pool, r): v for r, v in _step(o, pool, att, [f"{prefix}{i}"]).items()})
            except KVCoordError:
                return
            i += 1


def test_a_kill_in_the_middle_of_a_sliced_session_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "hold-end"
    durable_server.with_sitecustomize(tmp_path, _HOLD_AFTER_SLICE.format(flag=str(flag)), monkeypatch)
    server = DurableServer(
        tmp_path, pool_toml("big", BLOCKS, caching=False) + pool_toml("small", 4096, caching=False)
    )
    server.start()
    acked: dict[tuple[str, str], list[int]] = {}  # (pool, request) -> block ids answered
    try:
        for round_, hold in enumerate(KILL_AFTER_SLICE):
            with KVCoordClient(server.address, timeout=60) as c:
                # (after a restart: attach once the grace of the killed instance's leases ends)
                deadline = time.monotonic() + 120
                while True:
                    try:
                        a = c.attach("big", "", 4, "", "ended", lease_seconds=3600)
                        b = c.attach("big", "", 4, "", "kept", lease_seconds=3600)
                        s = c.attach("small", "", 4, "", "kept-small", lease_seconds=3600)
                        break
                    except KVCoordError:
                        assert time.monotonic() < deadline
                        time.sleep(0.2)
                mine = [f"a{round_}-{i}" for i in range(N_REQ)]
                for k in range(0, N_REQ, 4096):
                    _step(c, "big", a, mine[k : k + 4096])
                acked.update(
                    {
                        ("big", r): ids
                        for r, ids in _step(c, "big", b, [f"b{round_}-{i}" for i in range(8)]).items()
                    }
                )
            answered: list[bool] = []
            stop = threading.Event()

            flag.write_text(str(hold))
            threads = [
                threading.Thread(target=_detach, args=(server.address, a, answered)),
                threading.Thread(
                    target=_allocate_until, args=(server.address, "small", s, f"s{round_}-", stop, acked)
                ),
            ]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            while not Path(f"{flag}.held").exists():
                assert time.monotonic() < deadline and not answered, answered
                time.sleep(0.005)
            served = len(acked)
            while len(acked) < served + 3:  # other pools are served while the end is held
                assert time.monotonic() < deadline
                time.sleep(0.005)
            server.kill()
            flag.unlink()
            Path(f"{flag}.held").unlink()
            stop.set()
            for t in threads:
                t.join(60)
            server.start()
            with KVCoordClient(server.address, timeout=60) as c:
                big, small = _tables(c, "big"), _tables(c, "small")
                for pool, tables in (("big", big), ("small", small)):
                    assert list(c.check_pool(pool).violations) == []
                    holders: dict[int, str] = {}
                    for rid, ids in tables.items():
                        for blk in ids:
                            assert blk not in holders, (
                                f"block {blk} of pool {pool} held by {holders[blk]} and {rid}"
                            )
                            holders[blk] = rid
                kept = sum(r in big for r in mine)
                assert answered == [False] and kept == N_REQ, (
                    answered,
                    kept,
                )  # killed before it was journaled
                lost = {k: v for k, v in acked.items() if (big if k[0] == "big" else small).get(k[1]) != v}
                assert not lost, f"answered allocations changed or gone: {list(lost.items())[:3]}"
                c.detach(a.session_id, a.fence)  # (the end the kill cut short, made whole now)
                after = _tables(c, "big")  # (once: not one InspectPool per request of `mine`)
                assert not any(r in after for r in mine)
    finally:
        server.stop()
