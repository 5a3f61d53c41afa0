"""A restored data directory whose lost history spans a restart (real server process,
SIGKILL, `cp -a` of the data directory): the workers of the lost history were last
answered by an instance the copy never heard of, and their fences must still prove
the restore (deploy/README.md, "Restore the volume")."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
from durable_server import (
    DurableServer,
    assert_restore_proven,
    attach,
    attach_after_grace,
    copy_volume,
    leased_server,
    prove_restore_then_attach,
    restore_volume,
    step_allocate,
    two_workers_then_copy,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, SessionExpiredError
from kvcoord.v1 import allocator_pb2 as pb


def test_a_restored_volume_whose_lost_history_spans_a_restart_is_proven_by_its_workers(
    tmp_path: Path,
) -> None:
    """The volume is copied while instance 1 serves; instance 1 is SIGKILLed and
    instance 2 recovers the journal (a pod restart: the common case between two
    backups); worker a, answered by instance 2, is given more blocks; then the volume is
    lost and the copy restored without ``--restored``. Worker a's fence names instance 2,
    which the copy does not know, with a position whose tag the copy's key verifies: only
    a copy of this very journal can have issued it, so it proves the journal behind
    what a was told. (Before, an unknown instance was only INSTANCE_CHANGED: no session
    was ended, no prefix cache emptied and no grace applied, so a new worker attached at
    once and was handed the blocks worker a may still be writing.)"""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        a, b = two_workers_then_copy(server, lease, copy)
        first = a.fence.instance_id
        server.kill()
        server.start()  # instance 2 recovers everything: the lost history goes on there
        with KVCoordClient(server.address) as c:
            step = c.step("p", [], a.session_id, a.fence)
            a.fence.CopyFrom(step.fence)
            told = step_allocate(c, a, "a2", 32)
            sent = time.monotonic()
        assert a.fence.instance_id != first and a.fence.position > 0 and a.fence.position_tag
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert_restore_proven(c, a, b, lease)  # b's session (in the copy) ended with the proof
        assert "the data directory was restored from an older copy" in server.log()
        server.kill()
        server.start()  # a crash inside the grace keeps it
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-c", lease)
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            cs, attached = attach_after_grace(c, lease, "worker-c", 4 * lease)
            assert attached >= sent + lease  # worker a stopped using its ids before this
            assert set(step_allocate(c, cs, "c1", 64)) & set(told)  # a2's blocks, but only now
    finally:
        server.stop()


def _restore_proven_after_a2(server: DurableServer, tmp_path: Path, lease: float) -> Any:
    """worker-a allocates a1, the volume is copied, a2 is allocated, the copy is restored
    and proven by a's fence; returns the session attached after it (its a3 lost)."""
    copy = tmp_path / "volume-snapshot"
    with KVCoordClient(server.address) as c:
        a = attach(c, "worker-a", lease)
        step_allocate(c, a, "a1", 8)
        copy_volume(server, copy)
        a.fence.CopyFrom(c.step("p", [], a.session_id, a.fence).fence)
        step_allocate(c, a, "a2", 8)
    return prove_restore_then_attach(server, copy, a, "a3", lease)


def test_sessions_attached_after_a_proven_restore_keep_their_fence_across_a_restart(tmp_path: Path) -> None:
    """A restore proven while serving journals its ``restored`` record after the
    serving instance's own ``start`` record. A restart replays it: only the instances
    before the serving one are void, so a worker that attached after the grace keeps
    its session, its fence and its blocks across the restart, as after any restart.
    (Before, the replay voided the instance that wrote the record too: every such
    worker was told INSTANCE_CHANGED after the restart and lost every request.)"""
    lease = 3.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    try:
        d = _restore_proven_after_a2(server, tmp_path, lease)
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            held = step_allocate(c, d, "d1", 8)
        server.kill()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            step = c.step("p", [], d.session_id, d.fence)  # the fence of the instance that proved it
            d.fence.CopyFrom(step.fence)
            inspected = c.inspect_pool("p", all_requests=True)
            assert [list(r.groups[0].block_ids) for r in inspected.requests if r.request_id == "d1"] == [held]
    finally:
        server.stop()


def test_fences_of_instances_a_restore_already_voided_prove_nothing_again(tmp_path: Path) -> None:
    """After a restore is proven, the other workers of the lost history (fences of the
    instance that proved it, or of the copy's own instances) are told INSTANCE_CHANGED
    and start no second fencing: a session attached after the grace is not ended by a
    late call carrying such a fence, across a restart too."""
    lease = 3.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            b = attach(c, "worker-b", lease)
            e = attach(c, "worker-e", lease)
            step_allocate(c, b, "b1", 8)
            step_allocate(c, e, "e1", 4)  # e is told nothing after the copy: its fence names instance 1
            copy_volume(server, copy)
        server.kill()
        server.start()
        with KVCoordClient(server.address) as c:
            for s in (a, b):
                s.fence.CopyFrom(c.step("p", [], s.session_id, s.fence).fence)
            step_allocate(c, a, "a1", 8)
        d = prove_restore_then_attach(server, copy, a, "a2", lease)
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            for stale in (e, b, a):
                with pytest.raises((FencedError, SessionExpiredError)):
                    step_allocate(c, stale, "x", 4)
            step_allocate(c, d, "d1", 8)  # d's session and its request were left alone
        server.kill()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            for stale in (e, b, a):
                with pytest.raises((FencedError, SessionExpiredError)):
                    step_allocate(c, stale, "y", 4)
            d.fence.CopyFrom(c.step("p", [], d.session_id, d.fence).fence)
            step_allocate(c, d, "d2", 4)
    finally:
        server.stop()


@pytest.mark.parametrize("call", ["heartbeat", "detach"])
def test_a_renewal_of_a_session_the_copy_never_held_proves_the_restore(tmp_path: Path, call: str) -> None:
    """Worker w attached after the volume was copied, computed a request (its blocks
    went into the prefix cache) and went idle: its only calls are renewals (a Detach at
    its end). The copy holds no session of w, but w's fence proves the restore, and
    the proof comes before the session is looked up, as for a Step: the renewal is
    told INSTANCE_CHANGED and every session, fence and prefix cache of the copy ends,
    with the grace. (Before, it was told SESSION_EXPIRED first, w attached again at
    once with no proof ever made, and its prompt's hashes hit the copy's cache entries
    for blocks the lost history had written other KV into.)"""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=9)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            b = attach(c, "worker-b", lease)
            step_allocate(c, b, "shared", 16)  # the copy caches these four hashes
            c.step("p", [pb.Operation(free=pb.FreeOp(request_id="shared"))], b.session_id, b.fence)
            copy_volume(server, copy)
            w = attach(c, "worker-w", lease)
            step_allocate(c, w, "w1", 32)  # all 8 blocks: the lost history evicts "shared"'s cache
            w.fence.CopyFrom(
                c.step("p", [pb.Operation(free=pb.FreeOp(request_id="w1"))], w.session_id, w.fence).fence
            )
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(FencedError):
                if call == "heartbeat":
                    c.heartbeat(w.session_id, w.fence, pool="p")
                else:
                    c.detach(w.session_id, w.fence, pool="p")
            with pytest.raises(GracePeriodError):
                attach(c, "worker-w", lease)
            inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
            assert not inspected.requests and not inspected.cached_block_ids
    finally:
        server.stop()


def test_a_late_fence_of_a_second_lost_instance_does_not_fence_a_proven_restore_again(tmp_path: Path) -> None:
    """The lost history spans two restarts after the copy (instances 2 and 3, neither
    in the copy). Worker a (answered by instance 3) proves the restore; worker e was
    last answered by instance 2 and is silent until after the grace (a paused VM, a
    partition). The restore is already fenced: every session of the copy ended, every
    prefix cache emptied, the grace served. Worker e's late call must be refused
    INSTANCE_CHANGED and leave worker d, attached after the grace, alone: fencing
    again ends every session of every tenant for a restore already dealt with (and
    again for each lost instance, at any time later)."""
    lease = 3.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            e = attach(c, "worker-e", lease)
            step_allocate(c, e, "e1", 4)
            copy_volume(server, copy)
        server.kill()
        server.start()  # instance 2: e is answered here, then goes silent
        with KVCoordClient(server.address) as c:
            for s in (a, e):
                s.fence.CopyFrom(c.step("p", [], s.session_id, s.fence).fence)
            step_allocate(c, e, "e2", 4)
        second = e.fence.instance_id
        server.kill()
        server.start()  # instance 3: a is answered here
        with KVCoordClient(server.address) as c:
            a.fence.CopyFrom(c.step("p", [], a.session_id, a.fence).fence)
            step_allocate(c, a, "a1", 8)
        assert a.fence.instance_id != second and e.fence.position and e.fence.position_tag
        d = prove_restore_then_attach(server, copy, a, "a2", lease)
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            held = step_allocate(c, d, "d1", 8)
            with pytest.raises((FencedError, SessionExpiredError)):
                step_allocate(c, e, "e3", 4)  # worker e comes back
            d.fence.CopyFrom(c.step("p", [], d.session_id, d.fence).fence)  # d's session was left alone
            inspected = c.inspect_pool("p", all_requests=True)
            assert [list(r.groups[0].block_ids) for r in inspected.requests if r.request_id == "d1"] == [held]
        assert server.log().count("the data directory was restored from an older copy") == 1
        for name in ("d2", "d3"):  # instances started after the proof tag under its generation's key
            server.kill()
            server.start()  # (and replay their answers under it as their clients were told)
            with KVCoordClient(server.address, retry=NO_RETRY) as c:
                d.fence.CopyFrom(c.step("p", [], d.session_id, d.fence).fence)
                step_allocate(c, d, name, 4)
            with KVCoordClient(server.address, retry=NO_RETRY) as c:
                with pytest.raises((FencedError, SessionExpiredError)):
                    step_allocate(c, e, "e4", 4)
    finally:
        server.stop()


def test_a_snapshot_at_the_start_of_an_instance_after_a_restore_replays_its_answers(tmp_path: Path) -> None:
    """After a proven restore, an instance started later tags its answers under the
    restore's generation key (positions.py). Its ``start`` record triggers a snapshot
    at once when the records replayed before it reach ``snapshot_every``: that
    snapshot must know the instance's generation, or the next start replays its
    answers under the old key, finds them different from what its clients were told
    and refuses to start. (Before, the snapshot was taken before the instance's
    generation was set: "record N cannot be replayed: ... gives a different answer
    where its client was told an answer", the server unable to start; found by
    test_crash_points.py.)"""
    lease = 2.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    try:
        d = _restore_proven_after_a2(server, tmp_path, lease)
        # the next instance (the restore's generation) replays more than 3 records
        # since the last snapshot (none): its start record is snapshotted, and the one
        # Step after it is not
        server.config.write_text(
            server.config.read_text().replace("snapshot_every = 2000", "snapshot_every = 3")
        )
        server.kill()
        server.start()
        journal = sqlite3.connect(server.data_dir / "journal.sqlite")
        try:
            for _ in range(500):
                if journal.execute("SELECT count(*) FROM snapshots").fetchone()[0]:
                    break
                time.sleep(0.01)
            else:
                raise AssertionError("no snapshot at the start record")
        finally:
            journal.close()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            held = step_allocate(c, d, "d1", 8)  # told under the generation's key
        server.kill()
        server.start()  # replays that answer after the snapshot
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            inspected = c.inspect_pool("p", all_requests=True)
            assert [list(r.groups[0].block_ids) for r in inspected.requests if r.request_id == "d1"] == [held]
    finally:
        server.stop()
