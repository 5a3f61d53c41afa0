"""The journal: an append-only sequence of records and snapshots in one SQLite file.

Storage (``<data_dir>/journal.sqlite``, WAL mode):

* ``meta``: the format version (a journal of another version is refused, never
  read as empty), the journal's random id (``journal_id``, added on first open by
  kvcoord versions that write the progress file below) and its fence key
  (``fence_key``: 32 random bytes, hex, added on first open by kvcoord versions that
  tag the journal positions they tell clients, positions.py). The key is committed
  before any record that a tag made with it could name (SQLite keeps commits in
  order), and a copy of the file carries it: tags of a restored journal's lost history
  still verify.
* ``records``: ``(seq, crc, body)``; ``body`` is opaque bytes (``durability.py``
  encodes them), ``crc`` its CRC-32, checked on every read.
* ``snapshots``: ``(seq, fingerprint, sha256, body)``: the whole state after record
  ``seq``; ``body`` is empty and the state is in ``snapshot_parts`` ``(seq, part,
  body)``, chunks of :data:`~.journal_writer.SNAPSHOT_CHUNK_BYTES` (far below SQLite's 1 GB value
  limit), each written in its own transaction between record commits. The row is
  written with the last chunk, in the transaction that deletes the records and
  snapshots it covers, so the file holds one complete snapshot plus the records after
  it (and maybe the chunks of a snapshot a crash interrupted, deleted on open).

Disk use stays bounded: the file is in incremental auto-vacuum mode, so after a
snapshot the pages of the deleted records are given back a slice at a time, then the
WAL is checkpointed and truncated (``journal_size_limit`` caps what it keeps), all on
the writer thread between commits, never on the event loop.

Beside it, ``journal.progress`` names the journal and its last committed record,
rewritten in place after every commit (not synced: it may lag the journal after a
power loss, never lead it). A start that finds the journal behind it (a backup of
it restored, or commits lost) or finds a journal that wrote one without it (a
backup restored into another directory) knows clients may have been told more than
the journal holds: :attr:`JournalStore.behind` says why (recovery.py fences them).

Every commit is one SQLite transaction, so a crash leaves a prefix of the committed
transactions: SQLite's WAL frames carry checksums and a transaction whose commit
frame is missing or damaged (a torn tail) is dropped on open. Damage SQLite cannot
see (a record or snapshot whose own checksum fails) stops recovery with a message
naming the file, never a silent empty start.

:class:`~.journal_writer.Journal` adds group commit on an asyncio loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import secrets
import sqlite3
import zlib
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "FORMAT_VERSION",
    "JournalError",
    "JournalStore",
    "SnapshotChunk",
    "StoredSnapshot",
]

#: Bump when the meaning of records or snapshots changes; older files are refused.
FORMAT_VERSION = 2
#: pages incremental vacuum gives back per step (one step after each commit)
VACUUM_PAGES_PER_STEP = 512
#: bytes of WAL kept after a checkpoint
WAL_SIZE_LIMIT = 64 << 20
FILE_NAME = "journal.sqlite"
PROGRESS_FILE_NAME = "journal.progress"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS records (seq INTEGER PRIMARY KEY, crc INTEGER NOT NULL, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (
    seq INTEGER PRIMARY KEY, fingerprint TEXT NOT NULL, sha256 BLOB NOT NULL, body BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS snapshot_parts (
    seq INTEGER NOT NULL, part INTEGER NOT NULL, body BLOB NOT NULL, PRIMARY KEY (seq, part)
);
"""


class JournalError(RuntimeError):
    """The journal cannot be used (wrong version, damage, I/O); the message names the file."""


@dataclasses.dataclass(frozen=True, slots=True)
class StoredSnapshot:
    seq: int
    fingerprint: str
    body: bytes


@dataclasses.dataclass(slots=True)
class SnapshotChunk:
    """One chunk of a snapshot being written; ``last`` carries the row that completes
    it: ``(fingerprint, sha256 of the whole)``."""

    seq: int
    part: int
    body: bytes
    last: tuple[str, bytes] | None = None


class JournalStore:
    """The SQLite file. Not thread-safe: one thread at a time (recovery, then the
    journal's writer thread).

    Args:
        data_dir: the directory (created if missing).
        synchronous: FULL, NORMAL or OFF (SQLite's ``synchronous`` in WAL mode).

    Raises:
        JournalError: the file is not a kvcoord journal of this format version.
    """

    def __init__(self, data_dir: str | Path, synchronous: str = "FULL") -> None:
        self.path = Path(data_dir).resolve() / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            # before any table exists (a new file); an older file is converted below
            self.db.execute("PRAGMA auto_vacuum=INCREMENTAL")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={synchronous.upper()}")
            self.db.execute(f"PRAGMA journal_size_limit={WAL_SIZE_LIMIT}")
            self.db.executescript(_SCHEMA)
            version = self._meta("format_version")
            if version is None:
                self.db.execute("INSERT INTO meta VALUES ('format_version', ?)", (str(FORMAT_VERSION),))
            elif version != str(FORMAT_VERSION):
                raise JournalError(
                    f"journal {self.path} has format version {version}, this kvcoord reads version "
                    f"{FORMAT_VERSION}: start the kvcoord version that wrote it, or move the data "
                    "directory away to start empty"
                )
            journal_id = self._meta("journal_id")
            wrote_progress = journal_id is not None
            if journal_id is None:
                journal_id = secrets.token_hex(8)
                self.db.execute("INSERT INTO meta VALUES ('journal_id', ?)", (journal_id,))
            self.journal_id = journal_id
            fence_key = self._meta("fence_key")
            if fence_key is None:
                fence_key = secrets.token_hex(32)
                self.db.execute("INSERT INTO meta VALUES ('fence_key', ?)", (fence_key,))
            try:
                #: the key of the tags of the journal positions clients are told (positions.py)
                self.fence_key = bytes.fromhex(fence_key)
            except ValueError:
                raise JournalError(f"journal {self.path}: its fence_key is damaged (not hex)") from None
            last = self.last_seq()
            if self.db.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:
                self.db.execute("VACUUM")  # a file made without auto-vacuum: once, at start
            # chunks of a snapshot a crash interrupted
            self.db.execute("DELETE FROM snapshot_parts WHERE seq NOT IN (SELECT seq FROM snapshots)")
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"journal {self.path} cannot be opened: {exc}") from None
        self.progress_path = self.path.with_name(PROGRESS_FILE_NAME)
        self._progress_fd: int | None = None
        #: why clients may have been told more than this journal holds ("" when not)
        self.behind = self._behind(last, wrote_progress) if last > 0 else ""
        if last == 0:
            self.write_progress(0)

    def _behind(self, last: int, wrote_progress: bool) -> str:
        try:
            text = self.progress_path.read_text(encoding="ascii")
        except FileNotFoundError:
            if not wrote_progress:  # written by a kvcoord without progress files: no evidence
                return ""
            return (
                f"{self.progress_path} is missing: this journal was moved or restored from a backup "
                "into a directory it did not run in"
            )
        except (OSError, ValueError) as exc:
            return f"{self.progress_path} cannot be read ({exc})"
        fields = text.split()
        if len(fields) != 2 or not fields[1].isdigit():
            return f"{self.progress_path} is malformed"
        if fields[0] != self.journal_id:
            return f"{self.progress_path} names another journal ({fields[0][:40]!r}, this is {self.journal_id!r})"
        committed = int(fields[1])
        if committed > last:
            return (
                f"the journal ends at record {last} but record {committed} was committed: it was restored "
                "from an older backup, or lost commits"
            )
        return ""

    def write_progress(self, seq: int) -> None:
        """Record that everything up to ``seq`` is committed (in place, fixed width)."""
        line = f"{self.journal_id} {seq:020d}\n".encode("ascii")
        if self._progress_fd is None:
            self._progress_fd = os.open(self.progress_path, os.O_WRONLY | os.O_CREAT, 0o644)
            os.ftruncate(self._progress_fd, len(line))
        os.pwrite(self._progress_fd, line, 0)

    def _meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def close(self) -> None:
        self.db.close()
        if self._progress_fd is not None:
            os.close(self._progress_fd)
            self._progress_fd = None

    # -- reading (recovery) ----------------------------------------------------------------
    def snapshot(self) -> StoredSnapshot | None:
        """The latest snapshot, checksum verified.

        Raises:
            JournalError: the snapshot is damaged.
        """
        try:
            row = self.db.execute(
                "SELECT seq, fingerprint, sha256, body FROM snapshots ORDER BY seq DESC LIMIT 1"
            ).fetchone()
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"journal {self.path}: cannot read the snapshot: {exc}") from None
        if row is None:
            return None
        seq, fingerprint, digest, body = row
        if not body:
            try:
                parts = self.db.execute(
                    "SELECT body FROM snapshot_parts WHERE seq = ? ORDER BY part", (seq,)
                ).fetchall()
            except sqlite3.DatabaseError as exc:
                raise JournalError(f"journal {self.path}: cannot read the snapshot: {exc}") from None
            body = b"".join(p[0] for p in parts)
        if hashlib.sha256(body).digest() != digest:
            raise JournalError(
                f"journal {self.path}: the snapshot after record {seq} is corrupt (checksum mismatch); "
                "restore the data directory from a backup"
            )
        return StoredSnapshot(int(seq), str(fingerprint), bytes(body))

    def records(self, after: int) -> Iterator[tuple[int, bytes]]:
        """Records with ``seq > after``, in order, checksums verified.

        Raises:
            JournalError: a damaged record or a gap in the sequence.
        """
        expected = after + 1
        try:
            cursor = self.db.execute(
                "SELECT seq, crc, body FROM records WHERE seq > ? ORDER BY seq", (after,)
            )
            for seq, crc, body in cursor:
                if seq != expected:
                    raise JournalError(
                        f"journal {self.path}: record {expected} is missing (next is {seq}); "
                        "restore the data directory from a backup"
                    )
                if zlib.crc32(body) != crc:
                    raise JournalError(
                        f"journal {self.path}: record {seq} is corrupt (checksum mismatch); "
                        "restore the data directory from a backup"
                    )
                expected += 1
                yield int(seq), bytes(body)
        except sqlite3.DatabaseError as exc:
            raise JournalError(f"journal {self.path}: cannot read records: {exc}") from None

    def last_record(self) -> bytes | None:
        """The body of the last record (unverified), or None without records."""
        try:
            row = self.db.execute("SELECT body FROM records ORDER BY seq DESC LIMIT 1").fetchone()
        except sqlite3.DatabaseError:
            return None
        return None if row is None else bytes(row[0])

    def last_seq(self) -> int:
        row = self.db.execute(
            "SELECT max(coalesce((SELECT max(seq) FROM records), 0), coalesce((SELECT max(seq) FROM snapshots), 0))"
        ).fetchone()
        return int(row[0])

    # -- writing -----------------------------------------------------------------------------
    def write(self, records: list[tuple[int, bytes]], chunk: SnapshotChunk | None = None) -> None:
        """Commit ``records`` (and a snapshot chunk, if given) in one transaction. A
        chunk marked ``last`` completes its snapshot: the records and snapshots it
        covers are deleted in the same transaction."""
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany(
                "INSERT INTO records VALUES (?, ?, ?)",
                [(seq, zlib.crc32(body), body) for seq, body in records],
            )
            if chunk is not None:
                seq = chunk.seq
                db.execute(
                    "INSERT OR REPLACE INTO snapshot_parts VALUES (?, ?, ?)", (seq, chunk.part, chunk.body)
                )
                if chunk.last is not None:
                    fingerprint, digest = chunk.last
                    db.execute("INSERT INTO snapshots VALUES (?, ?, ?, ?)", (seq, fingerprint, digest, b""))
                    db.execute("DELETE FROM records WHERE seq <= ?", (seq,))
                    db.execute("DELETE FROM snapshots WHERE seq < ?", (seq,))
                    db.execute("DELETE FROM snapshot_parts WHERE seq != ?", (seq,))
        except BaseException:
            db.execute("ROLLBACK")
            raise
        db.execute("COMMIT")
        if records:
            self.write_progress(records[-1][0])

    def compact_step(self) -> bool:
        """Give back up to :data:`VACUUM_PAGES_PER_STEP` free pages; once none are left,
        checkpoint and truncate the WAL. Returns True while there is more to do."""
        db = self.db
        free = int(db.execute("PRAGMA freelist_count").fetchone()[0])
        if free:
            db.execute(f"PRAGMA incremental_vacuum({VACUUM_PAGES_PER_STEP})").fetchall()
            left = int(db.execute("PRAGMA freelist_count").fetchone()[0])
            if left and left < free:  # more next time (no progress: not in auto-vacuum mode)
                return True
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        return False
