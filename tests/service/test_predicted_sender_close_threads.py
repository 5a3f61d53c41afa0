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
(RequestsLostError), and the manager still closes.

A signal handler runs on the main thread inside whatever it interrupted: a handler's
close inside the main thread's own hand-over waited for the lock that hand-over held,
and the process hung. Now it returns and the hand-over stops the thread after its
Step; a handler's flush there is refused, typed. vLLM's own handler (SystemExit once,
then the engine's shutdown closes the manager) is run the same way. A close
interrupted while it waits for the thread left it for nobody to wait for (and CPython
3.11's Thread.join, interrupted, marks a running thread stopped); now the next close
waits again, on the thread's own end. A cut interrupted just after its Step was put kept no flight, and
the new session started by the next call was stamped on that Step; now the recovery
waits for what was put before it starts the session again."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.errors import FailedPreconditionError, RequestsLostError
from kvcoord.client.flight import Flight, Inbox
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.testing import InProcessServer
from support import NONE, Req, held_blocks, wire_pool_config

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


class BoundedLock:
    """The inbox's lock, every wait for it bounded: a wait past BOUND fails
    (AssertionError) instead of hanging. A wait on the main thread for the lock its own
    hand-over holds (a signal handler's call) would never end: the test fails on it."""

    def __init__(self, lock: Any) -> None:
        self.lock = lock

    def __enter__(self) -> bool:
        assert self.lock.acquire(True, BOUND), "waited for the inbox's lock past BOUND (a deadlock)"
        return True

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


@pytest.fixture
def on_sigusr1() -> Iterator[Callable[[Callable[[], None]], None]]:
    """Sets what SIGUSR1 runs (as a handler, on the main thread); restored after."""
    assert threading.current_thread() is threading.main_thread(), "signals reach the main thread only"
    old = signal.getsignal(signal.SIGUSR1)

    def install(run: Callable[[], None]) -> None:
        signal.signal(signal.SIGUSR1, lambda signum, frame: run())

    try:
        yield install
    finally:
        signal.signal(signal.SIGUSR1, old)


def _signal_inside_the_hand_over(sender: Any) -> None:
    """SIGUSR1 is raised on the main thread inside its next hand-over (in ``Gate.shut``,
    with the inbox's lock held: the Step gathered, the flight made, not put yet), and
    every wait for that lock is bounded."""
    sender.inbox.lock = BoundedLock(sender.inbox.lock)
    sender.gate._shut = HeldShut(  # type: ignore[assignment]
        sender.gate._shut, threading.get_ident(), lambda: signal.raise_signal(signal.SIGUSR1)
    )


def test_a_signal_handlers_close_inside_the_main_threads_hand_over_returns_and_the_step_goes_once(
    server: InProcessServer, manager: PredictingKVCacheManager, on_sigusr1: Any
) -> None:
    """A user's handler closing the sender (as on SIGTERM) while the main thread hands a
    Step over. Before, its close waited for the lock that hand-over held, below it on
    the same thread: the process hung."""
    sender = manager.sender
    sent = _count_steps(sender)
    thread = sender.inbox.thread
    assert thread is not None and thread.is_alive()
    closed: list[bool] = []

    def handler() -> None:
        sender.close()
        closed.append(True)

    on_sigusr1(handler)
    _admit(manager, "a", list(range(20, 29)))
    _signal_inside_the_hand_over(sender)
    manager.take_events()  # the step ends: cut, the handler runs inside the hand-over
    assert closed, "the handler never ran"
    # the hand-over stopped the thread once its Step was sent: sent once, on that thread
    thread.join(BOUND)
    assert not thread.is_alive(), "the sender thread was never stopped"
    assert len(sent) == 1 and sent[0] == thread.ident, sent
    _bounded(sender.settle, "the settle after the handler's close")
    assert sender.failure is None, sender.failure  # the server's answer matched the mirror's
    assert "a" in manager.tracker
    _admit(manager, "b", list(range(40, 49)))
    with pytest.raises(FailedPreconditionError, match="closed"):
        _bounded(manager.flush, "a flush after the handler's close")
    _bounded(sender.close, "a close after the handler's")
    assert len(sent) == 1, sent


def test_a_signal_handlers_flush_inside_the_main_threads_hand_over_is_refused_typed(
    server: InProcessServer, manager: PredictingKVCacheManager, on_sigusr1: Any
) -> None:
    """A handler that gathers a call and flushes while the main thread hands a Step
    over: its own hand-over cannot wait for the one below it (before, it waited for
    that lock forever); refused, typed, and the interrupted Step's loss reported."""
    sender = manager.sender
    sent = _count_steps(sender)
    refused: list[BaseException] = []

    def handler() -> None:
        _admit(manager, "b", list(range(40, 49)))
        try:
            manager.flush()
        except FailedPreconditionError as err:
            refused.append(err)
            raise

    on_sigusr1(handler)
    _admit(manager, "a", list(range(20, 29)))
    _signal_inside_the_hand_over(sender)
    with pytest.raises(FailedPreconditionError, match="handed over on this thread"):
        manager.take_events()
    assert len(refused) == 1
    assert sent == []  # the interrupted Step was never handed over
    with pytest.raises(RequestsLostError) as lost:
        _bounded(manager.flush, "the flush after the refusal")
    assert {"warm", "a", "b"} <= set(lost.value.request_ids)
    _bounded(manager.flush, "a second flush")  # the session started again: nothing to report
    _bounded(sender.close, "close after the refusal")


def test_vllms_shutdown_signal_inside_a_hand_over_ends_the_session_without_hanging(
    server: InProcessServer, client: KVCoordClient, manager: PredictingKVCacheManager, on_sigusr1: Any
) -> None:
    """vLLM's engine core (``EngineCoreProc.run_engine_core``): its SIGTERM/SIGINT
    handler raises SystemExit once and ignores later signals; its ``finally`` then
    shuts the engine down, and the scheduler's shutdown closes the manager (a
    RequestsLostError logged, not raised). The SystemExit lands inside a hand-over here."""
    sender = manager.sender
    requested: list[bool] = []

    def vllm_handler() -> None:
        if not requested:
            requested.append(True)
            raise SystemExit()

    on_sigusr1(vllm_handler)
    _admit(manager, "a", list(range(20, 29)))
    _signal_inside_the_hand_over(sender)
    thread = sender.inbox.thread
    assert thread is not None
    try:
        with pytest.raises(SystemExit):
            manager.take_events()  # the busy loop's step
    finally:
        signal.raise_signal(signal.SIGUSR1)  # a second signal during shutdown: ignored
        with pytest.raises(RequestsLostError):  # (the scheduler's shutdown logs it)
            _bounded(manager.close, "the engine's shutdown")
    assert not thread.is_alive()
    assert sender.inbox.thread is None
    assert list(client.list_sessions("gated").sessions) == []  # detached: its requests freed


#: where a thread waiting for another sits (CPython 3.11's Thread.join, 3.13's, a Flight)
WAITS = {"_wait_for_tstate_lock", "join", "result"}


def _waiting_in_close(ident: int | None) -> bool:
    """Whether thread ``ident`` is inside the inbox's close, in one of :data:`WAITS`."""
    frame = sys._current_frames().get(ident or 0)
    if frame is None or frame.f_code.co_name not in WAITS:
        return False
    while frame is not None and frame.f_code is not Inbox.close.__code__:
        frame = frame.f_back
    return frame is not None


def _until(condition: Callable[[], bool], what: str) -> None:
    """A bounded poll: fails (never hangs) when ``condition`` does not hold within BOUND."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_a_close_interrupted_while_it_waits_leaves_the_next_close_to_wait_for_the_step(
    server: InProcessServer, manager: PredictingKVCacheManager, sigint_raises: None
) -> None:
    """Ctrl-C (SIGINT, sent to the main thread while its close() waits for the sender
    thread, whose Step is not answered yet): the next close waits for that Step, sent
    once. Before, the interrupted close had let go of the thread and the next returned
    at once; keeping it was not enough: CPython 3.11's Thread.join, interrupted,
    marks a thread that still runs as stopped, and the next join returns at once."""
    sender = manager.sender
    main = threading.get_ident()
    go = threading.Event()  # the sender thread sends the Step once a second close waits
    events: list[str] = []
    interrupted: list[bool] = []

    def interrupt_once(signum: int, frame: Any) -> None:
        if not interrupted:  # (as vLLM's handler: once; a signal sent again is ignored)
            interrupted.append(True)
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, interrupt_once)
    checked = sender._checked_step

    def held(step: Any) -> None:  # on the sender thread
        # Ctrl-C while the first close waits (sent again while its handler has not
        # run: one that lands just before the wait blocks is handled only after it)
        deadline = time.monotonic() + BOUND
        while not interrupted:
            assert time.monotonic() < deadline, "the first close was never interrupted"
            if _waiting_in_close(main):
                signal.pthread_kill(main, signal.SIGINT)
            time.sleep(0.01)
        assert go.wait(BOUND), "the Step was never let go"
        checked(step)
        events.append("answered")

    sender._checked_step = held  # type: ignore[method-assign]
    _admit(manager, "a", list(range(20, 29)))
    manager.take_events()  # the Step handed over; the sender thread holds it
    closer: threading.Thread | None = None
    try:
        with pytest.raises(KeyboardInterrupt):
            sender.close()
        assert events == []

        def close_again() -> None:
            sender.close()
            events.append("closed")

        closer = threading.Thread(target=close_again, name="second close", daemon=True)
        closer.start()
        _until(lambda: not closer.is_alive() or _waiting_in_close(closer.ident), "the second close hung")
    finally:
        go.set()
    closer.join(BOUND)
    assert not closer.is_alive(), "the second close hung"
    assert events == ["answered", "closed"], events  # it waited for the Step, sent once
    _bounded(sender.settle, "the settle after close")
    assert sender.failure is None, sender.failure  # its answer matched the mirror's
    assert "a" in manager.tracker
    assert sender.inbox.thread is None


class InterruptedAfterPut:
    """The sender thread's queue: the first Step put on it is put, then SIGINT is
    raised on the putting thread (a signal arriving during the put: handled as it
    returns, the cut interrupted after the hand-over itself)."""

    def __init__(self, q: Any) -> None:
        self.q, self.fired = q, False

    def put(self, item: Any) -> None:
        self.q.put(item)
        if not self.fired:
            self.fired = True
            signal.raise_signal(signal.SIGINT)


def test_a_step_put_before_a_signal_interrupted_its_cut_goes_with_the_old_session(
    server: InProcessServer,
    client: KVCoordClient,
    manager: PredictingKVCacheManager,
    sigint_raises: None,
    monkeypatch: Any,
) -> None:
    """The cut raised (KeyboardInterrupt) and kept no flight, but its Step was on the
    queue: the next call reports every request lost and starts a new session. Before,
    that Step still waited at the gate and went after the new session was attached,
    stamped with it: the new session held blocks for a request nobody tracked, and the
    next answer disagreed with the mirror (every request lost again)."""
    sender = manager.sender
    old = manager.session_id
    stamped: list[str] = []
    went = threading.Event()
    send_step = client.send_step

    def recorded(request: Any, *args: Any, **kwargs: Any) -> Any:
        stamped.append(request.session_id)
        try:
            return send_step(request, *args, **kwargs)
        finally:
            went.set()

    monkeypatch.setattr(client, "send_step", recorded)
    sender.gate.max_seconds = BOUND  # the handed-over Step waits until someone opens the gate
    _admit(manager, "a", list(range(20, 29)))
    sender.inbox._queue = InterruptedAfterPut(sender.inbox._queue)  # type: ignore[assignment]
    with pytest.raises(KeyboardInterrupt):
        manager.take_events()  # the Step put, then the interrupt
    assert sender.in_flight is None and sender.failure is not None
    with pytest.raises(RequestsLostError) as lost:
        _bounded(manager.flush, "the flush after the interrupt")
    assert {"warm", "a"} <= set(lost.value.request_ids)
    assert manager.session_id != old
    sender.gate.open()  # (whatever still waits goes now)
    assert went.wait(BOUND), "the Step put was never sent"
    assert stamped == [old], (stamped, old)  # sent once, with the session it was gathered in
    assert held_blocks(client, "gated") == {}  # the old session ended; the new one holds nothing
    _bounded(manager.flush, "a flush in the new session")  # nothing disagreed: nothing to report
    assert sender.failure is None
