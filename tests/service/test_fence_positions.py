"""A fence's journal position proves a restored data directory only with the tag the
journal gave it (positions.py), over real gRPC against a journaled server restarted on
the same data directory.

Before the tag, any caller could write a position: one tenant's own pre-restart fence
with ``position = 10**12`` made the server log "the journal is behind what clients were
told", end every session of every tenant, empty every prefix cache and refuse every
Attach for the grace period (persisted in grace.json); a Step with no session at all
did the same. Now such a call is refused (INVALID_ARGUMENT, FENCE_UNPROVEN) and
changes nothing, while a genuine position of a restored copy's lost history (its tag
issued before the restart, under the key the copy carries) is still proof, also from
a worker whose session the copy does not hold.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import grpc
import pytest
from helpers import allocate
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, FenceUnprovenError, GracePeriodError, SessionExpiredError
from kvcoord.service.testing import InProcessServer, ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from tenancy import POOL, TENANTS, TOKENS

CONFIG = TENANTS + POOL.format(name="a-1", extra="") + POOL.format(name="b-1", extra="")


def _serve(data: Path, clock: ManualClock) -> InProcessServer:
    return InProcessServer(CONFIG, clock=clock, data_dir=str(data)).start()


def _held(server: InProcessServer, pool: str) -> set[str]:
    with KVCoordClient(server.address, token=TOKENS["other" if pool.startswith("b") else "admin"]) as c:
        return {r.request_id for r in c.inspect_pool(pool, all_requests=True).requests}


def _forged(fence: pb.Fence, position: int, tag: bytes | None = None) -> pb.Fence:
    out = pb.Fence()
    out.CopyFrom(fence)
    out.position = position
    if tag is not None:
        out.position_tag = tag
    return out


def test_a_made_up_position_is_refused_and_voids_no_session_of_any_tenant(
    tmp_path: Path, clock: ManualClock
) -> None:
    """Tenant "user" (the use role on a-* only) sends its own pre-restart fence with a
    position of its choosing (its old tag, a random tag, or none), also in a raw Step
    with a made-up session id: every such call is refused and tenant "other"'s session, its
    request and Attach on b-1 are untouched, on this server and the next start (no
    grace was persisted). (Before: FencedError for the forger, and every session of
    every tenant ended, b-1's request freed, Attach refused for 120 s.)"""
    data = tmp_path / "data"
    first = _serve(data, clock)
    try:
        with KVCoordClient(first.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(first.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            u = user.attach("a-1", "sha256_cbor", 4, "0", "user-worker")
            o = other.attach("b-1", "sha256_cbor", 4, "0", "victim-worker")
            step = other.step("b-1", [allocate("victim-r1", list(range(16)), 16)], o.session_id, o.fence)
            assert step.results[0].status_code == 0
            issued = step.fence
    finally:
        first.stop()
    second = _serve(data, clock)
    try:
        with KVCoordClient(second.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(second.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            other.heartbeat(o.session_id, o.fence)  # the fence of the previous instance is valid
            for forged in (
                _forged(u.fence, 10**12),  # its genuine tag, of another position
                _forged(u.fence, 2**62, secrets.token_bytes(16)),
                _forged(u.fence, 2**62, b""),
            ):
                with pytest.raises(FenceUnprovenError) as refused:
                    user.heartbeat(u.session_id, forged)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
                assert refused.value.reason == "FENCE_UNPROVEN"
                with pytest.raises(FenceUnprovenError):
                    user.step("a-1", [allocate("user-r1", list(range(8)), 8)], u.session_id, forged)
            # no session at all (the position is checked first: see the restore test below)
            with grpc.insecure_channel(second.address) as channel:
                stub = pb_grpc.AllocatorStub(channel)
                bogus = pb.StepRequest(
                    pool="a-1", session_id="0" * 32, fence=_forged(u.fence, 2**62, secrets.token_bytes(16))
                )
                with pytest.raises(grpc.RpcError) as raw:
                    stub.Step(bogus, metadata=[("authorization", f"Bearer {TOKENS['user']}")], timeout=10)
                assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw.value.details()
            # nothing changed: both sessions live, b-1's request held, Attach open
            user.heartbeat(u.session_id, u.fence)
            other.heartbeat(o.session_id, o.fence)
            assert _held(second, "a-1") == set()
            assert _held(second, "b-1") == {"victim-r1"}
            other.attach("b-1", "sha256_cbor", 4, "0", "victim-worker-2")
    finally:
        second.stop()
    third = _serve(data, clock)  # and no grace period was persisted
    try:
        with KVCoordClient(third.address, token=TOKENS["other"], retry=NO_RETRY) as other:
            other.heartbeat(o.session_id, o.fence)
            other.attach("b-1", "sha256_cbor", 4, "0", "victim-worker-3")
        assert _held(third, "b-1") == {"victim-r1"}
    finally:
        third.stop()
    assert issued.position and len(issued.position_tag) == 16  # positions are issued with their tag


def _volume_snapshot(data: Path, into: Path) -> str:
    """A consistent copy of the journal of a live server (SQLite's backup, as a volume
    snapshot sees it) and the ``journal.progress`` of that moment (its text)."""
    live, copy = sqlite3.connect(data / "journal.sqlite"), sqlite3.connect(into)
    live.backup(copy)
    live.close()
    copy.close()
    return (data / "journal.progress").read_text()


def _restore(data: Path, copy: Path, progress: str) -> None:
    """Put the copy back as the whole data directory's journal."""
    for suffix in ("", "-wal", "-shm"):
        (data / f"journal.sqlite{suffix}").unlink(missing_ok=True)
    shutil.copy(copy, data / "journal.sqlite")
    (data / "journal.progress").write_text(progress)


def _fence_key(data: Path) -> bytes:
    """The fence key of the journal in ``data`` (journal.py keeps it in ``meta``)."""
    db = sqlite3.connect(data / "journal.sqlite")
    (key,) = db.execute("SELECT value FROM meta WHERE key = 'fence_key'").fetchone()
    db.close()
    return bytes.fromhex(key)


def _tag(key: bytes, instance_id: str, position: int) -> bytes:
    """A position's tag under ``key``, made as positions.py makes it."""
    message = instance_id.encode() + b"\0" + position.to_bytes(8, "big")
    return hmac.new(key, message, hashlib.sha256).digest()[:16]


def _step(c: KVCoordClient, pool: str, session: Any, fence: pb.Fence, rid: str) -> pb.StepResponse:
    step = c.step(pool, [allocate(rid, list(range(8)), 8)], session.session_id, fence)
    assert step.results[0].status_code == 0
    return step


@pytest.mark.parametrize("prover", ["worker-of-the-copy", "worker-attached-after-it"])
def test_a_restored_copy_is_proven_by_a_tag_issued_before_the_restart(
    tmp_path: Path, clock: ManualClock, prover: str
) -> None:
    """The data directory is copied while the server serves, "user" is told of records
    the copy does not hold, the server stops and the copy is put back: user's fence,
    tagged by the instance before the restart, verifies under the key the copy carries
    and proves the restore (user fenced, every session ended, Attach waits for the
    grace), as before tags. So does the Step of a worker that attached after the copy
    was made, whose session the copy does not hold (its position is checked before its
    session: told SESSION_EXPIRED instead, it would attach again at once and could be
    handed the blocks user holds)."""
    data = tmp_path / "data"
    copy = tmp_path / "copy.sqlite"
    first = _serve(data, clock)
    try:
        with KVCoordClient(first.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(first.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            u = user.attach("a-1", "sha256_cbor", 4, "0", "user-worker")
            o = other.attach("b-1", "sha256_cbor", 4, "0", "other-worker")
            _step(other, "b-1", o, o.fence, "other-r1")
            fence = _step(user, "a-1", u, u.fence, "user-r1").fence
            progress = _volume_snapshot(data, copy)
            for i in (2, 3):  # told of records the copy does not hold
                fence = _step(user, "a-1", u, fence, f"user-r{i}").fence
            late = user.attach("a-1", "sha256_cbor", 4, "0", "late-worker")  # not in the copy
    finally:
        first.stop()
    _restore(data, copy, progress)
    second = _serve(data, clock)
    try:
        with KVCoordClient(second.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(second.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            assert _held(second, "a-1") == {"user-r1"} and _held(second, "b-1") == {"other-r1"}
            session, proof = (
                (u.session_id, fence) if prover == "worker-of-the-copy" else (late.session_id, late.fence)
            )
            with pytest.raises(FencedError, match="restored"):
                user.step("a-1", [], session, proof)
            with pytest.raises((SessionExpiredError, FencedError)):
                other.heartbeat(o.session_id, o.fence)
            with pytest.raises(GracePeriodError):
                other.attach("b-1", "sha256_cbor", 4, "0", "other-worker-2")
            assert _held(second, "a-1") == set() and _held(second, "b-1") == set()
    finally:
        second.stop()


def test_a_tag_made_under_another_data_directorys_key_proves_nothing(
    tmp_path: Path, clock: ManualClock
) -> None:
    """A position beyond the journal, tagged as a tag is made but under the fence key of
    another data directory's journal (another server's secret), is refused
    FENCE_UNPROVEN: every session and request stays and Attach is open. (Before, any
    position at all was proof.)"""
    data = tmp_path / "data"
    first = _serve(data, clock)
    try:
        with KVCoordClient(first.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(first.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            u = user.attach("a-1", "sha256_cbor", 4, "0", "user-worker")
            o = other.attach("b-1", "sha256_cbor", 4, "0", "other-worker")
            _step(other, "b-1", o, o.fence, "other-r1")
    finally:
        first.stop()
    elsewhere = _serve(tmp_path / "elsewhere", clock)  # another data directory: another key
    elsewhere.stop()
    theirs = _fence_key(tmp_path / "elsewhere")
    second = _serve(data, clock)
    try:
        with KVCoordClient(second.address, token=TOKENS["user"], retry=NO_RETRY) as user, \
             KVCoordClient(second.address, token=TOKENS["other"], retry=NO_RETRY) as other:  # fmt: skip
            position = 10**6
            forged = _forged(u.fence, position, _tag(theirs, u.fence.instance_id, position))
            with pytest.raises(FenceUnprovenError):
                user.step("a-1", [], u.session_id, forged)
            user.heartbeat(u.session_id, u.fence)
            other.heartbeat(o.session_id, o.fence)
            other.attach("b-1", "sha256_cbor", 4, "0", "other-worker-2")
            assert _held(second, "b-1") == {"other-r1"}
    finally:
        second.stop()
    # the forged tag was made as the server makes its own, under its own key
    assert (
        u.fence.position
        and _tag(_fence_key(data), u.fence.instance_id, u.fence.position) == u.fence.position_tag
    )
