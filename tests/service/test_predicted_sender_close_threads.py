"""The predicted mode's Step sender closed from another thread while the scheduler's
thread hands a Step over (``StepSender.cut``), and a signal (KeyboardInterrupt)
delivered inside a cut or a settle: real threads, a real sender thread and a real
server; the interleavings forced with events and hooks (no sleeps), every wait bounded.

Before, ``close()`` took the sender thread's queue, put its stop mark and joined the
thread while the scheduler's thread was between reading that queue and putting its
Step on it: the Step went in after the stop mark, was never sent, and its flight was
never finished, so the next settle (the manager's own close flushes first) waited
forever. A cut after close started a new sender thread. A KeyboardInterrupt between
the flight's creation and the hand-over left the same unfinished flight behind.

Now a close waits for a hand-over under way (that Step is sent, once), a cut after it
is refused (FailedPreconditionError), and an interrupted hand-over marks the mirror
untrusted: the interrupt reaches the caller, the next call reports every request lost
(RequestsLostError), and the manager still closes."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.errors import FailedPreconditionError, RequestsLostError
from kvcoord.client.flight import Flight
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.testing import InProcessServer
from support import NONE, Req, wire_pool_config

#: how long any thread here may take for what is bounded (a hang fails, never a slow pass)
BOUND = 30.0


def _admit(m: PredictingKVCacheManager, rid: str, tokens: list[int]) -> None:
    r = Req(rid, tokens)
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    hit, hit_tokens = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(tokens) - hit_tokens, hit_tokens, hit) is not None


def _count_steps(sender: Any, go: threading.Event | None = None) -> list[int]:
    """The threads that sent each Step from now on (the server's own counter is
    bumped after its answer is on the wire: a client can see the answer first); with
    ``go``, each is sent once it is set."""
    sent: list[int] = []
    checked = sender._checked_step

    def counted(step: Any) -> None:
        assert go is None or go.wait(BOUND), "the Step was never let go"
        sent.append(threading.get_ident())
        checked(step)

    sender._checked_step = counted
    return sent


def _bounded(call: Callable[[], Any], what: str) -> Any:
    """``call`` on another thread; fails (never hangs) when it does not return within
    BOUND; returns its result or raises what it raised."""
    out: list[Any] = []
    raised: list[BaseException] = []

    def run() -> None:
        try:
            out.append(call())
        except BaseException as err:  # noqa: BLE001 - re-raised on the test's thread
            raised.append(err)

    t = threading.Thread(target=run, name=what, daemon=True)
    t.start()
    t.join(BOUND)
    assert not t.is_alive(), f"{what} hung"
    if raised:
        raise raised[0]
    return out[0] if out else None


@pytest.fixture
def manager(server: InProcessServer, client: KVCoordClient) -> Iterator[PredictingKVCacheManager]:
    client.create_pool("gated", wire_pool_config(32, events=True))
    m = PredictingKVCacheManager(client, "gated", hash_seed="0", renew=False)
    _admit(m, "warm", list(range(9)))
    m.flush()  # the sender thread runs
    m.sender.release()  # vLLM's first schedule() returned: the gate is used from now on
    yield m
    try:
        _bounded(m.close, "the manager's close")
    except (RequestsLostError, FailedPreconditionError):
        pass  # (what a test left to report)


class HeldShut:
    """The gate's lock: its next ``acquire`` on ``thread`` (``Gate.shut`` in the cut's
    hand-over, after the flight is made and before the Step is put on the queue) first
    runs ``hold``."""

    def __init__(self, lock: Any, thread: int, hold: Callable[[], None]) -> None:
        self.lock, self.thread, self.hold = lock, thread, hold

    def locked(self) -> bool:
        return bool(self.lock.locked())

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self.thread == threading.get_ident():
            self.thread = 0
            self.hold()
        return bool(self.lock.acquire(blocking, timeout))

    def release(self) -> None:
        self.lock.release()


class WatchedLock:
    """A lock that tells ``waiting`` when a thread other than ``owner`` asks for it."""

    def __init__(self, lock: Any, owner: int, waiting: threading.Event) -> None:
        self.lock, self.owner, self.waiting = lock, owner, waiting

    def __enter__(self) -> bool:
        if threading.get_ident() != self.owner:
            self.waiting.set()
        return bool(self.lock.acquire())

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def test_close_on_another_thread_during_a_cut_sends_the_step_once_and_later_cuts_are_refused(
    server: InProcessServer, manager: PredictingKVCacheManager
) -> None:
    sender = manager.sender
    main = threading.get_ident()
    sent = _count_steps(sender)
    _admit(manager, "a", list(range(20, 29)))
    # the close has gone as far as it can: it returned, or it waits for the hand-over
    progressed = threading.Event()
    inbox = getattr(sender, "inbox", None)
    if inbox is not None:
        inbox.lock = WatchedLock(inbox.lock, main, progressed)
    closer: list[threading.Thread] = []

    def close_now() -> None:
        try:
            sender.close()
        finally:
            progressed.set()

    def hold() -> None:  # on the scheduler's thread, inside the hand-over
        closer.append(threading.Thread(target=close_now, name="closer", daemon=True))
        closer[0].start()
        assert progressed.wait(BOUND), "the close neither returned nor waited"

    sender.gate._shut = HeldShut(sender.gate._shut, main, hold)  # type: ignore[assignment]
    manager.take_events()  # the step ends: cut, the Step handed over
    assert closer, "the hand-over never shut the gate"
    closer[0].join(BOUND)
    assert not closer[0].is_alive(), "close() hung"
    _bounded(sender.settle, "the settle after close")  # the Step handed over was answered
    assert sender.failure is None, sender.failure
    assert len(sent) == 1 and sent[0] != main, sent  # sent once, by the sender thread
    assert "a" in manager.tracker
    # a later step's Step is refused, typed (no sender thread started again)
    _admit(manager, "b", list(range(40, 49)))
    with pytest.raises(FailedPreconditionError, match="closed"):
        _bounded(manager.flush, "a flush after close")
    assert getattr(sender, "inbox", sender).thread is None
    assert len(sent) == 1, sent


def test_a_cut_after_close_is_refused(server: InProcessServer, manager: PredictingKVCacheManager) -> None:
    sent = _count_steps(manager.sender)
    _bounded(manager.sender.close, "close")
    _admit(manager, "a", list(range(20, 29)))
    with pytest.raises(FailedPreconditionError, match="closed"):
        _bounded(manager.take_events, "a cut after close")
    assert sent == []


@pytest.fixture
def sigint_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt on this (the main) thread, as in a plain process."""
    # (pytest, with or without xdist, runs tests on the main thread: a signal reaches it)
    assert threading.current_thread() is threading.main_thread(), "signals reach the main thread only"
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def test_a_signal_inside_a_cuts_hand_over_leaves_the_sender_closable_and_the_next_call_typed(
    server: InProcessServer, manager: PredictingKVCacheManager, sigint_raises: None
) -> None:
    sender = manager.sender
    main = threading.get_ident()
    _admit(manager, "a", list(range(20, 29)))
    sender.gate._shut = HeldShut(  # type: ignore[assignment]
        sender.gate._shut, main, lambda: signal.raise_signal(signal.SIGINT)
    )
    with pytest.raises(KeyboardInterrupt):
        manager.take_events()  # the step ends: interrupted between the flight and the hand-over
    # the next call reports what the interrupted Step cost: every request lost, typed
    with pytest.raises(RequestsLostError) as lost:
        _bounded(manager.flush, "the flush after the interrupt")
    assert {"warm", "a"} <= set(lost.value.request_ids)
    _bounded(manager.flush, "a second flush")  # the session started again: nothing to report
    _bounded(sender.close, "close after the interrupt")


def test_a_signal_inside_a_settle_leaves_the_step_waited_for_and_the_sender_closable(
    server: InProcessServer, manager: PredictingKVCacheManager, sigint_raises: None, monkeypatch: Any
) -> None:
    """The flush after an interrupted settle still waits for the Step that settle
    waited for (a flush confirms every answer: a failure of that Step is its to
    report). Before, the interrupted settle had already forgotten the flight, and the
    next flush returned at once with the Step unsent."""
    sender = manager.sender
    go = threading.Event()  # the sender thread sends the Step only once someone waits for it
    sent = _count_steps(sender, go)
    _admit(manager, "a", list(range(20, 29)))
    manager.take_events()  # the Step handed over
    wait = Flight.result
    interrupted: list[bool] = []

    def interrupted_wait(flight: Flight) -> None:
        if not interrupted:
            interrupted.append(True)
            signal.raise_signal(signal.SIGINT)
        go.set()
        wait(flight)

    monkeypatch.setattr(Flight, "result", interrupted_wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            manager.flush()  # the settle waiting for that Step is interrupted
        assert interrupted and not go.is_set()
        _bounded(manager.flush, "the flush after the interrupt")
        assert len(sent) == 1, sent  # that flush waited for the Step: sent and answered
        assert sender.failure is None, sender.failure
        assert "a" in manager.tracker
    finally:
        go.set()
    _bounded(sender.close, "close after the interrupt")
