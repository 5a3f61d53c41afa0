"""A start whose grace.json names a restore generation more than one past its journal's.

grace.json names the restore generation a proven restore's fencing begins; a start whose
journal has not reached it (killed before the fencing committed) fences before it
answers (startup.py, ``unfenced_restore``). A journal two or more generations short of
it (the journal put back from an older copy while grace.json stayed, or a copy whose
grace.json was taken after its journal) was fenced once per start, one generation at a
time: each restart inside the grace fenced again and began a new full grace, until the
journal reached grace.json's generation. One fencing ends every session and fence there
is and empties every cache: the start that fences now begins grace.json's generation at
once, and the next start finds nothing to fence.

Real server process, real files: two restores declared with ``kvcoord serve --restored``
(generations 1 and 2), then the journal of a copy taken before them put back beside
that grace.json (with the copy's ``journal.progress``, or alone: the start then finds
the journal behind its progress file and fences as it opens, as it did, but a second
time right after, by grace.json's generation); SIGKILL restarts.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

from durable_server import attach, leased_server, refused_for_grace, step_allocate
from kvcoord.client import KVCoordClient

LEASE = 30.0
#: what journal_behind logs when it fences
FENCED = "the journal is behind what clients were told"


def _two_restores_after_a_copy(server: Any, copy: Path) -> str:
    """One worker's allocation, a copy of the stopped server's data directory, then two
    restores declared (``--restored``: generations 1, then 2); grace.json's text."""
    server.start()
    with KVCoordClient(server.address) as c:
        a = attach(c, "worker-a", LEASE)
        step_allocate(c, a, "a1", 8)
    server.stop()
    subprocess.run(["cp", "-a", str(server.data_dir), str(copy)], check=True)
    for _ in range(2):
        server.start(args=("--restored",))
        assert FENCED in server.log()
        server.kill()
    grace = (server.data_dir / "grace.json").read_text()
    assert '"restore_generation": 2' in grace, grace
    return grace


def test_a_journal_two_generations_short_of_the_grace_is_fenced_once(tmp_path: Path) -> None:
    server = leased_server(tmp_path, LEASE, 64)
    copy = tmp_path / "copy"
    try:
        grace = _two_restores_after_a_copy(server, copy)
        # the journal put back from the copy (generation 0), grace.json left as it is
        shutil.rmtree(server.data_dir)
        subprocess.run(["cp", "-a", str(copy), str(server.data_dir)], check=True)
        (server.data_dir / "grace.json").write_text(grace)
        fenced = []
        for _ in range(3):
            server.start()
            fenced.append(FENCED in server.log())
            assert refused_for_grace(server.address, LEASE)  # the grace runs throughout
            server.kill()
        assert fenced == [True, False, False], fenced  # (was [True, True, False])
        server.start()
        with KVCoordClient(server.address) as c:  # the copy's session ended with the fencing
            assert not c.list_sessions("p").sessions
            assert not c.inspect_pool("p", all_requests=True).requests
    finally:
        server.stop()


def test_a_journal_put_back_alone_is_fenced_once_at_start(tmp_path: Path) -> None:
    """The same grace.json, and the journal file alone put back from the copy (its
    ``journal.progress`` left: the start finds the journal behind it and fences as it
    opens). That fencing begins grace.json's generation: the start fences nothing more
    (was: a second fencing right after, grace.json's generation not reached), nor does
    the next one."""
    server = leased_server(tmp_path, LEASE, 64)
    copy = tmp_path / "copy"
    try:
        _two_restores_after_a_copy(server, copy)
        for stale in server.data_dir.glob("journal.sqlite*"):
            stale.unlink()
        for old in copy.glob("journal.sqlite*"):
            shutil.copy2(old, server.data_dir / old.name)
        server.start()
        log = server.log()
        assert "may be behind what clients were told" in log, log  # found as the journal opened
        assert FENCED not in log, log  # (was: fenced again at once, by grace.json's generation)
        server.kill()
        server.start()
        assert "behind what clients were told" not in server.log()
        assert refused_for_grace(server.address, LEASE)
    finally:
        server.stop()
