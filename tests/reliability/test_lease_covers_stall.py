"""The shortest lease a durable server grants outlasts every stall it waits out.

A journal commit is waited for ``journal_stall_seconds`` and then once more at most
min(1 s, bound) (stalls.py) before the server stops; a worker trusts only 95 % of its
lease (kvcoord.wire.leases). Before, a lease just above the bound was granted: a commit
that stalled past the bound but inside the allowance (a stall the server tolerates)
answered the worker's Step after the part of its lease it trusts, and the worker gave up
its session and every request in it. Now the minimum is (bound + allowance) / 0.95: a
session on it, heartbeats running, keeps its session and every request over such a
stall, and a lease just below it is refused (INVALID_ARGUMENT naming the numbers).

Over a journal stall the worker's heartbeats are answered, and their unbroken lease
proof lets it trust the late Step answer (session.py): that case passes with the old
minimum too. A lease marker write on the event loop holds every call, heartbeats with
it: there the old minimum lost every request (the marker test).
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import durable_server
import pytest
from durable_server import DurableServer, held_first_group, leased_server
from kvcoord.client import NO_RETRY, KVCoordClient, RemoteKVCacheManager
from kvcoord.client.errors import InvalidArgumentError
from support import Req

STALL = 2.0
#: one journal commit's stall: past the bound, inside its allowance of min(1 s, bound)
DELAY = STALL + 0.3
LEASE = 30.0  # the default: the leases asked for below it are held to the rule

#: the server process's ``sitecustomize``: once FLAG exists, the next journal write
#: takes DELAY seconds (a disk that hiccups once), then the flag is gone
_SLOW_COMMIT = """
import os
import time

from kvcoord.service import journal

_real = journal.JournalStore.write


def _write(self, records, chunk=None):
    try:
        os.remove({flag!r})
    except FileNotFoundError:
        pass
    else:
        time.sleep({delay!r})
    return _real(self, records, chunk)


journal.JournalStore.write = _write
"""


def _server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hook: str, blocks: int, lease: float, stall: float
) -> DurableServer:
    """A durable server whose process runs ``hook`` (its ``sitecustomize``), of a pool of
    ``blocks`` blocks, granting leases up to ``lease`` s (its default too) and waiting out
    journal stalls of ``stall`` s."""
    durable_server.with_sitecustomize(tmp_path, hook, monkeypatch)
    return leased_server(tmp_path, lease, blocks, stall)


def _slow_commit_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flag: Path) -> DurableServer:
    hook = _SLOW_COMMIT.format(flag=str(flag), delay=DELAY)
    return _server(tmp_path, monkeypatch, hook, 64, LEASE, STALL)


def _kept_everything(
    server: DurableServer, c: KVCoordClient, m: RemoteKVCacheManager, got: dict[str, list[int]]
) -> None:
    """The worker ``m`` kept its session and every request: the server holds the blocks
    it was given (``got``), nothing lost or freed, and still runs; ``m`` closed."""
    assert m.keeper.lost is None, m.keeper.lost
    m.keeper.vouch()
    assert held_first_group(c) == got  # nothing lost, nothing freed
    assert server.proc is not None and server.proc.poll() is None, server.log()
    m.close()


def _attach(c: KVCoordClient, lease: float) -> Any:
    return c.attach("p", "sha256_cbor", 4, "0", "probe", lease_seconds=lease)


def _shortest_granted(c: KVCoordClient, stall: float = STALL) -> float:
    """The shortest lease the server grants below its default, as it tells: a lease just
    above the stall bound when it grants that, else a hair above the minimum its refusal
    names."""
    asked = stall + 0.05
    try:
        granted = _attach(c, asked)
    except InvalidArgumentError as refused:
        found = re.search(r"ask for more than ([0-9.]+) s", str(refused))
        assert found is not None, str(refused)
        return float(found[1]) + 0.01
    c.detach(granted.session_id, granted.fence)
    return asked


def test_a_session_on_the_shortest_lease_granted_keeps_its_requests_over_a_tolerated_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "slow"
    server = _slow_commit_server(tmp_path, monkeypatch, flag)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            lease = _shortest_granted(c)
            m = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="worker", lease_seconds=lease)
            assert m.keeper.lease == lease
            got: dict[str, list[int]] = {}
            for i in range(3):
                r = Req(f"r{i}", list(range(100 * i, 100 * i + 8)))
                if i == 1:
                    flag.touch()  # this allocation's commit stalls DELAY s: the server waits it out
                blocks = m.allocate_slots(r, 8)
                assert blocks is not None, r.request_id
                got[r.request_id] = list(blocks.get_block_ids()[0])
            assert not flag.exists()  # the stall happened (the hook removed its flag)
            _kept_everything(server, c, m, got)
        assert "stalled" not in server.log()
    finally:
        server.stop()


def test_a_lease_just_below_the_minimum_is_refused_naming_the_numbers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = _slow_commit_server(tmp_path, monkeypatch, tmp_path / "never")
    server.start()
    try:
        with KVCoordClient(server.address, timeout=30.0, retry=NO_RETRY) as c:
            minimum = (STALL + min(1.0, STALL)) / 0.95  # 3.158 s
            for asked in (STALL + 0.05, minimum - 0.01):
                with pytest.raises(InvalidArgumentError) as refused:
                    _attach(c, asked)
                message = str(refused.value)
                for part in (f"lease_seconds {asked:g}", "journal_stall_seconds (2 s) + 1 s = 3 s", "95%",
                             "ask for more than 3.158 s"):  # fmt: skip
                    assert part in message, message
            assert _attach(c, minimum + 0.01).lease_seconds == pytest.approx(minimum + 0.01)
    finally:
        server.stop()


#: marker test: the server's default (and longest) lease, its stall bound, and the one
#: slow write of the lease marker (past the bound, inside its allowance of min(1 s, bound))
MARKER_LEASE, MARKER_STALL = 4.0, 1.5
MARKER_DELAY = MARKER_STALL + 0.3

#: the server process's ``sitecustomize``: once FAIL exists, the next lease marker write
#: fails (its thread's, which only warns); once SLOW exists, the next one (the write a
#: renewal past the bound on disk waits for, on the event loop) takes DELAY seconds
_SLOW_MARKER = """
import errno
import os
import time

from kvcoord.service import lease_marker

_real = lease_marker.write_synced


def _taken(flag):
    try:
        os.remove(flag)
    except FileNotFoundError:
        return False
    return True


def _write(path, text):
    if _taken({fail!r}):
        raise OSError(errno.EIO, "injected: the marker thread's write fails")
    if _taken({slow!r}):
        time.sleep({delay!r})
    return _real(path, text)


lease_marker.write_synced = _write
"""


def test_the_shortest_lease_granted_keeps_its_requests_over_a_tolerated_lease_marker_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lease marker's write on the event loop (the bound on disk reached: its
    thread's write failed) takes the stall bound + 0.3 s, which the server waits out;
    every call, heartbeats too, waits with it. A worker on the shortest lease granted
    must keep its session and every request: before, a lease just above the bound
    (1.55 s for 1.5 s: 1.47 s trusted) was granted and outlived by the wait."""
    fail, slow = tmp_path / "fail", tmp_path / "slow"
    hook = _SLOW_MARKER.format(fail=str(fail), slow=str(slow), delay=MARKER_DELAY)
    server = _server(tmp_path, monkeypatch, hook, 256, MARKER_LEASE, MARKER_STALL)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=30.0) as c:
            lease = _shortest_granted(c, MARKER_STALL)
            m = RemoteKVCacheManager(c, "p", hash_seed="0", client_name="worker", lease_seconds=lease)
            fail.touch()
            slow.touch()
            got: dict[str, list[int]] = {}
            after: int | None = None  # the allocation made once the slow write was done
            for i in range(200):  # every 50 ms, until 20 after the slow write (~5 s)
                r = Req(f"r{i}", [i, i + 1, i + 2, i + 3])
                blocks = m.allocate_slots(r, 4)
                assert blocks is not None, r.request_id
                got[r.request_id] = list(blocks.get_block_ids()[0])
                if after is None and not slow.exists():
                    after = i
                if after is not None and i >= after + 20:
                    break
                time.sleep(0.05)
            assert not fail.exists() and not slow.exists(), "the marker's writes were not made"
            _kept_everything(server, c, m, got)
        assert "stalled" not in server.log()
    finally:
        server.stop()
