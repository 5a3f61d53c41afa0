"""The lease marker (``leases.json``, lease_marker.py) on a slow disk: its fsyncs are
made on a thread of their own, not on the event loop, and the guarantee it gives a
restart holds all the same: no lease is granted past the bound already synced, the
bound on disk never moves back, and a SIGKILL while a write is in flight leaves a
marker the restart waits for."""

from __future__ import annotations

import math
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from durable_server import env
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import GracePeriodError, KVCoordError
from kvcoord.client.testing import start_server
from kvcoord.service import lease_marker
from kvcoord.service.lease_marker import LeaseMarker
from kvcoord.service.testing import InProcessServer, ManualClock
from support import pool_toml


def test_a_slow_disk_moves_the_lease_marker_without_stalling_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every fsync takes 1 s (a disk under heavy writeback) while a worker on pool q
    renews its lease and reads its pool every 10 ms, and a worker attaches to pool p.
    The marker must move forward meanwhile (6 s leases: past half its 6 s headroom);
    it is written on its own thread, and no call of pool q waits for it: q's calls
    go on answering during every fsync (before, none was answered during one: the
    marker's two fsyncs ran on the event loop, every pool's calls waiting). Counted,
    not timed: a round of q's calls begun after an fsync began is answered before it
    ends, which a loop held by the fsync cannot do; a loaded machine slows the rounds,
    so an fsync waits up to 1 s more for one."""
    lease = 6.0
    server = InProcessServer(
        pool_toml("p", 64) + pool_toml("q", 64), data_dir=str(tmp_path / "data"), durability="none",
        session_lease_seconds=lease, max_session_lease_seconds=lease, idempotency_window_seconds=4 * lease,
        journal_stall_seconds=4.5,  # (a 6 s lease outlasts 4.5 s + 1 s in its trusted 95 %)
    ).start()  # fmt: skip
    real, running = os.fsync, server.running
    try:
        with KVCoordClient(server.address, timeout=30) as b:
            sb = b.attach("q", "sha256_cbor", 4, "0", "worker-b")  # the marker is written here (fast disk)
            attached = time.monotonic()

            rounds = [0, 0]  # q's rounds of calls begun, and answered, so far (one poller: in order)
            during: list[int] = []  # rounds begun after each slow fsync began and answered before it ended
            stop = threading.Event()

            def slow_fsync(fd: int) -> None:
                first = rounds[0] + 1  # the first round begun after this fsync began
                time.sleep(1.0)
                # on a loaded machine a round may take longer (at load 25 no round of
                # one 1 s fsync was answered once): up to 1 s more (two fsyncs a write
                # stay under the 4.5 s stall bound). A round waiting on the fsync ends
                # after it, however long this waits.
                deadline = time.monotonic() + 1.0
                while rounds[1] < first and not stop.is_set() and time.monotonic() < deadline:
                    time.sleep(0.01)
                if not stop.is_set():  # (an fsync the poller's end cut short counts nothing)
                    during.append(max(0, rounds[1] - first + 1))
                real(fd)

            monkeypatch.setattr(os, "fsync", slow_fsync)

            def poll() -> None:
                while not stop.is_set():
                    rounds[0] += 1
                    b.get_pool("q")
                    b.heartbeat(sb.session_id, sb.fence)
                    rounds[1] = rounds[0]
                    time.sleep(0.01)

            poller = threading.Thread(target=poll)
            poller.start()
            try:
                time.sleep(attached + lease + 0.5 - time.monotonic())  # past the first bound
                # a's lease inside the bound the thread moved forward: one past it would be
                # written with the loop waiting, by design (a loaded machine's thread was
                # still writing at 6.5 s, and no round was answered during its fsync)
                assert running is not None and running.startup is not None and running.startup.marker
                marker, deadline = running.startup.marker, time.monotonic() + 30
                while marker.recorded < time.monotonic() + lease + 1.0:
                    assert time.monotonic() < deadline, "the marker was never moved forward"
                    time.sleep(0.01)
                with KVCoordClient(server.address, timeout=30) as a:
                    a.attach("p", "sha256_cbor", 4, "0", "worker-a", lease_seconds=lease)
                time.sleep(0.5)
            finally:
                stop.set()
                poller.join(30)
        monkeypatch.setattr(os, "fsync", real)
        assert during, "no marker write was made while the disk was slow: the test shows nothing"
        assert min(during) > 0, f"pool q's calls answered during each 1 s fsync: {during}"
    finally:
        monkeypatch.setattr(os, "fsync", real)
        server.stop()


def test_no_lease_is_granted_past_the_bound_on_disk_and_the_bound_never_moves_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the thread's write is in flight, a lease inside the bound already synced
    is granted at once and :attr:`LeaseMarker.recorded` stays that bound; a lease past
    it waits for the write in flight, then for its own. A write that comes after
    another's (a stopped instance's thread, another instance on the same directory)
    keeps the later bound."""
    mono, wall = [100.0], [1_000_000.0]
    marker = LeaseMarker(tmp_path, 10.0, lambda: wall[0], lambda: mono[0], boot="b")
    marker.cover(10.0)
    assert marker.recorded == 120.0
    assert marker.previous_leases_remaining() == pytest.approx(20.0)
    gate, writing = threading.Event(), threading.Event()
    real = lease_marker.write_synced

    def held(path: Path, text: str) -> None:
        writing.set()
        assert gate.wait(30)
        real(path, text)

    monkeypatch.setattr(lease_marker, "write_synced", held)
    mono[0] = 106.0  # past half the headroom: the thread starts its write
    marker.cover(10.0)
    assert writing.wait(30)
    assert marker.recorded == 120.0  # nothing synced yet
    mono[0] = 109.0
    marker.cover(10.0)  # inside the bound on disk: at once
    mono[0] = 111.0  # past it: waits for the write in flight
    past = threading.Thread(target=marker.cover, args=(10.0,))
    past.start()
    past.join(0.3)
    assert past.is_alive() and marker.recorded == 120.0
    gate.set()
    past.join(30)
    assert marker.recorded >= 111.0 + 10.0
    assert marker.previous_leases_remaining() == pytest.approx(marker.recorded - mono[0])
    monkeypatch.setattr(lease_marker, "write_synced", real)
    # another instance on the same directory writes an earlier bound: the file keeps the later
    bound = marker.recorded
    other = LeaseMarker(tmp_path, 1.0, lambda: wall[0], lambda: mono[0], boot="b")
    other.cover(1.0)
    assert other.recorded == pytest.approx(bound)
    assert marker.previous_leases_remaining() == pytest.approx(bound - mono[0])


#: the server process's ``sitecustomize``: once FLAG exists, an fsync says so (FLAG +
#: ".in-flight") and hangs, as on a disk that stopped answering
_HANGING_FSYNC = """
import os
import time

_real = os.fsync


def _fsync(fd):
    if os.path.exists({flag!r}):
        open({flag!r} + ".in-flight", "w").close()
        time.sleep(120)
    _real(fd)


os.fsync = _fsync
"""


@pytest.mark.timeout(900)  # (a lease scaled to a loaded machine's starts: minutes there)
def test_a_sigkill_while_the_marker_is_written_on_its_thread_leaves_a_bound_the_restart_waits_for(
    tmp_path: Path,
) -> None:
    """A real server (no journal: its restart has only the marker to go by) whose
    marker write on the thread hangs in fsync; the worker keeps renewing its lease, and
    a renewal past the bound on disk is not answered. SIGKILLed then, the restart
    lets nobody attach until the worker's last answered lease has ended: the bound it
    found covers every lease granted.

    The numbers: the bound on disk is the attach + 2 leases (a lease and the marker's
    headroom), renewals are answered until 1 lease and the loop ends 1 s later, so the
    restart must be serving within lease - 1 s or the grace it would show has ended.
    A 4 s lease left 3 s, which a loaded machine's process start used up (2.4 s at load
    5): no attach refused, a slow restart, not a short grace. An 8 s lease leaves 7 s,
    and where a first start of the server took longer than 3 s (12 s with a 4 % CPU
    quota, about load 50 on 2 cores) the lease is twice that + 2 s. The stall bound must
    be above lease / 2 + 1 s (the thread's write hangs from half the headroom on; the
    server must not stop before the renewals' loop ends, 1 s past the lease) and the
    lease must outlast it (stalls.lease_outlasts_stalls: below 6.6 s for 8 s)."""
    flag = tmp_path / "hang-fsync"
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(_HANGING_FSYNC.format(flag=str(flag)))
    e = env()
    e["PYTHONPATH"] = f"{hook}:{e['PYTHONPATH']}"

    def config(lease: float) -> str:
        return (
            f'[server]\ndata_dir = "{tmp_path / "data"}"\ndurability = "none"\n'
            f"session_lease_seconds = {lease}\nmax_session_lease_seconds = {lease}\n"
            f"idempotency_window_seconds = {4 * lease}\n"
            f"journal_stall_seconds = {min(lease - 2.5, lease / 2 + 2)}\n{pool_toml('p', 64)}"
        )

    lease, began = 8.0, time.monotonic()
    text = config(lease)
    server = start_server(text, env=e, startup_timeout=180)
    longer = math.ceil(2 * (time.monotonic() - began) + 2)
    if longer > lease:  # a slow start: started again with the longer lease
        server.stop()
        shutil.rmtree(tmp_path / "data")
        lease, text = float(longer), config(longer)
        server = start_server(text, env=e, startup_timeout=180)
    try:
        # the Attach with the default deadline: a loaded machine's server can take longer
        # than the renewals' 0.5 s to answer it
        with KVCoordClient(server.address, retry=NO_RETRY) as setup:
            s = setup.attach("p", "sha256_cbor", 4, "0", "worker-a", lease_seconds=lease)
            attached = time.monotonic()
        with KVCoordClient(server.address, retry=NO_RETRY, timeout=0.5) as c:
            flag.touch()
            last_answered = attached
            while time.monotonic() < attached + lease + 1.0:  # past the bound on disk
                sent = time.monotonic()
                try:
                    c.heartbeat(s.session_id, s.fence)
                    last_answered = sent
                except KVCoordError:  # (past the bound: waits for the hung write)
                    pass
                time.sleep(0.05)
        assert (flag.parent / (flag.name + ".in-flight")).exists(), "the marker was never moved forward"
        assert last_answered > attached + lease / 2  # renewals went on while the write was in flight
        assert last_answered < attached + lease  # none past the bound on disk was granted
        server.proc.kill()
        server.stop()
        flag.unlink()
        server = start_server(text, env=e, startup_timeout=180)
        serving = time.monotonic()
        assert serving < last_answered + lease, (
            f"the restart served {serving - last_answered:.1f} s after the last answered renewal: "
            "its lease had ended, the grace shows nothing"
        )
        refused = 0
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            while True:
                try:
                    c.attach("p", "sha256_cbor", 4, "0", "worker-b", lease_seconds=lease)
                    break
                except GracePeriodError:
                    refused += 1
                    assert time.monotonic() < last_answered + 10 * lease, "the grace never ended"
                    time.sleep(0.05)
        assert refused and time.monotonic() >= last_answered + lease
    finally:
        server.stop()


def test_a_clean_stop_gives_the_data_directory_back_only_after_the_markers_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server stopped while its marker thread's write is in flight (held here until
    released): the data directory's lock is given back only once that write is done,
    and the thread is gone when stop() returns. (Before, the lock was given back at
    once: a second server started on the directory then could have its marker
    overwritten by this one's late write.)"""
    lease, clock = 6.0, ManualClock()
    server = InProcessServer(
        pool_toml("p", 64), clock=clock, data_dir=str(tmp_path / "data"), durability="none",
        session_lease_seconds=lease, max_session_lease_seconds=lease, idempotency_window_seconds=4 * lease,
        journal_stall_seconds=4.5,  # (a 6 s lease outlasts 4.5 s + 1 s in its trusted 95 %)
    ).start()  # fmt: skip
    running = server.running
    assert running is not None and running.startup is not None and running.data_dir_lock is not None
    marker, lock = running.startup.marker, running.data_dir_lock
    assert marker is not None
    order: list[str] = []
    gate, writing = threading.Event(), threading.Event()
    real, release = lease_marker.write_synced, lock.release

    def held(path: Path, text: str) -> None:
        writing.set()
        assert gate.wait(30)
        real(path, text)
        order.append("marker written")

    def released() -> None:
        order.append("lock released")
        release()

    monkeypatch.setattr(lock, "release", released)
    stopping = threading.Thread(target=server.stop)
    try:
        with KVCoordClient(server.address, timeout=30) as c:
            s = c.attach("p", "sha256_cbor", 4, "0", "worker")  # (the marker is written on the loop)
            monkeypatch.setattr(lease_marker, "write_synced", held)
            clock.advance(lease / 2 + 1)  # past half the headroom: a renewal starts the thread
            c.heartbeat(s.session_id, s.fence)
        assert writing.wait(30)
        stopping.start()
        stopping.join(0.5)
        assert order == [], order  # the write is in flight: the directory stays held
    finally:
        gate.set()
        if stopping.ident is None:  # (failed before stopping)
            server.stop()
        else:
            stopping.join(60)
    assert order == ["marker written", "lock released"]
    assert marker._refresher is not None and not marker._refresher.is_alive()
