"""Long tests first on every pytest-xdist worker: the order tests/conftest.py gives a run.

A test marked ``long`` takes 15 s or more of wall time in CI (replica clusters under
faults). Handed out in file order, such tests started late: tests/cluster runs with
``--dist loadfile``, and its 115 s file (2 tests) was the last one on its worker in CI
at fd659a57. Started first, they run beside the short tests, and the run ends with
short tests an idle worker can take over.

(Under ``--dist worksteal`` the unit phase's last 53 s had a single worker running a
52 s test, started after its 83 s one. Its long tests are not marked yet: the one run
with them moved first failed tests/service/test_cli.py's two SIGINT tests (the CLI
ignored SIGINT for 120 s), most likely as a run started as a background job fails them
(SIGINT ignored, inherited by the CLI); test_cli.py starts the CLI with SIGINT at its
default since (started_for_sigint), and the unit phase's order was not measured again.)

``--dist worksteal`` splits the collection into one contiguous share per worker (sizes as
:func:`worksteal_shares` computes them, as xdist's WorkStealingScheduling does) and an
idle worker takes the second half of the longest remaining queue: :func:`worksteal_order`
deals the long tests round robin to the shares' fronts, the short ones after them in
collection order. ``--dist loadfile`` hands out whole files in collection order (with
``--no-loadscope-reorder``; by default xdist sorts them by their number of tests):
:func:`loadfile_order` puts the files holding a long test first.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import TypeVar

__all__ = ["loadfile_order", "worksteal_order", "worksteal_shares"]

T = TypeVar("T")


def worksteal_shares(count: int, workers: int) -> list[int]:
    """The sizes of the contiguous shares xdist's worksteal scheduler first sends its workers."""
    shares = []
    left = count
    for i in range(workers):
        share = left // (workers - i)
        shares.append(share)
        left -= share
    return shares


def worksteal_order(items: Sequence[T], is_long: Callable[[T], bool], workers: int) -> list[T]:
    """``items`` reordered so that every worker's first share starts with its long tests.

    The long tests are dealt round robin (in collection order) to the shares, each share's
    short tests follow in collection order. Where a share would hold nothing but long tests
    (more long tests than fit), ``items`` comes back as it was.
    """
    longs = [item for item in items if is_long(item)]
    shorts = [item for item in items if not is_long(item)]
    shares = worksteal_shares(len(items), workers)
    dealt = [longs[i::workers] for i in range(workers)]
    if not longs or any(len(d) >= share for d, share in zip(dealt, shares, strict=True)):
        return list(items)
    ordered: list[T] = []
    taken = 0
    for d, share in zip(dealt, shares, strict=True):
        rest = share - len(d)
        ordered += d + shorts[taken : taken + rest]
        taken += rest
    return ordered


def loadfile_order(
    items: Sequence[T], is_long: Callable[[T], bool], file_of: Callable[[T], Hashable]
) -> list[T]:
    """``items`` with the files holding a long test first; every file's tests in their order."""
    long_files = {file_of(item) for item in items if is_long(item)}
    return [item for item in items if file_of(item) in long_files] + [
        item for item in items if file_of(item) not in long_files
    ]
