"""The lease clock (lease_clock.py): the monotonic clock less the server's pauses, a gap
between two reads longer than the pause gap; and a session table counted on it. Driven by
a ManualClock: each ``advance`` between two reads is a gap the server saw."""

from __future__ import annotations

import asyncio

import pytest
from kvcoord.service.errors import ErrorReason, ServiceError
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.lease_clock import PAUSE_GAP_SECONDS, TICK_SECONDS, LeaseClock, keep_ticking
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from support import wire_pool_config
from test_reservation_leases_travel import reserve_prompt


def _ticking(raw: ManualClock, tick: float = 0.1, gap: float = 0.5) -> LeaseClock:
    clock = LeaseClock(raw, tick, gap)
    clock.ticking = True
    return clock


def _run(clock: LeaseClock, raw: ManualClock, seconds: float, step: float = 0.1) -> float:
    """The server runs ``seconds``, its clock read every ``step``: the last reading."""
    now = clock()
    for _ in range(round(seconds / step)):
        raw.advance(step)
        now = clock()
    return now


def test_gaps_up_to_the_pause_gap_count_as_time() -> None:
    raw = ManualClock()
    clock = _ticking(raw)
    assert clock() == raw()
    for step in (0.1, 0.3, 0.49, 0.05):  # up to the pause gap (0.5 s): time
        raw.advance(step)
        assert clock() == raw()
    assert clock.pauses == 0 and clock.paused == 0.0


def test_a_longer_gap_is_a_pause_counted_less_the_tick_by_the_first_read_after_it() -> None:
    raw = ManualClock()
    clock = _ticking(raw)
    before = clock()
    raw.advance(5.0)  # stopped 5 s: the first read after it (any caller) counts it
    assert clock() == pytest.approx(before + 0.1)
    assert clock.pauses == 1 and clock.paused == pytest.approx(4.9)
    raw.advance(0.2)
    assert clock() == pytest.approx(before + 0.3)  # and time runs on after it
    raw.advance(0.51)
    assert clock() == pytest.approx(before + 0.4) and clock.pauses == 2


def test_a_peek_counts_no_pause_and_leaves_the_next_read_to_count_it() -> None:
    """peek (a pool rebuilt on a thread reads the clock so, store_rebuild.py): the time
    less the pauses counted so far; a gap before it is not counted by it, and it does
    not hide that gap from the loop's next read."""
    raw = ManualClock()
    clock = _ticking(raw)
    before = clock()
    raw.advance(5.0)
    assert clock.peek() == pytest.approx(before + 5.0) and clock.pauses == 0
    assert clock() == pytest.approx(before + 0.1) and clock.pauses == 1  # the loop's read counts it
    raw.advance(0.2)
    assert clock.peek() == pytest.approx(before + 0.3) == clock()


def test_it_never_runs_faster_than_the_monotonic_clock() -> None:
    raw = ManualClock()
    clock = _ticking(raw)
    last_raw, last = raw(), clock()
    for step in (0.1, 2.0, 0.1, 0.6, 0.4, 30.0, 0.1):
        raw.advance(step)
        now = clock()
        assert 0 <= now - last <= raw() - last_raw
        last_raw, last = raw(), now


def test_gaps_before_it_ticks_are_time() -> None:
    """At start-up nothing reads it regularly (a recovery's replay, no listener yet):
    a gap then is not a pause; the restart grace, set on the monotonic clock, would
    otherwise be lengthened by it."""
    raw = ManualClock()
    clock = LeaseClock(raw)
    raw.advance(5.0)
    assert clock() == raw() and clock.pauses == 0


def test_keep_ticking_reads_it_every_tick_and_stops_counting_when_cancelled() -> None:
    reads: list[bool] = []

    class Recorded(LeaseClock):
        def __call__(self) -> float:
            reads.append(self.ticking)
            return super().__call__()

    clock = Recorded(tick=0.01, gap=0.5)

    async def main() -> None:
        task = asyncio.get_running_loop().create_task(keep_ticking(clock))
        await asyncio.sleep(0.2)
        assert clock.ticking
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert reads[0] is False and reads.count(True) >= 3  # the first read, then every tick
    assert not clock.ticking


def test_tick_must_be_below_the_gap() -> None:
    with pytest.raises(ValueError, match="tick"):
        LeaseClock(ManualClock(), 0.5, 0.5)
    assert 0 < TICK_SECONDS < PAUSE_GAP_SECONDS


def _expired(table: SessionTable, session_id: str) -> bool:
    try:
        table.get(session_id)
    except ServiceError as err:
        assert err.reason is ErrorReason.SESSION_EXPIRED
        return True
    return False


def test_a_session_renewed_before_a_pause_outlives_it() -> None:
    """Lease 5 s, renewed; the server stops 20 s. A renewal read after it finds its
    session live (the monotonic clock: past its lease, SESSION_EXPIRED), and neither the
    reaper nor a listing ends it."""
    raw = ManualClock()
    clock = _ticking(raw)
    table = SessionTable(clock, 5.0, 5.0)
    s = table.open("p", "w", 5.0)
    _run(clock, raw, 4.0)
    table.renew(s)
    raw.advance(20.0)  # paused
    assert table.expired() == []  # the reaper first: nothing lapsed
    assert table.get(s.session_id) is s
    table.renew(s)
    ((listed, left),) = table.listing("p")
    assert listed is s and left == pytest.approx(5.0)
    plain = SessionTable(raw, 5.0, 5.0)  # the same on the monotonic clock: ended
    p = plain.open("p", "w", 5.0)
    raw.advance(20.0)
    assert _expired(plain, p.session_id)


def test_a_dead_clients_session_ends_one_lease_of_running_time_after_its_last_renewal() -> None:
    """Its client dies after a renewal; the server then stops 20 s. The session ends
    once 5 s of running time passed since that renewal (the pause, less a tick, added),
    and not before: never earlier than on the monotonic clock."""
    raw = ManualClock()
    clock = _ticking(raw)
    table = SessionTable(clock, 5.0, 5.0)
    s = table.open("p", "w", 5.0)
    renewed_at = raw()
    _run(clock, raw, 2.0)
    raw.advance(20.0)  # paused: 19.9 s counted
    _run(clock, raw, 2.8)
    assert table.expired() == [] and table.sessions  # 2.0 + 0.1 + 2.8 = 4.9 s of running time
    raw.advance(0.2)
    assert clock() - renewed_at == pytest.approx(5.1)  # (no pause before: the clocks agreed then)
    assert table.expired() == [s]
    assert raw() - renewed_at == pytest.approx(5.1 + 19.9)  # the lease and the pause, no more


def test_reservations_and_kept_answers_wait_out_a_pause_as_sessions_do() -> None:
    """What the reaper ages besides sessions is counted on the same clock, as a server
    wires it (server.py): a router's reservation (read through the session table's
    clock) and a kept answer's window (the idempotency store) do not run down while the
    server is stopped, and run out once their time of running passed."""
    raw = ManualClock()
    clock = _ticking(raw)
    registry = PoolRegistry(Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 10.0, 1 << 20),
                            "i", clock=raw)  # fmt: skip
    rid = reserve_prompt(registry, 10.0)
    service = registry.pools["p"]
    store = registry.idempotency
    store.remember("s", "Step", "k", b"digest", b"answer")
    raw.advance(30.0)  # paused, longer than both
    store.expire()
    assert service.expired_reservations() == []
    assert store.lookup("s", "Step", "k", b"digest") == b"answer"
    _run(clock, raw, 10.0)
    assert service.expired_reservations() == [rid]
    assert store.lookup("s", "Step", "k", b"digest") is None  # the window ran out


def test_a_grace_set_after_pauses_lasts_as_long_as_it_was_set_for() -> None:
    """The restart grace is set on the registry's monotonic clock (a restore proven
    while serving extends it: journal_behind.py): compared with the lease clock, every
    pause since the start lengthened it (old code: after a 20 s pause, a 5 s grace
    still refused an Attach GRACE_PERIOD 5.1 s later, for another 19.8 s)."""
    raw = ManualClock()
    clock = _ticking(raw)
    registry = PoolRegistry(Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 10.0, 1 << 20),
                            "i", clock=raw)  # fmt: skip
    registry.create("p", wire_pool_config(16))
    service = registry.pools["p"]
    raw.advance(20.0)  # paused: 19.9 s counted
    _run(clock, raw, 1.0)
    service.grace_until = raw() + 5.0  # as journal_behind.py extends it
    _run(clock, raw, 4.9)
    with pytest.raises(ServiceError) as refused:
        service.attach("sha256_cbor", 4, "0", "w", 0)
    assert refused.value.reason is ErrorReason.GRACE_PERIOD
    _run(clock, raw, 0.2)
    assert service.attach("sha256_cbor", 4, "0", "w", 0).session_id
