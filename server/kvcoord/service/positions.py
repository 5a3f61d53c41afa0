"""Journal positions in fences: clients prove what they were told.

Every answer's fence carries the journal position it is durable at
(``Fence.position``: the last committed record when it left). A client keeps the
highest position of the fence it holds and sends it back with every fenced call,
renewals included. A restarted server knows, for each earlier instance whose journal
it recovered, the last record of that instance it holds (:attr:`JournalPositions.ends`:
up to the next instance's ``start`` record, or the journal's end). A fence naming such
an instance with a higher position proves the journal is behind what that client was
told: the data directory was restored from an older copy (a volume snapshot, ``cp -a``,
a backup) whose ``journal.progress`` came with it, so start-up could not see it. The
server then does what a restore detected at start does (recovery.py): every session
ends, every earlier fence is void, every prefix cache is emptied, and no session may
attach for ``max_session_lease_seconds`` (persisted in grace.json); the call that
proved it fails INSTANCE_CHANGED.

Positions name records of one instance, so records a restored server writes after its
start can never pass for the lost ones. What remains is the time before the first such
call (deploy/README.md, "Restore the volume").
"""

from __future__ import annotations

from collections.abc import Callable

from .errors import ErrorReason, ServiceError, Status
from .fences import Fence

__all__ = ["JournalPositions"]


class JournalPositions:
    """The last record of each earlier instance this journal holds, and the check."""

    def __init__(self) -> None:
        #: instance id -> its last record in this journal
        self.ends: dict[str, int] = {}
        #: the instance whose ``start`` record came last (its end is not known yet)
        self.latest: str | None = None
        #: called once the journal is found behind a client (server.py fences everything)
        self.on_behind: Callable[[str], None] | None = None

    def started(self, instance_id: str, seq: int) -> None:
        """Instance ``instance_id`` wrote its ``start`` record at ``seq``."""
        if self.latest is not None:
            self.ends[self.latest] = seq - 1
        self.latest = instance_id

    def ended(self, last_seq: int) -> None:
        """Recovery replayed the journal up to ``last_seq``: the latest instance ended there."""
        if self.latest is not None:
            self.ends[self.latest] = last_seq
            self.latest = None

    def voided(self) -> None:
        """Every earlier fence is void (a restore was detected): nothing left to check."""
        self.ends.clear()
        self.latest = None

    def export(self) -> dict[str, object]:
        return {"ends": dict(self.ends), "latest": self.latest}

    def restore(self, state: dict[str, object] | None) -> None:
        if state:
            self.ends.update(state.get("ends") or {})  # type: ignore[call-overload]
            latest = state.get("latest")
            self.latest = str(latest) if latest else None

    def check(self, fence: Fence) -> None:
        """Raise when ``fence`` proves this journal is behind what its holder was told.

        Raises:
            ServiceError: FAILED_PRECONDITION, INSTANCE_CHANGED (after :attr:`on_behind`).
        """
        if not fence.position:
            return
        end = self.ends.get(fence.instance_id)
        if end is None or fence.position <= end:
            return
        reason = (
            f"a client was told of record {fence.position} of instance {fence.instance_id[:40]!r}, this "
            f"journal holds its records up to {end} only: the data directory was restored from an "
            "older copy"
        )
        if self.on_behind is not None:
            self.on_behind(reason)
        raise ServiceError(
            Status.PRECONDITION,
            f"{reason}; every session is ended and every block id you hold is void: attach again (after "
            "the grace period) and recompute your requests",
            ErrorReason.INSTANCE_CHANGED,
        )
