"""The lease marker: how a restarted server knows leases of its predecessor may still run.

A server with a ``state_dir`` records there, before it grants or renews any lease,
a wall-clock time by which every lease it granted has ended. A server that starts
and finds a marker in the future hands out no block until that time: a worker that
lost its server stops using its block ids when its lease ends (it knows when it last
renewed), so after that no id can be held by two live workers.

The file is rewritten only when the bound must move forward, with headroom, so a
busy server writes it about once per ``headroom`` seconds.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["LeaseMarker", "MarkerError"]

logger = logging.getLogger(__name__)

FILE_NAME = "leases.json"


class MarkerError(RuntimeError):
    """The marker file exists but cannot be read; the message names it."""


class LeaseMarker:
    """Args:
    state_dir: the server's state directory (created if missing).
    max_lease: the longest lease this server grants, in seconds.
    clock: wall-clock seconds (time.time), injected for tests.
    """

    def __init__(
        self, state_dir: str | Path, max_lease: float, clock: Callable[[], float] = time.time
    ) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.max_lease = max_lease
        self.clock = clock
        self.recorded = 0.0
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def previous_leases_end(self) -> float | None:
        """When the previous instance's leases end at the latest (wall clock), if known.

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
            return float(json.loads(text)["leases_end_by"])
        except (ValueError, KeyError, TypeError) as exc:
            raise MarkerError(
                f"lease marker {self.path} is malformed ({exc}); if no worker of the previous "
                "instance can still be running, delete it"
            ) from None

    def cover(self, lease_seconds: float) -> None:
        """Make sure the marker covers a lease granted or renewed now.

        Writes (atomically, synced) only when the recorded bound would be passed.
        """
        need = self.clock() + lease_seconds
        if need <= self.recorded:
            return
        self.write(need + self.max_lease)

    def write(self, leases_end_by: float) -> None:
        tmp = self.path.with_suffix(".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump({"leases_end_by": leases_end_by}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.recorded = leases_end_by
