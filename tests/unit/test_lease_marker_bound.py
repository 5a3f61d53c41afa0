"""LeaseMarker's bound on a write (stall_seconds, the policy of stalls.py): a write in
time changes nothing; the thread's write outstanding past the bound, or a write a lease
needs that does not return within it, raises MarkerStalledError (an OSError: the lease
is refused and the server stops) and marks the marker hung; close() does not wait."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from kvcoord.service import lease_marker
from kvcoord.service.lease_marker import LeaseMarker, MarkerStalledError


def _held(monkeypatch: pytest.MonkeyPatch) -> tuple[threading.Event, threading.Event]:
    """Marker writes block from now on until ``release`` is set (bounded: 30 s)."""
    real = lease_marker.write_synced
    writing, release = threading.Event(), threading.Event()

    def held(path: Path, text: str) -> None:
        writing.set()
        release.wait(30)
        real(path, text)

    monkeypatch.setattr(lease_marker, "write_synced", held)
    return writing, release


def test_a_write_in_time_changes_nothing(tmp_path: Path) -> None:
    marker = LeaseMarker(tmp_path, 10.0)
    marker.stall_seconds = 30.0
    marker.cover(10.0)
    assert marker.recorded > 0 and not marker.hung
    assert marker.close(30)


def test_a_write_a_lease_needs_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = LeaseMarker(tmp_path, 10.0)
    marker.stall_seconds = 0.2
    writing, release = _held(monkeypatch)
    try:
        with pytest.raises(MarkerStalledError, match="journal_stall_seconds"):
            marker.cover(10.0)  # the first: written for the caller
        assert marker.hung and writing.is_set() and marker.recorded == float("-inf")
        with pytest.raises(MarkerStalledError):  # and every later one, at once
            marker.cover(1.0)
    finally:
        release.set()


def test_the_threads_write_outstanding_past_the_bound_is_a_stall(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mono = [100.0]
    marker = LeaseMarker(tmp_path, 10.0, clock=lambda: 1000.0, mono=lambda: mono[0], boot="b")
    marker.stall_seconds = 0.2
    marker.cover(10.0)  # bound on disk: 120
    writing, release = _held(monkeypatch)
    try:
        mono[0] = 106.0  # past half the headroom: the thread starts its write
        marker.cover(10.0)
        assert writing.wait(30)
        refresher = marker._refresher
        assert refresher is not None
        refresher.join(0.5)  # (longer than the bound, real time)
        assert refresher.is_alive()
        with pytest.raises(MarkerStalledError):  # a lease still inside the bound on disk
            marker.cover(10.0)
        assert marker.hung and not marker.close(30)  # (at once: the hung write is not waited for)
    finally:
        release.set()
