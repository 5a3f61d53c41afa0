"""Journal's bound on a commit (stall_seconds): a commit that returns in time changes
nothing; one that does not fails the journal and every waiter, leaving its writer
thread behind (closing does not wait for it)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from kvcoord.service.journal import JournalError, JournalStore
from kvcoord.service.journal_writer import Journal, JournalStalledError


class _HeldStore(JournalStore):
    """Writes block while ``hold`` is set (bounded: released by the test at its end)."""

    def __init__(self, data_dir: Path) -> None:
        super().__init__(data_dir, "OFF")
        self.hold = threading.Event()
        self.release = threading.Event()

    def write(self, records: Any, chunk: Any = None) -> None:
        if self.hold.is_set():
            self.release.wait(30)
        super().write(records, chunk)


def test_a_commit_in_time_changes_nothing(tmp_path: Path) -> None:
    async def go() -> None:
        journal = Journal(_HeldStore(tmp_path), 0)
        journal.stall_seconds = 30.0
        failures: list[BaseException] = []
        journal.on_failure.append(failures.append)
        for i in range(50):
            journal.append(b"r%d" % i)
            await journal.flush()
        assert journal.committed == 50 and journal.failed is None and not journal.hung and not failures
        await journal.close()

    asyncio.run(go())


def test_a_commit_that_does_not_return_fails_every_waiter(tmp_path: Path) -> None:
    async def go() -> None:
        store = _HeldStore(tmp_path)
        journal = Journal(store, 0)
        journal.stall_seconds = 0.2
        failures: list[BaseException] = []
        journal.on_failure.append(failures.append)
        journal.append(b"acked")
        await journal.flush()
        store.hold.set()
        journal.append(b"held")
        first = asyncio.ensure_future(journal.flush())
        await asyncio.sleep(0)
        journal.append(b"queued")  # waits behind the held commit
        second = asyncio.ensure_future(journal.flush())
        for waiter in (first, second):
            with pytest.raises(JournalError, match="has not returned after 0.2 s"):
                await asyncio.wait_for(waiter, 30)
        assert journal.hung and len(failures) == 1 and isinstance(failures[0], JournalStalledError)
        assert journal.committed == 1
        with pytest.raises(JournalError):
            await journal.flush()
        await journal.close()  # does not wait for the held writer
        store.release.set()

    asyncio.run(go())


def test_a_commit_that_returns_just_after_the_bound_is_no_stall(tmp_path: Path) -> None:
    """A process paused past the bound (SIGSTOP, a paused VM) finds its timer due and its
    writer's commit done together when it runs again: the commit that ends right after
    the bound is taken, not called a stall (the writer is released here just after it)."""

    async def go() -> None:
        store = _HeldStore(tmp_path)
        journal = Journal(store, 0)
        journal.stall_seconds = 0.5
        failures: list[BaseException] = []
        journal.on_failure.append(failures.append)
        store.hold.set()
        journal.append(b"late")
        asyncio.get_running_loop().call_later(0.55, store.release.set)
        await asyncio.wait_for(journal.flush(), 30)
        assert journal.committed == 1 and journal.failed is None and not journal.hung and not failures
        await journal.close()

    asyncio.run(go())
