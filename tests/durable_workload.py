"""A scheduler-like worker that checks, every step, that the server still holds exactly
the blocks it was given (used by the SIGKILL chaos test and the container test)."""

from __future__ import annotations

import random
import time
import traceback
from typing import Any

from kvcoord.client import KVCoordClient, RemoteKVCacheManager, TLSOptions
from kvcoord.client.errors import GracePeriodError, LeaseExpiredError, RequestsLostError, UnavailableError
from kvcoord.client.retry import RetryPolicy
from workload import SHARED_PREFIXES_SEED, Req

#: Retries that outlast a server restart (a few seconds) for keyed and read calls.
PATIENT = RetryPolicy(initial_backoff=0.05, max_backoff=0.5, deadline=90.0, max_attempts=400)


def _same(mine: list[list[int]], server: tuple[list[int], ...]) -> bool:
    """Group 0 (full attention) exactly; other groups may have released blocks (0)."""
    if len(mine) != len(server) or mine[0] != list(server[0]):
        return False
    for a, b in zip(mine[1:], server[1:], strict=True):
        if len(a) != len(b) or any(y not in (0, x) for x, y in zip(a, b, strict=True)):
            return False
    return True


class _Holdings:
    """Every worker's live full-attention blocks, shared between worker processes (a
    ``multiprocessing.Manager().dict()``: worker id -> (block ids, lease end on the
    monotonic clock, which all processes of one machine share)). A block newly given
    to one worker while another still holds it under a running lease is a block held
    by two live requests: the violation the restore and grace rules exist to prevent.
    A worker withdraws blocks before freeing them, so a free never looks like one."""

    def __init__(self, shared: Any, wid: int) -> None:
        self.shared = shared
        self.wid = wid
        #: the last events of this worker (monotonic time, what), kept for a failure's report
        self.trail: list[str] = []
        #: losses, grace refusals, outages and doubles (fewer, kept longer than the trail)
        self.events: list[str] = []

    def note(self, what: str, event: bool = False) -> None:
        line = f"{time.monotonic():.3f} {what}"
        self.trail.append(line)
        del self.trail[:-40]
        if event:
            self.events.append(line)
            del self.events[:-80]

    def publish(self, tables: dict[str, list[list[int]]], lease_end: float, why: str = "step") -> None:
        if self.shared is not None:
            owners = {b: rid for rid, t in tables.items() for b in t[0] if b}
            self.shared[self.wid] = (owners, lease_end, f"{time.monotonic():.3f} {why}")
            self.note(
                f"publish {why}: {len(owners)} blocks of {len(tables)} requests, lease end {lease_end:.3f}"
            )

    def taken_from_others(self, new_ids: list[int]) -> list[tuple[int, int]]:
        """(block, other worker) for each new block another live worker holds."""
        if self.shared is None:
            return []
        now = time.monotonic()
        clashes = []
        for other, (ids, lease_end, why) in dict(self.shared).items():
            if other != self.wid and lease_end > now:
                clashes += [(b, other) for b in new_ids if b in ids]
                both = {b: ids[b] for b in new_ids if b in ids}
                if both:
                    self.note(
                        f"DOUBLE: {both} of worker {other} (published {why}), lease end {lease_end:.3f}", True
                    )
        return clashes


def run_checked_worker(
    address: str,
    pool: str,
    wid: int,
    seed: int,
    stop: Any,
    out: Any,
    tls: TLSOptions | None = None,
    progress: Any = None,
    holdings: Any = None,
    phase: Any = None,
) -> None:
    """Admit, prefill, decode, preempt on refusal and free, until ``stop`` is set; after
    every step compare the block table of each running request with the server's.
    Puts a summary on ``out`` (``error`` is empty when nothing went wrong). ``progress``
    (a shared ``multiprocessing.Value``, optional) counts the steps checked so far.

    With ``phase`` (a shared ``multiprocessing.Value``), requests reported lost
    (RequestsLostError: a restore was detected, the grace period) are dropped and
    counted per phase in ``lost_by_phase`` instead of ending the worker (those the
    client's own lease check declared, LeaseExpiredError: no renewal it sent was answered
    for 0.95 x the lease, e.g. across a server restart slower than that, also in
    ``unproven_by_phase``: the server lost nothing, the client could not prove it did
    not); with
    ``holdings`` (a shared dict, :class:`_Holdings`) every newly given block is checked
    against the blocks other live workers hold (``double`` lists any)."""
    rnd = random.Random(seed)
    prefix_rnd = random.Random(SHARED_PREFIXES_SEED)
    prefixes = [[prefix_rnd.randrange(30000) for _ in range(n)] for n in (32, 64, 100)]
    summary: dict[str, Any] = {
        "worker": wid, "allocs": 0, "checks": 0, "steps": 0, "lost": 0, "error": "",
        "lost_by_phase": {}, "unproven_by_phase": {}, "lost_causes": [], "double": [],
    }  # fmt: skip
    tables: dict[str, list[list[int]]] = {}
    held = _Holdings(holdings, wid)
    live: list[Req] = []
    running: list[Req] = []

    def forget(request_ids: list[str], cause: Exception) -> None:
        lost = set(request_ids)
        drop_lost(live, running, tables, lost)
        key = int(phase.value)
        summary["lost_by_phase"][key] = summary["lost_by_phase"].get(key, 0) + len(lost)
        if isinstance(cause, LeaseExpiredError):
            summary["unproven_by_phase"][key] = summary["unproven_by_phase"].get(key, 0) + len(lost)

    try:
        with KVCoordClient(address, timeout=20, retry=PATIENT, tls=tls) as client:
            m = RemoteKVCacheManager(client, pool, hash_seed="0", client_name=f"chaos-{wid}")
            step = 0
            while not stop.is_set() and step < 100_000:
                step += 1
                try:
                    _one_step(m, rnd, prefixes, wid, step, live, running, tables, summary, held)
                except RequestsLostError as err:
                    if phase is None:
                        raise
                    forget(err.request_ids, err.cause)
                    summary["lost_causes"].append(
                        f"{int(phase.value)}: {type(err.cause).__name__}: {err.cause.message[:160]}"
                    )
                    held.note(
                        f"lost {sorted(err.request_ids)} in phase {int(phase.value)}: {type(err.cause).__name__}: "
                        f"{err.cause.message[:200]}; still held: {sorted(tables)}",
                        True,
                    )
                    held.publish(tables, 0.0, "lost")
                    continue
                except GracePeriodError:
                    if phase is None:
                        raise
                    if not held.trail or "grace" not in held.trail[-1]:
                        held.note(f"grace refused in phase {int(phase.value)}", True)
                    time.sleep(0.1)
                    continue
                except UnavailableError:
                    # the server down between two of the chaos run's restarts, met by the
                    # Detach that starts a lost session again (an unkeyed mutation: retried
                    # only while never sent, within PATIENT; then session.py raises it, the
                    # next call tries again, Detach first). The step stopped where it was:
                    # the manager rolled the failed call back, the worker's requests are
                    # as each answered call left them (test_durable_workload_budget.py)
                    if phase is None:
                        raise
                    summary["unavailable"] = summary.get("unavailable", 0) + 1
                    held.note(f"unavailable in phase {int(phase.value)}; held: {sorted(tables)}", True)
                    time.sleep(0.1)
                    continue
                fence = m.keeper.fence
                held.publish(
                    tables,
                    m.keeper.valid_until,
                    f"w{wid} step {step} fence {fence.instance_id[:8]}@{fence.position}",
                )
                summary["steps"] = step
                if progress is not None:
                    progress.value = step
            held.publish({}, 0.0)
            for r in live:
                m.free(r)
            summary["lost"] = m.lost_requests
            m.close()
    except Exception as exc:  # reported to the parent, which fails the test
        summary["error"] = f"{type(exc).__name__}: {exc}"
        summary["where"] = traceback.format_exc()  # (which call: the parent prints it)
    summary["trail"] = held.trail  # (printed with the reports: the last events, a failure's context)
    summary["events"] = held.events
    out.put(summary)


def drop_lost(
    live: list[Req], running: list[Req], tables: dict[str, list[list[int]]], lost: set[str]
) -> None:
    """The worker's requests reported lost are preempted: no table, nothing computed, to
    be admitted again (recomputed)."""
    for r in [r for r in live if r.request_id in lost]:
        tables.pop(r.request_id, None)
        r.running, r.num_computed_tokens = False, 0
        if r in running:
            running.remove(r)


def _scheduled(r: Req, n: int, budget: int, hit_tokens: int) -> int:
    """``n``, the tokens the step schedules for ``r``; one it cannot schedule (0: a
    scheduler never allocates nothing) fails the worker naming the request and its counts."""
    if n <= 0:
        raise AssertionError(
            f"request {r.request_id}: {n} new tokens scheduled (running {r.running}, computed "
            f"{r.num_computed_tokens} of {len(r.all_token_ids)} tokens, hit {hit_tokens}, budget {budget}, "
            f"decode_left {r.decode_left}, preemptions {r.num_preemptions})"
        )
    return n


def _one_step(
    m: RemoteKVCacheManager,
    rnd: random.Random,
    prefixes: list[list[int]],
    wid: int,
    step: int,
    live: list[Req],
    running: list[Req],
    tables: dict[str, list[list[int]]],
    summary: dict[str, Any],
    held: _Holdings,
) -> None:
    """One scheduler step of :func:`run_checked_worker`, then the check of every table."""
    if len(live) < 6 and rnd.random() < 0.6:
        body = [rnd.randrange(30000) for _ in range(rnd.randint(8, 200))]
        live.append(Req(f"w{wid}-{step}", rnd.choice(prefixes) + body, rnd.randint(2, 12)))
    budget = 256
    for r in list(live):
        if budget <= 0:
            break  # (a request that finished skipped the check at the end of the loop)
        if r.running:
            n = _scheduled(r, min(len(r.all_token_ids) - r.num_computed_tokens, budget), budget, 0)
            new = m.allocate_slots(r, n)
            if new is not None:
                for g, ids in enumerate(new.get_block_ids()):
                    tables[r.request_id][g].extend(ids)
        else:
            hit, hit_tokens = m.get_computed_blocks(r)
            n = _scheduled(r, min(len(r.all_token_ids) - hit_tokens, budget), budget, hit_tokens)
            new = m.allocate_slots(r, n, hit_tokens, hit)
            if new is not None:
                r.num_computed_tokens = hit_tokens
                tables[r.request_id] = [
                    list(h) + list(x) for h, x in zip(hit.get_block_ids(), new.get_block_ids(), strict=True)
                ]
        if new is None:
            if running:
                victim = running.pop()
                tables.pop(victim.request_id, None)
                held.publish(tables, m.keeper.valid_until)  # withdrawn before the free
                m.free(victim)
                victim.running = False
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
            continue
        summary["double"] += held.taken_from_others(list(new.get_block_ids()[0]))
        summary["allocs"] += 1
        if not r.running:
            r.running = True
            running.append(r)
        r.num_computed_tokens += n
        budget -= n
        if r.num_computed_tokens == len(r.all_token_ids):
            if r.decode_left == 0:
                tables.pop(r.request_id, None)
                held.publish(tables, m.keeper.valid_until)
                m.free(r)
                live.remove(r)
                running.remove(r)
                continue
            r.decode_left -= 1
            r.all_token_ids = r.all_token_ids + [rnd.randrange(30000)]
        if budget <= 0:
            break
    # every acknowledged allocation is still there, exactly
    with m.batch() as b:
        pending = {r.request_id: b.get_block_ids(r.request_id) for r in running}
    for rid, p in pending.items():
        got = p.result()
        if not _same(tables[rid], got):
            raise AssertionError(f"request {rid}: acknowledged {tables[rid]}, server holds {got}")
        summary["checks"] += 1


def steps_on(progress: list[Any], workers: list[Any]) -> None:
    """Wait until every live worker (a process of :func:`run_checked_worker`, its
    ``progress`` Value) has checked a step more: a kill after it begins an outage of its
    own (back to back, a loaded machine's slow restarts make one outage of several).
    Bounded: a worker stuck fails; one that ended reports why."""
    start = [p.value for p in progress]
    for _ in range(3000):  # 0.05 s each
        if all(p.value > s or not w.is_alive() for p, s, w in zip(progress, start, workers, strict=True)):
            return
        time.sleep(0.05)
    raise AssertionError(f"a worker checked no step in 150 s: {start} -> {[p.value for p in progress]}")


def run_slow_watcher(address: str, pool: str, pause: float, stop: Any, out: Any) -> None:
    """A KV router that reads ``pool``'s WatchEvents stream slowly (``pause`` seconds per
    event), resuming after each server restart from its cursor and fence; reports what it
    read: events, gaps and resets told, reconnections, and the first error that was not
    a restart's."""
    from kvcoord.client.errors import KVCoordError

    seen = {"events": 0, "gaps": 0, "resets": 0, "reconnects": 0, "backwards": 0, "error": ""}
    cursor, fence = 0, None
    try:
        while not stop.is_set():
            try:
                with KVCoordClient(address, timeout=5) as c:
                    for item in c.watch_events(pool, cursor, timeout=5.0, fence=fence):
                        if item.reset:
                            seen["resets"] += 1
                        elif item.sequence <= cursor:
                            seen["backwards"] += 1  # a resumed stream must move forward
                        seen["gaps"] += item.gap
                        seen["events"] += 1
                        cursor, fence = item.sequence, item.fence
                        if stop.is_set():
                            break
                        time.sleep(pause)
            except KVCoordError as exc:  # the server restarting (UNAVAILABLE, CANCELLED)
                if type(exc).__name__ not in ("UnavailableError", "InternalError"):
                    seen["error"] = f"{type(exc).__name__}: {exc}"
                    break
                time.sleep(0.2)
            seen["reconnects"] += 1
    finally:
        out.put(seen)
