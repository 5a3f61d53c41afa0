"""A Step told SESSION_EXPIRED, then ``kvcoord serve`` SIGKILLed (real process, data
directory): the restart must not bring the session back.

The session's lease runs out and no reaper ends it (the server process's reaper does
nothing: a ``sitecustomize`` hook, so the Step always reaches the lapsed session
before any reaper could, as the crash-point harness saw with a 1 s reaper). The Step
is told SESSION_EXPIRED ("its requests were freed; call Attach again"); the server is
SIGKILLed right after the answer and restarted on the same data directory. Before,
nothing was journaled: the restart brought the session and its request back on a
fresh lease, its blocks held and the exclusive pool refusing the worker's new Attach.
"""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import pytest
from durable_server import leased_server, step_allocate
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.errors import SessionExpiredError

#: the session lease, above the shortest a server whose journal_stall_seconds is STALL
#: accepts (stalls.py: lease x 0.95 > STALL + min(1, STALL): 1.05 s) with room for the
#: calls before it runs out on a loaded machine (0.5 s ran out before the first Step)
LEASE = 2.0
STALL = 0.5

#: the server process's ``sitecustomize``: its session reaper ends nothing
_NO_REAPER = """
from kvcoord.service import servicer_core

servicer_core.ServicerCore.reap_expired_sessions = lambda self: 0
"""


def _until_run_out(c: KVCoordClient, session_id: str) -> None:
    """Wait until the server counts ``session_id``'s lease run out (ListSessions: 0 s or
    less left, on its lease clock, which leaves out any gap of more than 0.5 s in which
    its process did not run: lease_clock.py). A fixed 1.5 leases of sleep fell short of
    that when the loaded server lost the CPU for a second: the Step then found a live
    session. The bound is on a hang only."""
    deadline = time.monotonic() + 120
    while True:
        left = [s.expires_in_seconds for s in c.list_sessions("p").sessions if s.session_id == session_id]
        assert left, "the session ended before its Step (nothing reaps here)"
        if left[0] < 0:
            return
        assert time.monotonic() < deadline, f"the lease never ran out: {left[0]} s left"
        time.sleep(0.05)


def test_a_step_told_session_expired_sees_no_session_after_a_kill(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable_server.with_sitecustomize(tmp_path, _NO_REAPER, monkeypatch)
    server = leased_server(tmp_path, LEASE, num_blocks=64, stall=STALL)
    server.start()
    try:
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            old = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=LEASE, exclusive=True)
            free = c.inspect_pool("p").num_free_blocks
            step_allocate(c, old, "r", 16)
            assert c.inspect_pool("p").num_free_blocks == free - 4  # (held while the session lives)
            _until_run_out(c, old.session_id)
            with pytest.raises(SessionExpiredError):
                step_allocate(c, old, "late", 4)
        server.kill()  # right after the answer
        server.start()
        with KVCoordClient(server.address, retry=NO_RETRY) as c:
            # (nothing reaps here either: only the journal can have ended the session)
            left = c.inspect_pool("p", all_requests=True)
            assert [r.request_id for r in left.requests] == [], "the expired session's requests came back"
            assert left.num_free_blocks == free
            new = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=LEASE, exclusive=True)
            assert new.exclusive and new.session_id != old.session_id
            step_allocate(c, new, "r", 16)
    finally:
        server.stop()
