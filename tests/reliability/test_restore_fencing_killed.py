"""A restore proven while serving, the server SIGKILLed after its grace was written
(``grace.json``) but before the fencing's records were committed: the restart must not
serve the copy's sessions as if nothing had been proven.

Real server process, real files. The data directory of a live server is copied (``cp
-a``); worker a goes on allocating (told more than the copy holds), worker b does
nothing more (its fence proves nothing: all it holds is in the copy). The server is
SIGKILLed and the copy restored. Worker a's next call proves the restore: the server
writes the grace to ``grace.json`` and fences (every session ended, every earlier fence
void), and answers only once that is durable. A hook in the server process (its
``sitecustomize``) holds the journal's write of the batch carrying the ``restored``
record, as a loaded machine's slow commit would; meanwhile a probe's Attach is refused
for the grace (what the chaos run checks before its kills), and the server is killed
there. That is the chaos run's crash loop inside a restore's grace
(test_restarts.py): it kills as soon as the probe is refused.

Before: the restart found ``grace.json`` and refused attaches, but its journal held
no fencing: the copy's sessions lived again, worker b's allocation was answered from
the copy and handed the blocks worker a still held under a running lease (a block held
by two live workers; seen once in the chaos run as ``'double': [(1, 1), ..., (6, 1)]``).
Now grace.json names the restore generation the proof begins, and a start whose
journal has not reached it (the fencing never committed) fences before it answers
anything, as ``kvcoord serve --restored`` does.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import durable_server
import pytest
from durable_server import (
    assert_handed_none_of,
    attach,
    leased_server,
    restore_volume,
    step_allocate,
    two_workers_then_copy,
    workers_told_more_than_the_copy,
)
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import FencedError, GracePeriodError, KVCoordError, SessionExpiredError

#: the server process's ``sitecustomize``: while FLAG exists, the journal write of a
#: batch holding a ``restored`` record (a proven restore's fencing) is held until the kill
_HOLD_FENCING = """
import os
import time

import cbor2
from kvcoord.service import journal

_real = journal.JournalStore.write


def _write(self, records, chunk=None):
    if not os.path.exists({flag!r}) or not any(cbor2.loads(b)[0] == "restored" for _, b in records):
        return _real(self, records, chunk)
    open({flag!r} + ".held", "w").close()
    for _ in range(1200):  # the kill comes meanwhile
        time.sleep(0.1)
    raise OSError("held journal write was not killed")


journal.JournalStore.write = _write
"""


def _wait_for(path: Path, what: str) -> None:
    for _ in range(1200):  # 0.05 s each
        if path.exists():
            return
        time.sleep(0.05)
    raise AssertionError(f"{what} never happened")


def test_a_restart_after_a_proof_whose_fencing_was_not_committed_serves_no_session_of_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lease = 8.0
    flag = tmp_path / "hold-fencing"
    durable_server.with_sitecustomize(tmp_path, _HOLD_FENCING.format(flag=str(flag)), monkeypatch)
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        a, b, told = workers_told_more_than_the_copy(server, lease, copy)
        restore_volume(server, copy)
        flag.touch()
        server.start()
        proof: list[BaseException] = []

        def prove() -> None:
            with KVCoordClient(server.address, retry=NO_RETRY) as c:
                try:
                    step_allocate(c, a, "a3", 4)  # held until the fencing is durable: never
                except KVCoordError as exc:
                    proof.append(exc)

        prover = threading.Thread(target=prove, daemon=True)
        prover.start()
        _wait_for(flag.with_name(flag.name + ".held"), "the fencing's journal write")
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):  # the grace runs (in memory, and in grace.json)
                attach(c, "probe", lease)
        server.kill()  # the fencing's records never committed
        prover.join(30)
        assert proof and not isinstance(proof[0], FencedError), proof  # never told INSTANCE_CHANGED
        flag.unlink()
        server.start()  # a restart inside the grace
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-c", lease)
            # Worker b's fence proves nothing (it was told nothing the copy lacks), and
            # worker a may still hold a2's blocks: b must be handed none of them.
            assert_handed_none_of(c, b, told)  # b2: every free block of the copy (12)
            with pytest.raises((SessionExpiredError, FencedError)):
                c.heartbeat(b.session_id, b.fence)
            # worker a: its retry is told its fence is void (no second fencing needed)
            with pytest.raises((SessionExpiredError, FencedError)):
                step_allocate(c, a, "a3", 4)
            inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
            assert not inspected.requests and not inspected.cached_block_ids
        fenced_at_start = (  # journal_behind's line
            "the journal is behind what clients were told (an earlier instance proved it and was stopped "
            "before its fencing committed)"
        )
        assert fenced_at_start in server.log()
        # once durable, a further restart inside the grace fences nothing again
        server.kill()
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-e", lease)
        assert fenced_at_start not in server.log()
    finally:
        server.stop()


def test_a_restored_start_killed_before_its_fencing_committed_leaves_the_next_start_fenced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """deploy/README.md's "Restore the volume" with ``kvcoord serve --restored``: the
    flag is given for one start only. That start writes the grace, then journals the
    fencing and waits for it before serving; killed in between (an OOM kill, a liveness
    probe on a slow start), the next start, without the flag, found grace.json and
    refused attaches, but served the copy's sessions (worker b, whose fence proves
    nothing, was handed the blocks worker a still held). Now it fences first."""
    lease = 8.0
    flag = tmp_path / "hold-fencing"
    durable_server.with_sitecustomize(tmp_path, _HOLD_FENCING.format(flag=str(flag)), monkeypatch)
    server = leased_server(tmp_path, lease, num_blocks=17)
    server.start()
    copy = tmp_path / "volume-snapshot"
    try:
        a, b = two_workers_then_copy(server, lease, copy)
        with KVCoordClient(server.address) as c:
            told = step_allocate(c, a, "a2", 32)
        restore_volume(server, copy)
        flag.touch()
        refused: list[BaseException] = []

        def start_restored() -> None:
            try:
                server.start(args=("--restored",))
            except RuntimeError as exc:  # killed before it served
                refused.append(exc)

        starting = threading.Thread(target=start_restored, daemon=True)
        starting.start()
        _wait_for(flag.with_name(flag.name + ".held"), "the fencing's journal write")
        assert server.proc is not None
        server.proc.kill()
        starting.join(60)
        assert refused, "the --restored start served before its fencing was durable"
        server.kill()  # (reaped: closes its log)
        flag.unlink()
        server.start()  # the flag given once only, as the procedure says
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            with pytest.raises(GracePeriodError):
                attach(c, "worker-c", lease)
            assert_handed_none_of(c, b, told)  # b2: every free block of the copy (12)
            inspected = c.inspect_pool("p", all_requests=True, include_cached_blocks=True)
            assert not inspected.requests and not inspected.cached_block_ids
    finally:
        server.stop()
