"""Start-up decisions on the data directory: can it be written, is the journal lost,
and is a grace period of an earlier instance still running.

Three rules, each checked before the journal is opened (``server.py``):

* The data directory must be writable: a server that promises durability and cannot
  keep it refuses to start (:class:`DataDirError`, exit 3) rather than run without it.
* A journal that is missing (or empty) while ``journal.progress`` names committed
  records was lost: clients hold blocks it gave them. The server refuses to start
  (:class:`JournalLostError`, exit 5) naming the loss and the ways out, and leaves the
  progress file alone. ``kvcoord serve --start-empty`` accepts the loss: the evidence
  is moved aside (``journal.progress.lost-<time>``), the server starts empty and
  applies a full grace period (``max_session_lease_seconds``).
* A grace period, once applied (a restore, a lost journal, leases of a previous
  instance), is written to ``grace.json`` before the server answers anything, so a
  restart inside it (a crash loop, an OOM kill) applies what is left of it again
  instead of recovering its own new journal "normally" and dropping it. A restore
  proven while serving also names there the restore generation its fencing begins: a
  restart whose journal never reached it (killed before the fencing committed) fences
  again before answering (:meth:`StartupDecision.unfenced_restore`).

Deadlines that must survive a restart (this grace, the lease marker) are recorded on
both clocks: the wall clock and the monotonic clock with the kernel's boot id. A
restart on the same boot counts on the monotonic clock (a wall clock set forward or
back in between changes nothing); after a reboot only the wall clock is left.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from .deadlines import DurableDeadline, boot_id, write_synced
from .errors import ServiceError, Status
from .journal import FILE_NAME, PROGRESS_FILE_NAME

if TYPE_CHECKING:  # pragma: no cover
    from .config import ServerConfig
    from .lease_marker import LeaseMarker
    from .sessions import Session

__all__ = [
    "GRACE_FILE",
    "DataDirError",
    "DurableDeadline",
    "JournalLostError",
    "boot_id",
    "check_data_dir",
    "check_journal_not_lost",
    "decide_startup",
    "set_lost_journal_aside",
]

logger = logging.getLogger(__name__)

GRACE_FILE = "grace.json"


class DataDirError(RuntimeError):
    """The data directory cannot be created or written; the message names it."""


class JournalLostError(RuntimeError):
    """The journal is gone while evidence of committed records exists."""


class GraceFile:
    """``grace.json``: the end of the grace period this data directory is in, and why."""

    def __init__(self, data_dir: str | Path, deadline: DurableDeadline) -> None:
        self.path = Path(data_dir) / GRACE_FILE
        self.deadline = deadline

    def remaining(self) -> tuple[float, str]:
        """(seconds left, reason); (0.0, "") without a running grace.

        Raises:
            DataDirError: the file exists but cannot be read (names it).
        """
        left, reason, _ = self.read()
        return left, reason

    def read(self) -> tuple[float, str, int]:
        """(seconds left, reason, restore generation): :meth:`remaining`, and the
        restore generation a proof of a restore begins (0: none named; see
        :meth:`StartupDecision.unfenced_restore`); (0.0, "", 0) without a running grace.

        Raises:
            DataDirError: the file exists but cannot be read (names it).
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return 0.0, "", 0
        except OSError as exc:
            raise DataDirError(f"cannot read {self.path}: {exc}") from None
        try:
            data = json.loads(text)
            left = self.deadline.remaining(data)
            reason = str(data.get("reason", ""))
            generation = int(data.get("restore_generation", 0))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise DataDirError(
                f"{self.path} is malformed ({exc}); if no worker of an earlier instance can still "
                "hold blocks, delete it"
            ) from None
        return (left, reason, generation) if left > 0 else (0.0, "", 0)

    def record(self, seconds: float, reason: str, generation: int = 0) -> None:
        """Persist a grace of ``seconds`` from now (synced before the server answers);
        ``generation``: the restore generation a proven restore begins (0: none)."""
        fields = {**self.deadline.fields(seconds), "reason": reason}
        if generation:
            fields["restore_generation"] = generation
        write_synced(self.path, json.dumps(fields))


def check_data_dir(data_dir: str | Path) -> Path:
    """Create ``data_dir`` if needed and prove a file can be written and synced in it.

    Raises:
        DataDirError: naming the directory and the error.
    """
    path = Path(data_dir)
    probe = path / ".kvcoord-write-check"
    try:
        path.mkdir(parents=True, exist_ok=True)
        write_synced(probe, "ok\n")
        probe.unlink()
    except OSError as exc:
        raise DataDirError(
            f"data directory {path} cannot be written ({exc}); fix its permissions or free space, set "
            "server.data_dir (or KVCOORD_DATA_DIR) to a writable directory, or set durability = "
            '"none" to keep nothing across restarts'
        ) from None
    return path


def _committed_in_progress(progress: Path) -> int:
    """The committed record ``journal.progress`` names (0 when absent or unreadable:
    JournalStore reports a malformed one itself)."""
    try:
        fields = progress.read_text(encoding="ascii").split()
    except (OSError, ValueError):
        return 0
    if len(fields) != 2 or not fields[1].isdigit():
        return 0
    return int(fields[1])


def _journal_holds_records(journal: Path) -> bool:
    """True when ``journal`` holds a record or a snapshot (read-only look). A file that
    is not a readable journal counts as holding some: JournalStore names its damage."""
    if not journal.exists():
        return False
    try:
        db = sqlite3.connect(journal)
        try:
            row = db.execute(
                "SELECT (SELECT count(*) FROM records) + (SELECT count(*) FROM snapshots)"
            ).fetchone()
        finally:
            db.close()
    except sqlite3.DatabaseError as exc:
        return "no such table" not in str(exc)
    return bool(row and row[0])


def check_journal_not_lost(
    data_dir: str | Path, start_empty: bool, wall: Callable[[], float] = time.time
) -> str:
    """Refuse a journal lost while ``journal.progress`` names committed records.

    Returns:
        "" when nothing was lost; with ``start_empty``, the loss that was accepted (the
        caller applies a full grace period, writes it, and only then moves the evidence
        aside: :func:`set_lost_journal_aside`).

    Raises:
        JournalLostError: the journal is missing or empty (names the files and the ways out).
    """
    path = Path(data_dir)
    progress = path / PROGRESS_FILE_NAME
    committed = _committed_in_progress(progress)
    journal = path / FILE_NAME
    if committed == 0 or _journal_holds_records(journal):
        return ""
    state = "missing" if not journal.exists() else "empty"
    loss = f"journal {journal} is {state} but {progress} says record {committed} was committed"
    if not start_empty:
        raise JournalLostError(
            f"{loss}: the journal was lost, and workers may still hold blocks it gave them. Either "
            f"restore the whole data directory {path} from a backup (deploy/README.md, 'Restore'), or "
            "accept the loss: start once with `kvcoord serve --start-empty` (every worker is told its "
            "requests are lost, and no block is handed out until their leases have ended). "
            f"{progress} is left as it is"
        )
    return loss


def set_lost_journal_aside(data_dir: str | Path, loss: str, wall: Callable[[], float] = time.time) -> None:
    """Move a lost journal's evidence aside (``*.lost-<time>``), once its grace is
    written: were the grace never written, the next start must still find the loss."""
    path = Path(data_dir)
    stamp = int(wall())
    for name in (PROGRESS_FILE_NAME, FILE_NAME, FILE_NAME + "-wal", FILE_NAME + "-shm"):
        p = path / name
        if p.exists():
            p.rename(path / f"{name}.lost-{stamp}")
    logger.warning("%s: starting empty as asked (--start-empty); the old files end in .lost-%d", loss, stamp)


class StartupDecision:
    """What :func:`decide_startup` found, and the grace it implies (monotonic times).

    ``server.py`` calls :meth:`restored` or :meth:`recovered` once the journal is
    open, then :meth:`persist` before serving, and hands every granted or renewed
    lease to :meth:`cover_lease`.
    """

    def __init__(self, clock: Callable[[], float], max_lease: float, grace_until: float) -> None:
        self.clock = clock
        self.max_lease = max_lease
        self.grace_until = grace_until
        #: why the grace applies ("" when none does)
        self.reason = ""
        self.marker: LeaseMarker | None = None
        self.grace_file: GraceFile | None = None
        #: the grace an earlier instance recorded and did not see to its end
        self.carried_until = 0.0
        self.carried_reason = ""
        #: the restore generation a proven restore begins, once its grace is written
        #: (grace.json keeps it: :meth:`unfenced_restore`); 0: none
        self.restore_generation = 0
        #: called once when the lease marker cannot be written (the server stops serving)
        self.on_marker_failure: Callable[[BaseException], None] | None = None
        self.marker_failed: BaseException | None = None

    def extend(self, until: float, reason: str) -> None:
        if until > self.grace_until:
            self.grace_until = until
            self.reason = reason

    def restored(self, why: str) -> float:
        """The journal is behind what clients were told: any lease of the lost history
        may still run, for ``max_lease`` from now at most, whatever a lease marker found
        says (it may be as old as the journal: restored with it, a copy of the whole
        directory's files, and then it knows nothing of the leases the lost history
        granted); longer when the marker says so."""
        self.extend(self.clock() + self.max_lease, f"journal behind what clients were told ({why})")
        if not self.reason:
            self.reason = f"journal behind what clients were told ({why})"
        return self.grace_until

    def recovered(self) -> float:
        """The journal was recovered whole: only a grace an earlier instance recorded
        (and that has not ended) still applies."""
        self.grace_until, self.reason = 0.0, ""
        self.extend(self.carried_until, self.carried_reason)
        return self.grace_until

    def persist(self, grace_until: float) -> None:
        """Record the grace (if any) so a restart inside it applies the rest."""
        left = grace_until - self.clock()
        if self.grace_file is not None and left > 0:
            self.grace_file.record(
                left, self.reason or "leases of an earlier instance", self.restore_generation
            )

    def restored_at_start(self, why: str) -> None:
        """A restore found as the journal opens (recovery.py's ``before_fencing``): its
        grace made durable before the fencing's first record.

        Raises:
            DataDirError: grace.json cannot be written (a full disk, an I/O error; names
                the file): the start is refused with nothing fenced or journaled, so the
                journal still looks behind and the next start finds the restore again.
        """
        self.persist_at_start(
            self.restored(why),
            f"a restore was found ({why}) but its grace period",
            "nothing is fenced and the server does not start",
            "(the restore is found again)",
        )

    def persist_at_start(
        self,
        grace_until: float,
        what: str = "a grace period",
        so: str = "the server does not start",
        then: str = "(the grace is found again)",
    ) -> None:
        """:meth:`persist` before the first answer.

        Raises:
            DataDirError: grace.json cannot be written (names the file): exit 3, not a
                traceback; nothing the next start needs to find the grace is changed.
        """
        try:
            self.persist(grace_until)
        except OSError as exc:
            assert self.grace_file is not None
            raise DataDirError(
                f"{what} cannot be written to {self.grace_file.path} ({exc}): {so}; free space or "
                f"fix the data directory, then start again {then}"
            ) from None

    def begin_grace(self, reason: str, generation: int = 0) -> float:
        """A grace of ``max_session_lease_seconds`` from now (a restore detected while
        serving), persisted at once with ``generation``, the restore generation its
        fencing begins (:meth:`unfenced_restore`); returns its end (monotonic)."""
        self.extend(self.clock() + self.max_lease, reason)
        self.restore_generation = max(self.restore_generation, generation)
        self.persist(self.grace_until)
        return self.grace_until

    def unfenced_restore(self, generation: int) -> bool:
        """True when the grace an earlier instance recorded (still running) is a proven
        restore's whose fencing the journal, at restore generation ``generation``, does
        not hold: that instance was killed after grace.json was written and before the
        fencing's records were committed (the grace is written first: journal_behind.py).
        The journal then holds the copy's sessions and fences alive, and nothing it
        holds can tell; the caller fences them before answering anything, as
        ``--restored`` does. (Before, the restart refused attaches for the grace but
        served the copy's sessions: a worker whose fence proves nothing was handed
        blocks a worker of the lost history held under a running lease.)"""
        return self.carried_until > self.clock() and self.restore_generation > generation

    def cover_lease(self, s: Session) -> None:
        """The session table's ``on_lease``: the lease marker covers ``s``'s lease.

        Raises:
            ServiceError: UNAVAILABLE when the marker cannot be written: the lease is not
                granted, and the server stops serving (as after a failed journal write).
        """
        assert self.marker is not None
        try:
            self.marker.cover(s.lease_seconds)
        except OSError as exc:
            if self.marker_failed is None:
                self.marker_failed = exc
                if self.on_marker_failure is not None:
                    self.on_marker_failure(exc)
            raise ServiceError(
                Status.UNAVAILABLE,
                f"{exc}: this server cannot record when its leases end, so it grants none and stops "
                "(it exits with status 4 for its supervisor to restart it once space is freed)",
            ) from None


def decide_startup(
    cfg: ServerConfig,
    clock: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
    start_empty: bool = False,
) -> StartupDecision:
    """Check the data directory and work out the grace period before the journal opens.

    Raises:
        DataDirError: the directory cannot be written, or grace.json cannot be read (or,
            with --start-empty, written).
        JournalLostError: see :func:`check_journal_not_lost`.
        MarkerError: the lease marker cannot be read.
    """
    from .lease_marker import LeaseMarker

    st = cfg.server
    decision = StartupDecision(clock, st.max_session_lease_seconds, clock() + st.startup_grace_seconds)
    if st.startup_grace_seconds > 0:
        decision.reason = "server.startup_grace_seconds"
    if not st.data_dir:
        return decision
    check_data_dir(st.data_dir)
    deadline = DurableDeadline(wall, clock)
    lost = check_journal_not_lost(st.data_dir, start_empty, wall) if st.journaled else ""
    marker = LeaseMarker(st.data_dir, st.max_session_lease_seconds, wall, clock)
    previous = marker.previous_leases_remaining()
    decision.marker = marker
    if previous is not None and previous > 0:
        decision.extend(clock() + previous, "leases of the previous instance (lease marker)")
    if lost:  # at least a full lease; the reason names the loss, whichever bound is later
        decision.extend(clock() + st.max_session_lease_seconds, "")
        decision.reason = f"started empty after a lost journal: {lost}"
    decision.grace_file = GraceFile(st.data_dir, deadline)
    carried, why, generation = decision.grace_file.read()
    if carried > 0:
        decision.carried_until, decision.carried_reason = clock() + carried, why
        decision.restore_generation = generation
        decision.extend(decision.carried_until, why)
    if lost:  # the grace durable before the evidence of the loss goes
        decision.persist_at_start(
            decision.grace_until,
            f"the journal was lost ({lost}) and the grace period of --start-empty",
            "nothing is moved aside and the server does not start",
            "with --start-empty",
        )
        set_lost_journal_aside(st.data_dir, lost, wall)
    return decision
