"""Deadlines that survive a restart, and the synced writes that keep them.

A deadline a restart must honour (a grace period in ``grace.json``, the lease marker)
is recorded on both clocks: the wall clock and the monotonic clock with the kernel's
boot id. A restart on the same boot counts on the monotonic clock (a wall clock set
forward or back in between changes nothing); after a reboot only the wall clock is
left. Used by startup.py and lease_marker.py (kept apart so neither imports the other).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["DurableDeadline", "boot_id", "write_synced"]


def boot_id() -> str:
    """The kernel's id of this boot ("" where there is none): a monotonic time is
    comparable across processes only within one boot."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        return ""


def write_synced(path: Path, text: str) -> None:
    """Replace ``path`` atomically with ``text``, synced (file and directory)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DurableDeadline:
    """A deadline written on both clocks (see the module docstring).

    Args:
        wall: wall-clock seconds (time.time), injected for tests.
        mono: monotonic seconds (time.monotonic), injected for tests.
        boot: this boot's id (:func:`boot_id`), injected for tests.
    """

    def __init__(
        self,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        boot: str | None = None,
    ) -> None:
        self.wall = wall
        self.mono = mono
        self.boot = boot_id() if boot is None else boot

    def fields(self, seconds_from_now: float) -> dict[str, float | str]:
        """The deadline ``seconds_from_now`` as stored fields."""
        return {
            "until_wall": self.wall() + seconds_from_now,
            "until_mono": self.mono() + seconds_from_now,
            "boot_id": self.boot,
        }

    def remaining(self, fields: dict[str, object]) -> float:
        """Seconds left until a stored deadline (negative once passed).

        Raises:
            ValueError: the fields are malformed.
        """
        until_wall = float(fields["until_wall"])  # type: ignore[arg-type]
        mono = fields.get("until_mono")
        if mono is not None and self.boot and fields.get("boot_id") == self.boot:
            return float(mono) - self.mono()  # type: ignore[arg-type]
        return until_wall - self.wall()
