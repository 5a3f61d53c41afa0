"""What the two crash-point harnesses share (tests/reliability/test_crash_points.py on one
server, tests/cluster/test_cluster_crash_points.py on replicas): workers that run while a
gate is open and stop at a call boundary when it closes, the allocation each makes, and
the comparison of what the workers were told with what the server holds."""

from __future__ import annotations

import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

from kvcoord.client import KVCoordClient
from kvcoord.v1 import allocator_pb2 as pb


class GatedWorker(threading.Thread):
    """A worker thread: :meth:`one` call after another while ``gate`` is set; cleared,
    it stops at the next call boundary and sets ``idle``. ``calls``: calls answered (a
    result or a typed error); ``error``: what ended it, for the test to report."""

    def __init__(self, name: str, seed: int, gate: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.rnd = random.Random(seed)
        self.gate = gate
        self.idle = threading.Event()
        self.stop = False
        self.calls = 0
        self.lost_told = 0  # times told a session was gone
        self.error = ""
        self.n = 0  # requests made

    def connect(self) -> KVCoordClient:
        raise NotImplementedError

    def begin(self, c: KVCoordClient) -> None:
        """Called once the client is open, before the first call."""

    def one(self, c: KVCoordClient) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            with self.connect() as c:
                self.begin(c)
                while not self.stop:
                    if not self.gate.is_set():
                        self.idle.set()
                        self.gate.wait(0.05)
                        continue
                    self.idle.clear()
                    self.one(c)
        except BaseException as exc:  # reported by the test
            self.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        finally:
            self.idle.set()

    def new_allocation(self) -> tuple[str, pb.Operation]:
        """A new request of 1-4 blocks whose hashes are its own (no block is ever shared
        through the prefix cache, so two holders of one block is always a fault)."""
        self.n += 1
        rid = f"{self.name}-{self.n}"
        tokens = 4 * self.rnd.randint(1, 4)
        sync = pb.RequestSync(
            request_id=rid, append_token_ids=list(range(tokens)), new_request=True,
            append_block_hashes=[f"{rid}/{i}".encode().ljust(32, b".") for i in range(tokens // 4)],
        )  # fmt: skip
        return rid, pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=tokens))


def quiesce(
    workers: Sequence[GatedWorker],
    gate: threading.Event,
    min_calls: int,
    timeout: float,
    context: Callable[[], str],
) -> None:
    """Let the workers run until each answered ``min_calls`` more calls, then stop them at
    a call boundary (after a restart each has heard what became of its session before
    its view is compared); ``context()`` is added to a failure's message."""
    start = [w.calls for w in workers]
    gate.set()
    deadline = time.monotonic() + timeout
    while any(
        w.calls < s + min_calls and w.is_alive() and not w.error for w, s in zip(workers, start, strict=True)
    ):
        assert time.monotonic() < deadline, f"a worker made no progress\n{context()}"
        time.sleep(0.01)
    gate.clear()
    for w in workers:
        assert w.idle.wait(timeout), f"{w.name} never stopped"
        assert not w.error, f"{w.name}: {w.error}\n{context()}"


Told = tuple[dict[str, tuple[list[int], "list[int] | None"]], dict[str, list[int]], list[int]]


def told_against_held(
    acked: dict[str, list[int]], held: dict[str, list[int]], unknown: Iterable[str] = ()
) -> Told:
    """What the workers were told against what the server holds: (acknowledged but not
    held as told: request -> (told, held); held but never acknowledged, ``unknown``
    requests, whose last call went unanswered, excepted; blocks held by two requests)."""
    maybe = set(unknown)
    missing = {r: (ids, held.get(r)) for r, ids in acked.items() if held.get(r) != ids}
    extra = {r: ids for r, ids in held.items() if r not in acked and r not in maybe}
    counts = Counter(b for ids in held.values() for b in ids)
    twice = sorted(b for b, n in counts.items() if n > 1)
    return missing, extra, twice
