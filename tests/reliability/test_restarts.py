"""Restarts, restores and lost journals of a real server process (SIGKILL, real files):
a grace period survives any number of restarts, a lost journal refuses to start, a
restored data directory is detected, a full disk stops the server with a typed status."""

from __future__ import annotations

import resource
import shutil
import subprocess
import sys
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
    env,
    leased_server,
    refused_for_grace,
    restore_volume,
    serve_once,
    started_for_grace,
    step_allocate,
    workers_told_more_than_the_copy,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, KVCoordError, SessionExpiredError
from kvcoord.v1 import allocator_pb2 as pb


@pytest.mark.timeout(900)  # (a grace scaled to a loaded machine's starts: minutes there)
def test_a_grace_period_survives_sigkills_inside_it(tmp_path: Path) -> None:
    """Issue 26 scenario 2: after a detected restore the server refuses attaches
    (GRACE_PERIOD); SIGKILLed and restarted inside that period again and again (a crash
    loop), each new process still refuses them, and the first block handed to another
    worker comes after the first worker's lease has certainly ended. (Before, the first
    restart recovered its own new journal "normally" and dropped the grace.)"""
    # the restore's start and 2 restarts inside the grace (15 s, longer on a slow machine)
    server, lease = started_for_grace(tmp_path, 15.0, num_blocks=9, starts=3)
    journal = server.data_dir / "journal.sqlite"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            step_allocate(c, a, "a1", 8)
            for suffix in ("", "-wal"):  # an older copy of the journal (the server is idle)
                shutil.copy(journal.with_name(journal.name + suffix), tmp_path / f"old{suffix}")
            sent = time.monotonic()
            told = step_allocate(c, a, "a2", 8)  # worker a holds these; the copy does not know
        server.kill()
        (server.data_dir / "leases.json").unlink()  # lost with the volume: the worst case
        journal.with_name(journal.name + "-shm").unlink(missing_ok=True)
        for suffix in ("", "-wal"):
            shutil.copy(tmp_path / f"old{suffix}", journal.with_name(journal.name + suffix))
        restored_at = time.monotonic()
        server.start()
        assert refused_for_grace(server.address, lease)
        inside = 0
        for restart in range(3):  # a crash loop inside the grace (>= lease from the restore)
            server.kill()
            server.start()
            if time.monotonic() < restored_at + lease:
                assert refused_for_grace(server.address, lease), f"restart {restart} dropped the grace"
                inside += 1
        assert inside >= 2, "the machine is too slow for this test: restarts took most of the grace"
        b, attached = attach_after_grace(server.address, lease, "worker-b", 4 * lease)
        assert attached >= sent + lease  # worker a stopped using its ids before this
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            given = step_allocate(c, b, "b1", 32)
            assert set(given) & set(told)  # a2's blocks went to b, but only now
    finally:
        server.stop()


@pytest.mark.timeout(900)  # (a grace scaled to a loaded machine's starts: minutes there)
def test_a_lost_journal_refuses_to_start_until_told_to_start_empty(tmp_path: Path) -> None:
    """Issue 26 scenario 4: journal.sqlite deleted (or truncated to 0 bytes) while
    journal.progress names committed records: `kvcoord serve` exits 5 naming the loss
    and the ways out, and leaves the progress file as it was. `--start-empty` starts
    empty, keeps the old files aside and hands out no block for a full lease, a grace
    that a SIGKILL inside it does not reset. (Before, the server printed "new", started
    empty at once and overwrote the progress file.)"""
    from kvcoord.service.main import EXIT_JOURNAL_LOST

    # the empty start and a restart inside the grace (5 s, longer on a slow machine)
    server, lease = started_for_grace(tmp_path, 5.0, num_blocks=9, starts=2)
    journal = server.data_dir / "journal.sqlite"
    progress = server.data_dir / "journal.progress"
    with KVCoordClient(server.address) as c:
        a = attach(c, "worker-a", lease)
        step_allocate(c, a, "a1", 8)
    server.kill()
    evidence = progress.read_bytes()
    assert int(evidence.split()[1]) > 0
    for damage in ("truncated", "deleted"):
        if damage == "truncated":
            journal.write_bytes(b"")
            for suffix in ("-wal", "-shm"):
                journal.with_name(journal.name + suffix).unlink(missing_ok=True)
        else:
            journal.unlink()
        proc = serve_once(server.config)
        assert proc.returncode == EXIT_JOURNAL_LOST, proc.stderr
        assert f"journal {journal} is" in proc.stderr and "was lost" in proc.stderr
        assert "--start-empty" in proc.stderr and "restore the whole data directory" in proc.stderr
        assert progress.read_bytes() == evidence
    server.start(args=("--start-empty",))
    try:
        assert "started empty after a lost journal" in server.log()
        assert list(server.data_dir.glob("journal.progress.lost-*"))
        assert refused_for_grace(server.address, lease)
        server.kill()
        server.start()  # a plain restart inside the grace: the new journal is recovered whole
        assert refused_for_grace(server.address, lease)
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises((FencedError, SessionExpiredError)):
                c.heartbeat(a.session_id, a.fence)
        attach_after_grace(server.address, lease, "worker-b", 4 * lease)
    finally:
        server.stop()


def test_an_unwritable_data_dir_refuses_to_start(tmp_path: Path) -> None:
    """A server promising durability whose data directory cannot be written stops at
    start with exit 3 naming the directory (not a journal-less run)."""
    from kvcoord.service.main import EXIT_CANNOT_START

    server = leased_server(tmp_path, 5.0, num_blocks=9)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    server.config.write_text(server.config.read_text().replace(str(server.data_dir), str(blocker / "data")))
    proc = serve_once(server.config)
    assert proc.returncode == EXIT_CANNOT_START, proc.stderr
    assert f"data directory {blocker / 'data'} cannot be written" in proc.stderr


def test_a_lease_marker_that_cannot_be_written_is_unavailable_not_internal(tmp_path: Path) -> None:
    """Issue 26 (10): a full disk when the lease marker must move forward. The Attach
    that needed it is refused UNAVAILABLE (no lease granted), health leaves SERVING and
    the process exits 4 for its supervisor, as after a failed journal write. (Before,
    the Attach failed INTERNAL and the server kept serving.)"""
    import grpc
    from kvcoord.service.main import EXIT_JOURNAL_FAILED

    lease = 5.0
    server = leased_server(tmp_path, lease, num_blocks=9)
    server.config.write_text(
        server.config.read_text().replace("[server]\n", '[server]\ndurability = "none"\n')
    )
    # The data directory keeps only the lease marker, and no file may grow past 16 bytes
    # (RLIMIT_FSIZE: EFBIG, as on a full disk); the output goes to a pipe, which it spares.
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(server.config)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(),
    )  # fmt: skip
    resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (16, 16))
    try:
        with KVCoordClient(server.address, retry=NO_RETRY, timeout=2.0) as c:
            for _ in range(600):
                try:
                    if c.health() == "SERVING":
                        break
                except KVCoordError:
                    time.sleep(0.05)
            with pytest.raises(KVCoordError) as err:
                attach(c, "worker-a", lease)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE, err.value
            assert "cannot write lease marker" in str(err.value)
        assert proc.wait(60) == EXIT_JOURNAL_FAILED
        out, _ = proc.communicate(timeout=10)
        assert "the journal or lease marker cannot be written" in out.decode()
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


@pytest.mark.parametrize("snapshot_every", [1, 10_000])
def test_a_wall_clock_ahead_after_a_restart_expires_no_answer(tmp_path: Path, snapshot_every: int) -> None:
    """Issue 26 (10) and done 8: a server restarted with its wall clock an hour ahead
    (well past the 300 s idempotency window) still answers a retried keyed Step from
    its journal, from a snapshot or from replayed records, and applies nothing twice:
    the downtime does not age answers. (Before, recovery aged every answer by the wall
    clock's jump and the retry was applied as a new call.)"""
    import asyncio

    from kvcoord.client import _requests as rq
    from kvcoord.service.idempotency import IdempotencyStore
    from kvcoord.service.recovery import open_journal
    from kvcoord.service.registry import Limits, PoolRegistry
    from kvcoord.service.servicer import AllocatorServicer
    from kvcoord.service.sessions import SessionTable
    from kvcoord.service.testing import ManualClock
    from support import wire_pool_config

    class Ctx:
        async def abort(self, code: Any, message: str, trailers: Any = ()) -> None:
            raise AssertionError(f"{code}: {message}")

    def node(wall: Any) -> tuple[AllocatorServicer, Any]:
        clock = ManualClock()
        registry = PoolRegistry(
            Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20)
        )
        recovery = open_journal(registry, str(tmp_path), "OFF", snapshot_every, wall)
        registry.wall_clock = wall
        recovery.recorder.wall_clock = wall
        return AllocatorServicer(registry), recovery

    loop = asyncio.new_event_loop()
    try:

        async def first() -> tuple[Any, Any]:
            servicer, recovery = node(time.time)
            await servicer.CreatePool(pb.CreatePoolRequest(name="p", config=wire_pool_config(50)), Ctx())
            a = await servicer.Attach(rq.attach("p", "sha256_cbor", 4, "0", "w", 0), Ctx())
            sync = pb.RequestSync(
                request_id="r1", append_token_ids=list(range(32)), new_request=True,
                append_block_hashes=[f"h{i}".encode().ljust(32, b".") for i in range(8)],
            )  # fmt: skip
            op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=32))
            request = rq.step("p", [op], a.session_id, a.fence)
            answer = await servicer.Step(request, Ctx())
            await recovery.recorder.journal.close()
            return request, answer

        request, answer = loop.run_until_complete(first())
        assert pb.StepResponse.FromString(answer).results[0].status_code == 0

        async def after_restart() -> tuple[Any, int]:
            servicer, recovery = node(lambda: time.time() + 3600.0)
            again = await servicer.Step(request, Ctx())
            held = len(servicer.registry.pools["p"].owners)
            await recovery.recorder.journal.close()
            return again, held

        again, held = loop.run_until_complete(after_restart())
        assert again == answer and held == 1
    finally:
        loop.close()


def test_a_restored_volume_is_detected_by_the_first_worker_told_more(tmp_path: Path) -> None:
    """Issue 26 scenario 3, deploy/README.md's "Restore the volume": the whole data
    directory of a live server copied with `cp -a` (journal, WAL, journal.progress,
    lease marker from one moment) while workers hold blocks; a worker keeps allocating,
    the server is SIGKILLed, the copy restored and the server restarted. Start-up cannot
    tell (everything is consistent), but the worker's next call carries the journal
    position it was told: the server fences every session, empties its prefix cache and
    hands nothing out until the worker's lease has ended, so the blocks the copy does
    not know go to nobody else meanwhile; a SIGKILL inside that grace does not end it.
    (Before, the worker carried on, and a new worker attached at once and was given
    the blocks the first one held.)"""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        a, b, told = workers_told_more_than_the_copy(server, lease, copy)
        sent = time.monotonic()
        restore_volume(server, copy)
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert_restore_proven(c, a, b, lease)
        server.kill()
        server.start()  # a crash inside the grace keeps it
        assert refused_for_grace(server.address, lease)
        cs, attached = attach_after_grace(server.address, lease, "worker-c", 4 * lease)
        assert attached >= sent + lease
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            assert set(step_allocate(c, cs, "c1", 64)) & set(told)  # a2's blocks, but only now
    finally:
        server.stop()


def test_a_keyed_call_outlasts_a_server_restart_with_the_default_retry_policy(tmp_path: Path) -> None:
    """Issue 26 (11), done 14: a keyed Step sent while its journaled server is down
    (SIGKILLed, restarted 3 s later) is retried with the client's default policy
    until the restarted server answers it, applied once: no OutcomeUnknownError.
    (Before, the default policy gave up after 8 attempts, about 4 s.)"""
    import threading

    server = leased_server(tmp_path, 30.0, num_blocks=33)
    server.start()
    try:
        with KVCoordClient(server.address) as c:  # the default RetryPolicy
            a = c.attach("p", "sha256_cbor", 4, "0", "worker-a")
            server.kill()
            restarted = threading.Timer(3.0, server.start)
            restarted.start()
            try:
                given = step_allocate(c, a, "a1", 16)  # in flight during the whole restart
            finally:
                restarted.join()
            held = {
                r.request_id: list(r.groups[0].block_ids)
                for r in c.inspect_pool("p", all_requests=True).requests
            }
            assert held == {"a1": given}
    finally:
        server.stop()


@pytest.mark.timeout(900)  # (~45 s alone; 5 minutes at load 18 on 2 cores, each start 10-15 s)
def test_chaos_full_disks_a_crash_loop_in_a_grace_and_a_restored_volume(tmp_path: Path) -> None:
    """Issue 26 done 11, the durability chaos run extended. Three worker processes
    drive one pool (each checks after every step that the server holds exactly what it
    was told, and that no block it is given is held by another live worker) while:

    1. the disk fills at random points (RLIMIT_FSIZE a random number of bytes above the
       files' sizes, 4 times): the server stops with exit 4 and is restarted, as its
       supervisor would; no worker loses a request (the journal survived), unless its
       client could not prove its lease across a stop and restart slower than half the
       lease (a loaded machine): a typed LeaseExpiredError, the client's own verdict;
    2. the data directory is copied like a volume snapshot (`cp -a` of the server,
       paused as an atomic snapshot would see it) while the workers hold blocks, the
       workers keep working, the server is SIGKILLed and the copy restored: the first
       worker's call proves the restore, every worker is told its requests are lost;
    3. 5 SIGKILLs and restarts inside the grace period that follows: each restarted
       server still refuses attaches until the grace has ended;
    4. the workers carry on after the grace.

    Throughout, a slow KV router reads the pool's WatchEvents (one event per 50 ms, far
    behind the workers' eviction storms), resuming after every restart. No block is ever
    held by two live requests (workers' view and `check_pool`), and the slow reader
    holds up nothing: every worker steps on, the reader is told of what it missed."""
    import multiprocessing
    import random

    from durable_workload import run_checked_worker, run_slow_watcher, steps_on
    from kvcoord.service.main import EXIT_JOURNAL_FAILED
    from workload import check_pool, pool_config

    lease = 20.0  # longer than a full-disk stop and restart on a loaded machine
    server = DurableServer(tmp_path)
    server.config.write_text(
        server.config.read_text().replace(
            "snapshot_every = 2000\n",
            f"snapshot_every = 500\nmax_session_lease_seconds = {lease}\nsession_lease_seconds = {lease}\n"
            f"idempotency_window_seconds = {20 * lease}\n",
        )
    )
    server.start()
    ctx = multiprocessing.get_context("spawn")
    out, stop, phase = ctx.Queue(), ctx.Event(), ctx.Value("i", 1)
    progress = [ctx.Value("i", 0) for _ in range(3)]
    manager = ctx.Manager()
    holdings = manager.dict()
    rnd = random.Random(26)
    procs: list[Any] = []
    full_disks = 0
    try:
        with KVCoordClient(server.address, timeout=20) as c:
            c.create_pool("chaos", pool_config(300))
            procs = [
                ctx.Process(
                    target=run_checked_worker,
                    args=(server.address, "chaos", w, 900 + w, stop, out),
                    kwargs={"holdings": holdings, "phase": phase, "progress": progress[w]},
                )
                for w in range(3)
            ]
            watcher_out = ctx.Queue()
            watcher = ctx.Process(
                target=run_slow_watcher, args=(server.address, "chaos", 0.05, stop, watcher_out)
            )
            procs.append(watcher)
            for p in procs:
                p.start()
            time.sleep(2.0)
            # 1. full disks at random points
            outages = []  # each stop and restart: from the kill until the server serves again
            for _ in range(4):
                # every worker has checked a step since the last restart: the next kill
                # starts a new outage (back to back, a loaded machine's slow restarts
                # would make one outage of several)
                steps_on(progress, procs[:3])
                size = max(_size(f) for f in server.data_dir.iterdir())
                server.kill()
                began = time.monotonic()
                try:
                    server.start(max_file_bytes=size + rnd.randrange(8_192, 262_144))
                    assert server.proc is not None
                    code = server.proc.wait(8.0)
                except RuntimeError as exc:  # the disk filled while it started
                    assert f"server exited with {EXIT_JOURNAL_FAILED}" in str(exc), exc
                    code = EXIT_JOURNAL_FAILED
                except subprocess.TimeoutExpired:
                    code = None  # the cap was not reached in time: a plain kill instead
                assert code in (None, EXIT_JOURNAL_FAILED), server.log()
                full_disks += code == EXIT_JOURNAL_FAILED
                server.kill()  # (a no-op after an exit)
                server.start()
                outages.append(time.monotonic() - began)
                check_pool(c, "chaos", 300)
                print(f"full disk: exit {code} after {outages[-1]:.1f} s")
            time.sleep(1.0)
            # 2. a volume snapshot while workers hold blocks, more work, then the restore
            with server.paused():  # a snapshot child too: it would rename files under cp
                copy_volume(server, tmp_path / "snap")
            # Every worker checks a step begun after the copy, so each is told a journal
            # position the copy lacks and its next call proves the restore. A worker
            # told nothing after the copy (the copy made before it was answered once
            # since the last restart: at load 20 the copy held the serving instance's
            # start record only) proves nothing, and is served from the copy until
            # another worker's call proves it, blocks the lost history gave others
            # included: the window deploy/README.md names ("If the flag is forgotten"),
            # which only `kvcoord serve --restored` closes (its own test, below). Seen
            # as 'double': [(111, 2), ..., (114, 0)] with the proof 0.7 s after the
            # restored server's start.
            for _ in range(2):  # (the first may have begun before the copy)
                steps_on(progress, procs[:3])
            time.sleep(1.5)
            phase.value = 2
            restore_volume(server, tmp_path / "snap")
            restored_at = time.monotonic()
            server.start()
            for _ in range(200):  # a worker's call proves the restore
                if _attach_refused_for_grace_on(server.address, "chaos", lease):
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the restored volume was never detected")
            # 3. a crash loop inside the grace
            loops = 0
            for _ in range(5):
                server.kill()
                server.start()
                loops += 1
                if time.monotonic() < restored_at + lease:  # surely inside the grace
                    assert _attach_refused_for_grace_on(server.address, "chaos", lease), f"restart {loops}"
                check_pool(c, "chaos", 300)
            # 4. after the grace, work goes on
            phase.value = 3
            time.sleep(lease + 3.0)
            stop.set()
            reports = [out.get(timeout=120) for _ in procs[:-1]]
            watched = watcher_out.get(timeout=120)
            check_pool(c, "chaos", 300)
    finally:
        stop.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
        manager.shutdown()
        server.stop()
    assert full_disks >= 1 and loops == 5
    print(reports)
    for r in reports:
        assert r["error"] == "", r
        assert r["double"] == [], r
        # The journal survived every full disk: the server ended no session and lost no
        # request (no SessionExpired, Fenced, RequestUnknown, SyncMismatch, OutcomeUnknown).
        assert r["lost_by_phase"].get(1, 0) == r["unproven_by_phase"].get(1, 0), r
        # The only loss a full disk may cost: a client that could not prove its lease
        # (no renewal answered for 0.95 x the lease) reports its requests lost (typed
        # LeaseExpiredError; the server still held them). That takes an outage near the
        # lease: never one of these restarts on an idle machine (2-3 s each), only where
        # a restart was slower than half the lease (10-30 s at load 15-20 on 2 cores).
        if r["unproven_by_phase"].get(1, 0):
            assert max(outages) >= lease / 2, (outages, r)
        assert r["checks"] > 0, r
    # the restore was told (a worker re-attaching waits out the grace: it may hear after it)
    assert sum(r["lost_by_phase"].get(2, 0) + r["lost_by_phase"].get(3, 0) for r in reports) > 0
    assert all(r["steps"] > 0 for r in reports)
    print(watched)
    assert watched["error"] == "" and watched["backwards"] == 0, watched
    # it fell behind (told of gaps) and followed the restarts (told of the restore's reset)
    assert watched["events"] > 0 and watched["gaps"] > 0 and watched["reconnects"] > 0, watched


def _size(path: Path) -> int:
    """A data directory file's size (0: gone meanwhile, a snapshot's part renamed)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _attach_refused_for_grace_on(address: str, pool: str, lease: float) -> bool:
    with KVCoordClient(address, retry=NO_RETRY) as c:
        try:
            s = c.attach(pool, "sha256_cbor", 16, "0", "probe", lease_seconds=lease)
        except GracePeriodError:
            return True
        try:
            c.detach(s.session_id, s.fence)
        except SessionExpiredError:
            # a worker's call proved the restore between the two calls: the server
            # then ended every session, this probe's too, and the grace began
            return False
    return False


def test_lease_marker_and_grace_count_on_the_monotonic_clock_within_a_boot(tmp_path: Path) -> None:
    """Done 8: the lease marker and grace.json record their deadline on both clocks. A
    restart on the same boot with the wall clock set an hour forward still waits the
    whole remaining time (monotonic); after a reboot (another boot id) only the wall
    clock is left. (Before, the marker held a wall-clock time only: a clock set forward
    ended the wait at once.)"""
    from kvcoord.service.lease_marker import LeaseMarker
    from kvcoord.service.startup import DurableDeadline, GraceFile

    wall, mono = [1_000_000.0], [50.0]
    marker = LeaseMarker(tmp_path, 120.0, lambda: wall[0], lambda: mono[0], boot="boot-a")
    marker.cover(30.0)  # leases end within 150 s
    grace = GraceFile(tmp_path, DurableDeadline(lambda: wall[0], lambda: mono[0], "boot-a"))
    grace.record(40.0, "a restore")
    mono[0] += 10.0
    wall[0] += 3600.0 + 10.0  # the wall clock jumped forward an hour meanwhile
    same_boot = LeaseMarker(tmp_path, 120.0, lambda: wall[0], lambda: mono[0], boot="boot-a")
    assert same_boot.previous_leases_remaining() == pytest.approx(140.0)
    assert GraceFile(tmp_path, DurableDeadline(lambda: wall[0], lambda: mono[0], "boot-a")).remaining() == (
        pytest.approx(30.0),
        "a restore",
    )
    rebooted = LeaseMarker(tmp_path, 120.0, lambda: wall[0], lambda: 3.0, boot="boot-b")
    remaining = rebooted.previous_leases_remaining()
    assert remaining is not None and remaining == pytest.approx(150.0 - 3610.0)


def test_a_volume_restored_with_the_flag_leaves_no_window(tmp_path: Path) -> None:
    """deploy/README.md's "Restore the volume" with ``kvcoord serve --restored``: the
    window the clients' proof leaves (before the first worker told more calls) is
    closed by the operator's word. The copy's sessions and fences end before the
    first answer, so a worker that was told nothing after the copy (b) cannot allocate
    from the copy's view of the pool either, and no session attaches for a full lease,
    across a SIGKILL too. (Before, a worker whose fence proves nothing kept allocating
    at once, from blocks the lost history had given to worker a.)"""
    lease = 6.0
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        with KVCoordClient(server.address) as c:
            a = attach(c, "worker-a", lease)
            b = attach(c, "worker-b", lease)
            step_allocate(c, b, "b1", 8)
            copy_volume(server, copy)
            step_allocate(c, a, "a1", 32)  # after the copy: the copy gives these blocks to nobody
        restore_volume(server, copy)
        server.start(args=("--restored",))
        assert "the data directory was restored (--restored)" in server.log()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises((FencedError, SessionExpiredError)):
                step_allocate(c, b, "b2", 32)  # b's fence names the copy's history: it proves nothing
            with pytest.raises(GracePeriodError):
                attach(c, "worker-c", lease)
            inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
            assert not inspected.requests and not inspected.cached_block_ids
        server.kill()
        server.start()  # a crash inside the grace keeps it, without the flag
        assert refused_for_grace(server.address, lease)
    finally:
        server.stop()
