"""The lease marker: how a restarted server knows leases of its predecessor may still run.

A server with a ``state_dir`` records there, before it grants or renews any lease,
a wall-clock time by which every lease it granted has ended. A server that starts
and finds a marker in the future hands out no block until that time: a worker that
lost its server stops using its block ids when its lease ends (it knows when it last
renewed), so after that no id can be held by two live workers.

The file is rewritten only when the bound must move forward, with headroom, so a
busy server writes it about once per ``max_lease`` seconds.

The bound is written on the wall clock and on the monotonic clock with the boot id
(deadlines.DurableDeadline): a restart on the same boot counts on the monotonic clock,
so a wall clock set forward in between cannot end the wait early.

A marker that cannot be written (disk full, I/O error) means the server can no longer
promise when its leases end: :meth:`LeaseMarker.cover` raises :class:`MarkerWriteError`
and the server stops serving as after a failed journal write (``server.py``).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from .deadlines import DurableDeadline, write_synced

__all__ = ["LeaseMarker", "MarkerError", "MarkerWriteError"]

logger = logging.getLogger(__name__)

FILE_NAME = "leases.json"


class MarkerError(RuntimeError):
    """The marker file exists but cannot be read; the message names it."""


class MarkerWriteError(OSError):
    """The marker could not be written: no lease may be granted or renewed."""


class LeaseMarker:
    """Args:
    state_dir: the server's state directory (created if missing).
    max_lease: the longest lease this server grants, in seconds.
    clock: wall-clock seconds (time.time), injected for tests.
    mono: monotonic seconds (time.monotonic), injected for tests.
    boot: the boot id (deadlines.boot_id), injected for tests.
    """

    def __init__(
        self,
        state_dir: str | Path,
        max_lease: float,
        clock: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        boot: str | None = None,
    ) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.max_lease = max_lease
        self.clock = clock
        self.deadline = DurableDeadline(clock, mono, boot)
        #: the bound recorded, on the monotonic clock
        self.recorded = float("-inf")
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def previous_leases_remaining(self) -> float | None:
        """Seconds until the previous instance's leases have all ended (<= 0: they have),
        or None without a marker.

        Raises:
            MarkerError: the file is unreadable or malformed.
        """
        try:
            text = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise MarkerError(f"cannot read lease marker {self.path}: {exc}") from None
        try:
            data = json.loads(text)
            if "until_wall" not in data:  # written by an older kvcoord: wall clock only
                data = {"until_wall": data["leases_end_by"]}
            return self.deadline.remaining(data)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise MarkerError(
                f"lease marker {self.path} is malformed ({exc}); if no worker of the previous "
                "instance can still be running, delete it"
            ) from None

    def cover(self, lease_seconds: float) -> None:
        """Make sure the marker covers a lease granted or renewed now.

        Writes (atomically, synced) only when the recorded bound would be passed.

        Raises:
            MarkerWriteError: the marker cannot be written (the lease must not be granted).
        """
        now = self.deadline.mono()
        if now + lease_seconds <= self.recorded:
            return
        self.write(lease_seconds + self.max_lease)
        self.recorded = now + lease_seconds + self.max_lease

    def write(self, seconds_from_now: float) -> None:
        """Record that every lease ends within ``seconds_from_now``.

        Raises:
            MarkerWriteError: naming the file and the error.
        """
        fields = self.deadline.fields(seconds_from_now)
        try:
            write_synced(self.path, json.dumps({**fields, "leases_end_by": fields["until_wall"]}))
        except OSError as exc:
            raise MarkerWriteError(
                exc.errno, f"cannot write lease marker {self.path}: {exc.strerror or exc}"
            ) from exc
