"""The predicted mode's Gate (flight.py) opened from other threads while the
scheduler's thread shuts it handing a Step over (``StepSender.cut``): real threads, a
real sender thread and a real server; the interleavings forced with events inside the
gate's lock calls (no sleeps).

The gate is a lock held while it is shut. ``shut`` is one non-blocking acquire;
``open`` checks (``locked``), then releases. When ``shut`` runs between ``open``'s
check and its (skipped) release, or an open falls just before ``shut``'s acquire, the
open is lost: the gate stays shut. What bounds it is ``Gate.max_seconds``: the sender
thread waits that long at most, then sends. Two opens racing past the check both
release: the second release (or the sender thread's, giving back the lock it took to
pass) finds it unlocked and is ignored. These tests hold the product to that:
whatever the interleaving, the Step handed over is sent once (the server handles
exactly one Step), answered as the mirror predicted, its flight finished without
anyone waiting for it, and the manager closes cleanly; no thread hangs past the
test's bound."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.testing import InProcessServer
from support import NONE, Req, scrape_metrics, wire_pool_config

#: how long any thread here may take for what is bounded (a hang fails, never a slow pass)
BOUND = 30.0


class SteppedLock:
    """A gate's lock whose next ``locked`` (``open``'s check) or ``acquire`` (``shut``'s
    act) on the armed thread is held until ``go`` is set, after telling ``checked``:
    ``locked`` answers what it read before the hold, ``acquire`` acts after it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.armed: tuple[int, str] | None = None
        self.checked = threading.Event()
        self.go = threading.Event()

    def arm(self, thread: int, call: str) -> None:
        self.armed = (thread, call)

    def _hold(self, call: str) -> None:
        if self.armed == (threading.get_ident(), call):
            self.armed = None
            self.checked.set()
            assert self.go.wait(BOUND), "the other thread never let the call go on"

    def locked(self) -> bool:
        answer = self.lock.locked()
        self._hold("locked")
        return answer

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        self._hold("acquire")
        return self.lock.acquire(blocking, timeout)

    def release(self) -> None:
        self.lock.release()


def _admit(m: PredictingKVCacheManager, rid: str, tokens: list[int]) -> None:
    r = Req(rid, tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    hit, hit_tokens = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit_tokens, hit_tokens, hit) is not None


def _steps_handled(server: InProcessServer) -> float:
    return sum(
        v
        for (name, labels), v in scrape_metrics(server).items()
        if name == "grpc_server_handled_total" and dict(labels).get("grpc_method") == "Step"
    )


@pytest.fixture
def manager(server: InProcessServer, client: KVCoordClient) -> Iterator[PredictingKVCacheManager]:
    client.create_pool("gated", wire_pool_config(32, events=True))
    m = PredictingKVCacheManager(client, "gated", hash_seed="0", renew=False)
    yield m
    m.close()


#: what a thread started by :func:`_in_thread` raised (an opener must raise nothing)
_RAISED: list[BaseException] = []


def _in_thread(target: Callable[[], Any]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as err:  # noqa: BLE001 - kept for the test to fail on
            _RAISED.append(err)

    t = threading.Thread(target=run, name="other-opener", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    "order",
    [
        "open-just-before-shut-acquires",
        "shut-between-open-check-and-release",
        "two-opens-past-the-check",
        "open-before-shut",
        "open-after-shut",
    ],
)
def test_a_step_handed_over_while_another_thread_opens_goes_once(
    server: InProcessServer, manager: PredictingKVCacheManager, order: str
) -> None:
    _RAISED.clear()
    sender = manager.sender
    gate = sender.gate
    event = SteppedLock()
    gate._shut = event  # type: ignore[assignment]  # (a lock's calls held where armed)
    sent: list[int] = []
    answered = threading.Event()
    checked = sender._checked_step

    def counted(step: Any) -> None:
        sent.append(threading.get_ident())
        try:
            checked(step)
        finally:
            answered.set()

    sender._checked_step = counted  # type: ignore[method-assign]
    _admit(manager, "warm", list(range(9)))
    manager.flush()  # the sender thread runs; the next Steps wait for the gate
    sender.release()  # vLLM's first schedule() returned: the gate is used from now on
    sent.clear()
    answered.clear()
    handled = _steps_handled(server)
    _admit(manager, "a", list(range(20, 29)))

    def the_step_ends() -> None:  # the scheduler's thread: cut and handed over (gate.shut)
        manager.take_events()

    main = threading.get_ident()
    if order == "open-just-before-shut-acquires":
        event.arm(main, "acquire")
        opener = _in_thread(lambda: (event.checked.wait(BOUND), gate.open(), event.go.set()))
        the_step_ends()
    elif order in ("shut-between-open-check-and-release", "two-opens-past-the-check"):
        holder: list[int] = []
        ready = threading.Event()

        def open_held() -> None:
            holder.append(threading.get_ident())
            event.arm(holder[0], "locked")
            ready.set()
            gate.open()

        if order == "two-opens-past-the-check":
            the_step_ends()  # shut: both openers see it locked, both release
        opener = _in_thread(open_held)
        assert ready.wait(BOUND) and event.checked.wait(BOUND)
        if order == "two-opens-past-the-check":
            second = _in_thread(gate.open)
            second.join(BOUND)
            assert not second.is_alive(), "the second opener hung"
        else:
            the_step_ends()
        event.go.set()
    elif order == "open-before-shut":
        opener = _in_thread(gate.open)
        opener.join(BOUND)
        the_step_ends()
    else:
        the_step_ends()
        opener = _in_thread(gate.open)
    opener.join(BOUND)
    assert not opener.is_alive(), "the thread opening the gate hung"
    assert _RAISED == [], f"{order}: an opener raised"
    # nobody waits for the Step: the sender thread sends it on its own (at most max_seconds late)
    assert answered.wait(BOUND), f"{order}: the Step handed over was never sent"
    in_flight = sender.in_flight
    assert in_flight is not None
    waiter = _in_thread(in_flight.result)  # (the flight is finished right after the answer is checked)
    waiter.join(BOUND)
    assert in_flight.done() and not waiter.is_alive(), f"{order}: the Step's flight never finished"
    if order.startswith(("open-just", "shut-between", "two-opens")):
        assert event.checked.is_set() and event.go.is_set()  # the held interleaving ran
    assert sender.failure is None, sender.failure
    assert len(sent) == 1 and sent[0] != main, sent  # once, on the sender thread
    manager.flush()  # nothing more to send: no second Step
    assert len(sent) == 1, sent
    assert _steps_handled(server) - handled == 1
    assert manager.usage > 0 and "a" in manager.tracker
