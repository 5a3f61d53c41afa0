"""The predicted mode's Gate (flight.py) opened from another thread while the
scheduler's thread shuts it handing a Step over (``StepSender.cut``): real threads, a
real sender thread and a real server; the interleavings forced with events inside the
gate's check-then-act (no sleeps).

The gate's ``open`` and ``shut`` each check, then act. When an open from another
thread falls between ``shut``'s check and its clear, or ``shut`` runs whole between
``open``'s check and its (skipped) set, the open is lost: the gate stays shut. What
bounds it is ``Gate.max_seconds``: the sender thread waits that long at most, then
sends. These tests hold the product to that: whatever the interleaving, the Step
handed over is sent once (the server handles exactly one Step), answered as the
mirror predicted, its flight finished without anyone waiting for it, and the
manager closes cleanly; no thread hangs past the test's bound."""

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


class SteppedEvent(threading.Event):
    """A gate's event whose next ``is_set`` on the armed thread returns its answer only
    once ``go`` is set, after telling ``checked``: that thread's check-then-act is
    held between the check and the act."""

    def __init__(self) -> None:
        super().__init__()
        self.armed: int | None = None
        self.checked = threading.Event()
        self.go = threading.Event()

    def arm(self, thread: int) -> None:
        self.armed = thread

    def is_set(self) -> bool:
        answer = super().is_set()
        if self.armed == threading.get_ident():
            self.armed = None
            self.checked.set()
            assert self.go.wait(BOUND), "the other thread never let the check go on"
        return answer


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


def _in_thread(target: Callable[[], Any]) -> threading.Thread:
    t = threading.Thread(target=target, name="other-opener", daemon=True)
    t.start()
    return t


@pytest.mark.parametrize(
    "order",
    [
        "open-between-shut-check-and-clear",
        "shut-between-open-check-and-set",
        "open-before-shut",
        "open-after-shut",
    ],
)
def test_a_step_handed_over_while_another_thread_opens_goes_once(
    server: InProcessServer, manager: PredictingKVCacheManager, order: str
) -> None:
    sender = manager.sender
    gate = sender.gate
    event = SteppedEvent()
    gate._open = event  # type: ignore[misc]  # (the same Event, its check held where armed)
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
    if order == "open-between-shut-check-and-clear":
        event.arm(main)
        opener = _in_thread(lambda: (event.checked.wait(BOUND), gate.open(), event.go.set()))
        the_step_ends()
    elif order == "shut-between-open-check-and-set":
        holder: list[int] = []
        ready = threading.Event()

        def open_held() -> None:
            holder.append(threading.get_ident())
            event.arm(holder[0])
            ready.set()
            gate.open()

        opener = _in_thread(open_held)
        assert ready.wait(BOUND) and event.checked.wait(BOUND)
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
    # nobody waits for the Step: the sender thread sends it on its own (at most max_seconds late)
    assert answered.wait(BOUND), f"{order}: the Step handed over was never sent"
    in_flight = sender.in_flight
    assert in_flight is not None
    waiter = _in_thread(in_flight.result)  # (the flight is finished right after the answer is checked)
    waiter.join(BOUND)
    assert in_flight.done() and not waiter.is_alive(), f"{order}: the Step's flight never finished"
    if order.startswith(("open-between", "shut-between")):
        assert event.checked.is_set() and event.go.is_set()  # the held interleaving ran
    assert sender.failure is None, sender.failure
    assert len(sent) == 1 and sent[0] != main, sent  # once, on the sender thread
    manager.flush()  # nothing more to send: no second Step
    assert len(sent) == 1, sent
    assert _steps_handled(server) - handled == 1
    assert manager.usage > 0 and "a" in manager.tracker
