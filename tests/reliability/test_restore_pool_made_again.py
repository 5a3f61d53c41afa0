"""A restore proven by a worker of a pool deleted and created again after the copy.

A fence names a journal position, a record of the journal whichever pool's answer told
it (positions.py): a worker of pool ``p`` made again after the volume copy (a new
incarnation) holds positions the copy lacks, as any worker of the lost history. Its
Step was refused INCARNATION_CHANGED (the restored copy holds the old incarnation)
before its position was looked at: the restore went unproven, no grace began, and a
worker attaching next was handed the blocks that worker still held under a running
lease. Now a known instance's position is checked before its incarnation, as an
unknown instance's is before INSTANCE_CHANGED. Real server process, ``cp -a`` copy,
SIGKILL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from durable_server import (
    attach,
    copy_volume,
    leased_server,
    refused_for_grace,
    restore_volume,
    step_allocate,
)
from kvcoord.client import NO_RETRY, KVCoordClient, NotFoundError
from kvcoord.client.errors import FencedError, GracePeriodError, SessionExpiredError
from kvcoord.v1 import allocator_pb2 as pb

LEASE = 4.0


def test_a_worker_of_the_pool_made_again_proves_the_restore(tmp_path: Path) -> None:
    """Worker a allocates in pool p, the volume is copied; p is deleted and created again
    (same configuration, a new incarnation) and worker b allocates 48 tokens in it. The
    volume is restored and the server started: b's next Step proves the restore
    (INSTANCE_CHANGED, not INCARNATION_CHANGED), a's session of the copy ended with it,
    and no worker attaches inside the grace."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    copy = tmp_path / "snap"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", LEASE)
            step_allocate(c, a, "a1", 8)
            copy_volume(server, copy)
            config = c.get_pool("p").pool.config
            old = a.fence.incarnation
            c.delete_pool("p")
            assert c.create_pool("p", config).created
            b = attach(c, "worker-b", LEASE)
            assert b.fence.incarnation != old
            held_by_b = step_allocate(c, b, "b1", 48)
            b.fence.CopyFrom(c.step("p", [], b.session_id, b.fence).fence)  # a position the copy lacks
            assert b.fence.position > 0 and b.fence.position_tag
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert c.get_pool("p").pool.fence.incarnation == old  # the copy's pool
            try:
                step_allocate(c, b, "b2", 4)
            except FencedError as err:
                assert err.reason == "INSTANCE_CHANGED", err  # (was INCARNATION_CHANGED: unproven)
            else:
                raise AssertionError("b's Step was served by the restored copy")
            try:
                given = step_allocate(c, attach(c, "worker-c", LEASE), "c1", 48)
            except GracePeriodError:
                given = []
            assert not set(given) & set(held_by_b), (
                f"blocks {sorted(set(given) & set(held_by_b))} handed out twice"
            )
            assert refused_for_grace(server.address, LEASE)
            try:
                c.heartbeat(a.session_id, a.fence)
            except (SessionExpiredError, FencedError):
                pass
            else:
                raise AssertionError("a's session of the copy outlived the proven restore")
    finally:
        server.stop()


def test_a_worker_of_the_deleted_incarnation_proves_nothing_without_a_restore(tmp_path: Path) -> None:
    """Pins the safe side of checking the position first: no restore, the server only
    restarted. Worker a's pool is deleted and made again (worker b allocates in it), the
    server is SIGKILLed and restarted on its own data directory; a's next Step, with the
    fence of the deleted incarnation and a position the journal holds, is refused
    INCARNATION_CHANGED and fences nothing: b's session and request stand, Attach is open."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", LEASE)
            step_allocate(c, a, "a1", 8)
            a.fence.CopyFrom(c.step("p", [], a.session_id, a.fence).fence)
            assert a.fence.position > 0 and a.fence.position_tag
            config = c.get_pool("p").pool.config
            c.delete_pool("p")
            c.create_pool("p", config)
            b = attach(c, "worker-b", LEASE)
            step_allocate(c, b, "b1", 8)
        server.restart()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            try:
                step_allocate(c, a, "a2", 4)
            except FencedError as err:
                assert err.reason == "INCARNATION_CHANGED", err
            else:
                raise AssertionError("a Step of the deleted incarnation was served")
            c.heartbeat(b.session_id, b.fence)
            assert [r.request_id for r in c.inspect_pool("p", all_requests=True).requests] == ["b1"]
            assert not refused_for_grace(server.address, LEASE)
    finally:
        server.stop()


@pytest.mark.parametrize("call", ["step", "attach"])
def test_a_worker_of_a_pool_the_copy_lacks_proves_the_restore(tmp_path: Path, call: str) -> None:
    """Pool q is created after the volume copy and worker w allocates 48 tokens in it;
    the copy is restored. w's Step (or, its session lost, its Attach naming the fence it
    held) finds no pool q: its position is proven first (INSTANCE_CHANGED), and no worker
    attaches inside the grace, so a q made again hands nobody w's blocks meanwhile.
    (Before: NOT_FOUND, nothing proven; q made again at once, worker c attached and was
    handed w's blocks.)"""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    copy = tmp_path / "snap"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", LEASE)
            step_allocate(c, a, "a1", 8)
            copy_volume(server, copy)
            config = c.get_pool("p").pool.config
            c.create_pool("q", config)
            w = c.attach("q", "sha256_cbor", 4, "0", "worker-w", lease_seconds=LEASE)
            held_by_w = _allocate_in(c, "q", w, "w1", 48)
            w.fence.CopyFrom(c.step("q", [], w.session_id, w.fence).fence)  # a position the copy lacks
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            try:
                if call == "step":
                    _allocate_in(c, "q", w, "w2", 4)
                else:
                    c.attach(
                        "q", "sha256_cbor", 4, "0", "worker-w", lease_seconds=LEASE, previous_fence=w.fence
                    )
            except FencedError as err:
                assert err.reason == "INSTANCE_CHANGED", err
            except NotFoundError as err:
                raise AssertionError(f"the restore went unproven: {err}") from None
            c.create_pool("q", config)  # made again (an operator, a deployment)
            try:
                cs = c.attach("q", "sha256_cbor", 4, "0", "worker-c", lease_seconds=LEASE)
                given = _allocate_in(c, "q", cs, "c1", 48)
            except GracePeriodError:
                given = []
            assert not set(given) & set(held_by_w), (
                f"blocks {sorted(set(given) & set(held_by_w))} handed out twice"
            )
            assert refused_for_grace(server.address, LEASE)
    finally:
        server.stop()


def _allocate_in(c: KVCoordClient, pool: str, session: Any, rid: str, num_tokens: int) -> list[int]:
    """:func:`step_allocate` in ``pool``: ``rid``'s new block ids."""
    sync = pb.RequestSync(
        request_id=rid, append_token_ids=list(range(num_tokens)), new_request=True,
        append_block_hashes=[f"{rid}-{i}".encode().ljust(32, b".") for i in range(num_tokens // 4)],
    )  # fmt: skip
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=num_tokens))
    result = c.step(pool, [op], session.session_id, session.fence).results[0]
    assert result.status_code == 0, result
    return list(result.allocate.new_block_ids[0].block_ids)
