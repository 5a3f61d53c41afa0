"""A restore proven by a worker of a pool made (again) after the copy was taken.

A fence names a journal position, a record of the journal whichever pool's answer told
it (positions.py): a worker of pool ``p`` deleted and made again after the volume copy
(a new incarnation), or of a pool ``q`` made after it, holds positions the copy lacks,
as any worker of the lost history. Its Step was refused INCARNATION_CHANGED (the
restored copy holds the old incarnation), or NOT_FOUND (the copy has no ``q``), before
its position was looked at: the restore went unproven, no grace began, and a worker
attaching next (to ``q`` made again) was handed the blocks that worker still held under
a running lease. Now the position is checked before the incarnation and before
NOT_FOUND, as an unknown instance's is before INSTANCE_CHANGED. Real server process,
``cp -a`` copy, SIGKILL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from durable_server import (
    DurableServer,
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


def _lost_history(
    server: DurableServer, pool: str, copy: Path | None
) -> tuple[Any, Any, list[int], pb.PoolConfig]:
    """Worker a allocates a1 in pool p, then the volume is copied to ``copy`` (None: not
    copied); pool ``pool`` is made (p: deleted and made again, a new incarnation; another
    name: made anew) and worker w allocates 48 tokens in it, then is told a position
    (the copy lacks it). Returns a, w, w's blocks and p's configuration."""
    with KVCoordClient(server.address) as c:
        a = attach(c, "worker-a", LEASE)
        step_allocate(c, a, "a1", 8)
        if copy is not None:
            copy_volume(server, copy)
        config = c.get_pool("p").pool.config
        if pool == "p":
            c.delete_pool("p")
        assert c.create_pool(pool, config).created
        w = c.attach(pool, "sha256_cbor", 4, "0", "worker-w", lease_seconds=LEASE)
        held = _allocate_in(c, pool, w, "w1", 48)
        w.fence.CopyFrom(c.step(pool, [], w.session_id, w.fence).fence)
        assert w.fence.position > 0 and w.fence.position_tag
    return a, w, held, config


def _assert_handed_none_of(c: KVCoordClient, server: DurableServer, pool: str, held: list[int]) -> None:
    """Worker c attaches to ``pool`` and allocates 48 tokens (refused for the grace is
    as good): none of ``held`` is handed to it; then the grace runs."""
    try:
        given = _allocate_in(
            c, pool, c.attach(pool, "sha256_cbor", 4, "0", "worker-c", lease_seconds=LEASE), "c1", 48
        )
    except GracePeriodError:
        given = []
    assert not set(given) & set(held), f"blocks {sorted(set(given) & set(held))} handed out twice"
    assert refused_for_grace(server.address, LEASE)


def test_a_worker_of_the_pool_made_again_proves_the_restore(tmp_path: Path) -> None:
    """Worker a allocates in pool p, the volume is copied; p is deleted and created again
    (same configuration, a new incarnation) and worker w allocates 48 tokens in it. The
    volume is restored and the server started: w's next Step proves the restore
    (INSTANCE_CHANGED, not INCARNATION_CHANGED), a's session of the copy ended with it,
    and no worker attaches inside the grace."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    copy = tmp_path / "snap"
    try:
        a, w, held_by_w, _ = _lost_history(server, "p", copy)
        assert w.fence.incarnation != a.fence.incarnation
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert c.get_pool("p").pool.fence.incarnation == a.fence.incarnation  # the copy's pool
            with pytest.raises(FencedError) as proved:
                step_allocate(c, w, "w2", 4)
            assert proved.value.reason == "INSTANCE_CHANGED", proved.value  # (was INCARNATION_CHANGED)
            _assert_handed_none_of(c, server, "p", held_by_w)
            with pytest.raises((SessionExpiredError, FencedError)):  # a's session of the copy ended
                c.heartbeat(a.session_id, a.fence)
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
        _, w, held_by_w, config = _lost_history(server, "q", copy)
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
            _assert_handed_none_of(c, server, "q", held_by_w)
    finally:
        server.stop()


def test_a_worker_of_the_deleted_incarnation_proves_nothing_without_a_restore(tmp_path: Path) -> None:
    """Pins the safe side of checking the position first: no restore, the server only
    restarted. Worker a's pool is deleted and made again (worker w allocates in it), the
    server is SIGKILLed and restarted on its own data directory; a's next Step, with the
    fence of the deleted incarnation and a position the journal holds, is refused
    INCARNATION_CHANGED and fences nothing: w's session and request stand, Attach is open."""
    server = leased_server(tmp_path, LEASE, 64)
    server.start()
    try:
        a, w, _, _ = _lost_history(server, "p", None)
        server.restart()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(FencedError) as refused:
                step_allocate(c, a, "a2", 4)
            assert refused.value.reason == "INCARNATION_CHANGED", refused.value
            c.heartbeat(w.session_id, w.fence)
            assert [r.request_id for r in c.inspect_pool("p", all_requests=True).requests] == ["w1"]
            assert not refused_for_grace(server.address, LEASE)
    finally:
        server.stop()
