"""Drive vLLM's schedulers on kvcoord under faults, on any layout, one engine or two
sharing a pool, under the KV oracle; then the pool's invariants (CheckPool).

Faults (``event``):

- "network": 10 % of the manager's calls (30 % with prediction, which makes few) each
  have their answer dropped, delayed, duplicated or re-delivered late, all the run;
- "lost": at most four times, right after a prefill's allocation, two Steps applied with
  their answers lost past every retry, then four never sent (an outage);
- "sigkill": the server SIGKILLed and restarted on its journal between steps 30 and 31,
  and 0-5 ms into step 70;
- "lostalloc": the same, the first Step lost the one carrying a prefill's allocation;
- "killstep": at most four times, at the Step carrying a prefill's allocation, the server
  SIGKILLed: alternately once it has applied and answered that Step (the answer lost, its
  retry meets the instance restarted on the journal) and just before the Step is sent
  (restarted 0.2 s later); no request may be lost and every decision is vLLM's;
- "detach": another client ends the session between steps 40 and 41 (a lease run out);
- "takeover": between steps 40 and 41 another client ends the session (a lease run out)
  and a second engine of the same client name takes the pool (exclusive, its prefix
  cache reset) holding a request, for 0.5 s of wall time: engine 0's re-attach is
  refused meanwhile (the engine waits), then made;
- "emptied": the server SIGKILLed at step 50 and started with its data directory deleted;
- "partition": from step 60, engine 0's calls fail UNAVAILABLE for 3 x the session lease.

Modes: "shared" (KVCOORD_PREDICT=0, KVCOORD_EXCLUSIVE=0), "exclusive" (waiting,
KVCOORD_EXCLUSIVE=1), "predicted" (KVCOORD_PREDICT=1).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from durable_server import DurableServer
from harness import SCHEDULERS, make_scheduler, run_workload
from kv_oracle import KVOracle
from kvcoord.client import KVCoordClient
from kvcoord.client import vllm as kvcoord_vllm
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.retry import RetryPolicy
from kvcoord.v1 import allocator_pb2 as pb
from layouts_support import layout_configs
from test_lost_answers import METHODS, Scripted, lose_after_prefill
from test_lost_sessions import LEASE, LEASE_TOML, outputs_by_request

_pool_ids = itertools.count()


class Case:
    """One run's parameters and results."""

    def __init__(
        self, kind: str, layout: str, mode: str, event: str, seed: int, *, steps: int = 90, blocks: int = 48,
        speculative: str | None = None, connector: str | None = None, engines: int = 1,
    ) -> None:  # fmt: skip
        self.kind, self.layout, self.mode, self.event, self.seed = kind, layout, mode, event, seed
        self.steps, self.blocks, self.speculative, self.connector, self.engines = (
            steps, blocks, speculative, connector, engines,
        )  # fmt: skip
        self.want: Any = None
        self.want_outputs: Any = None
        self.wants: list[Any] = []
        self.wants_outputs: list[Any] = []
        self.results: list[dict[str, Any]] = []
        self.pool = ""
        self.check: Any = None
        self.stats: Any = None
        self.server_log = ""
        self.injected: dict[str, Any] = {}

    def __repr__(self) -> str:
        return (
            f"Case({self.kind}, {self.layout!r}, {self.mode}, {self.event}, seed={self.seed}, "
            f"spec={self.speculative}, conn={self.connector}, engines={self.engines})"
        )

    def configs(self, model_dir: Path) -> tuple[Any, Any]:
        return layout_configs(self.layout, model_dir, self.blocks, asynchronous=self.kind == "async",
                              speculative=self.speculative, connector=self.connector)  # fmt: skip

    def workload(self, s: Any, on_step: Callable[[int], None] | None = None, engine: int = 0) -> list[Any]:
        """The seeded workload; engine ``e`` > 0 names its requests r<e*100000 + n> (a
        pool's request ids are all its sessions': each engine's own, as vLLM's are)."""
        if engine:
            add = s.add_request

            def add_request(request: Any) -> None:
                request.request_id = f"r{engine * 100000 + int(request.request_id[1:])}"
                add(request)

            s.add_request = add_request
        trace, _ = run_workload(s, seed=self.seed, steps=self.steps, async_overlap=self.kind == "async",
                                aborts=False, drain=True, positional=True, on_step=on_step)  # fmt: skip
        return trace


def vllms_own(case: Case, model_dir: Path) -> None:
    """vLLM's own manager's runs (clean under the oracle), one per engine (their request
    ids): traces and outputs."""
    case.wants, case.wants_outputs = [], []
    for e in range(case.engines):
        s = make_scheduler(SCHEDULERS[case.kind], *case.configs(model_dir))
        oracle = KVOracle(s)
        try:
            case.wants.append(case.workload(s, engine=e))
        finally:
            s.shutdown()
        oracle.assert_clean()
        case.wants_outputs.append(outputs_by_request(case.wants[-1]))
    case.want, case.want_outputs = case.wants[0], case.wants_outputs[0]


class _Lockstep:
    """Two engines' steps alternate (each engine's on_step hands the turn over)."""

    def __init__(self, n: int) -> None:
        self.cond = threading.Condition()
        self.turn = 0
        self.n = n
        self.done = [False] * n
        self.started = [False] * n

    def on_step(self, me: int) -> None:
        with self.cond:
            if self.started[me]:
                self.turn = (me + 1) % self.n
                self.cond.notify_all()
            self.started[me] = True
            assert self.cond.wait_for(
                lambda: self.turn == me or all(self.done[:me] + self.done[me + 1 :]), 600
            )

    def finish(self, me: int) -> None:
        with self.cond:
            self.done[me] = True
            self.turn = (me + 1) % self.n
            self.cond.notify_all()


class KillingScripted(Scripted):
    """:class:`Scripted` with two faults that SIGKILL ``server`` at a chosen Step: "killdrop"
    (the Step applied and answered, then the server killed and restarted on its journal
    before the client hears of the answer: the client's retry, under the same idempotency
    key, reaches the new instance) and "killcut" (the server killed before the Step is
    sent, restarted 0.2 s later: the Step reaches no server until then)."""

    def __init__(self, server: DurableServer) -> None:
        super().__init__()
        self.server = server
        self.restarts: list[threading.Thread] = []
        #: "killdrop" faults that fired (a kill after the server answered)
        self.dropped_kills = 0

    def arm(self, fault: str) -> None:
        """``fault`` for the next Step not faulted yet (queued: the engine runs on while
        the Step of an earlier kill is still retried)."""
        with self._lock:
            self.script.append(fault)

    def draw_message(self, request: Any) -> tuple[str, Any]:
        fault, late = super().draw_message(request)
        if fault == "killdrop":
            # drawn again until it fires: a message drawn on a stream that broke with the
            # last kill never reaches the server (the client resends it on a new stream)
            with self._lock:
                self.script.insert(0, fault)
            self.on_drop = self._restart_now
            return "drop", late
        if fault == "killcut":
            self.restarted()
            self.server.kill()
            self.restarts.append(threading.Thread(target=self._restart_later))
            self.restarts[-1].start()
            return "none", late
        return fault, late

    def _draw(self, item: Any, held: list[Any]) -> tuple[str, Any]:
        """A unary Step's fault (a Step sent while another is on the stream): the same
        script."""
        return self.draw_message(item)

    def _restart_now(self) -> None:
        self.on_drop = None
        with self._lock:
            del self.script[:1]
        self.dropped_kills += 1
        self.restarted()
        self.server.kill()
        self.server.start()

    def restarted(self) -> None:
        """Wait until an earlier "killcut"'s restart is done (one server at a time)."""
        for t in self.restarts:
            t.join(120)

    def _restart_later(self) -> None:
        threading.Event().wait(0.2)
        self.server.start()


def run_on_kvcoord(case: Case, model_dir: Path, tmp_path: Path, mp: pytest.MonkeyPatch) -> None:
    """The workload on kvcoord (``case.engines`` schedulers on one pool) under
    ``case.event``; fills ``case.results`` (per engine: outputs, trace, oracle,
    scheduler, manager, error) and the pool's check and stats after shutdown."""
    from kvcoord.client.vllm_scheduler import KVCoordAsyncScheduler, KVCoordScheduler

    lease = LEASE_TOML if case.event == "partition" else ""
    server = DurableServer(tmp_path, pools_toml=lease)
    server.start()
    case.pool = f"lf-{next(_pool_ids)}"
    predict = case.mode == "predicted"
    mp.setenv("KVCOORD_TARGET", server.address)
    mp.setenv("KVCOORD_POOL", case.pool)
    mp.setenv("KVCOORD_PREDICT", "1" if predict else "0")
    mp.setenv("KVCOORD_EXCLUSIVE", "0" if case.mode == "shared" else "1")
    # a bound on a hang, not the thing tested: a killed server's start took 20-35 s at load
    # 25-30 on 2 cores (durable_server.py), and "killcut" and "sigkill" at step 70 restart it
    # while the engine waits: a 30 s bound could run out (the error raised into vLLM) first
    mp.setenv("KVCOORD_MAX_OUTAGE", "300")
    rate = 0.2 if predict else 0.05
    injectors: list[FaultInjector] = []

    def faulty_client(target: str, **kw: Any) -> KVCoordClient:
        if case.event == "network":
            inj: FaultInjector = FaultInjector(
                case.seed * 7 + len(injectors), drop=rate, delay=rate, duplicate=rate, reorder=rate
            )
            injectors.append(inj)
            return KVCoordClient(target, interceptors=[inj], **kw)
        if case.event in ("lost", "lostalloc"):
            inj = Scripted()
            injectors.append(inj)
            retry = RetryPolicy(max_attempts=2, initial_backoff=0.01, keyed_deadline=None)
            return KVCoordClient(target, interceptors=[inj], retry=retry, **kw)
        if case.event == "killstep":
            inj = KillingScripted(server)
            injectors.append(inj)
            return KVCoordClient(target, interceptors=[inj], **kw)
        if case.event == "partition":
            inj = FaultInjector(0)
            injectors.append(inj)
            return KVCoordClient(target, interceptors=[inj], **kw)
        return KVCoordClient(target, **kw)

    mp.setattr(kvcoord_vllm, "KVCoordClient", faulty_client)
    cls = KVCoordAsyncScheduler if case.kind == "async" else KVCoordScheduler
    lock = threading.Lock()  # (the oracles of engines sharing memory)
    scheds: list[Any] = []
    oracles: list[KVOracle] = []
    mine: list[int] = []  # each engine's injector (its client's)
    try:
        for e in range(case.engines):
            s = make_scheduler(cls, *case.configs(model_dir))
            scheds.append(s)
            mine.append(len(injectors) - 1)
            oracles.append(KVOracle(s, shared=oracles[0] if oracles else None, tag=f"e{e}:"))
            sched_fn = s.schedule

            def locked(fn: Any = sched_fn) -> Any:
                with lock:
                    return fn()

            s.schedule = locked
        step_faults = [_step_faults(case, e, s, injectors[mine[e]] if injectors else None, server)
                       for e, s in enumerate(scheds)]  # fmt: skip
        lockstep = _Lockstep(case.engines)
        errors: list[BaseException | None] = [None] * case.engines
        traces: list[Any] = [None] * case.engines

        def engine(e: int) -> None:
            def on_step(step: int) -> None:
                if case.engines > 1:
                    lockstep.on_step(e)
                step_faults[e](step)

            try:
                traces[e] = case.workload(scheds[e], on_step, engine=e)
            except BaseException as err:  # noqa: BLE001 - reported in the results
                errors[e] = err
            finally:
                lockstep.finish(e)
                scheds[e].shutdown()

        threads = [threading.Thread(target=engine, args=(e,)) for e in range(case.engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(900)
        for e in range(case.engines):
            case.results.append({
                "outputs": outputs_by_request(traces[e]) if traces[e] is not None else None,
                "trace": traces[e], "oracle": oracles[e], "sched": scheds[e], "error": errors[e],
                "manager": scheds[e].kv_cache_manager.remote,
            })  # fmt: skip
        for t in [t for takers in case.injected.get("takers", ()) for t in takers]:
            t.join(60)
        for inj in injectors:
            if isinstance(inj, KillingScripted):
                inj.restarted()
        with KVCoordClient(server.address) as c:
            case.check = list(c.check_pool(case.pool).violations)
            case.stats = c.get_stats(case.pool)
        case.injected.update(counts=[dict(i.counts) for i in injectors], kills=server.kills)
    finally:
        server.stop()
        case.server_log = "".join(
            (tmp_path / f"server-{i}.log").read_text(errors="replace") for i in range(server.starts)
        )


def _step_faults(case: Case, e: int, s: Any, injector: FaultInjector | None, server: DurableServer) -> Any:
    """Engine ``e``'s on_step for ``case.event`` (only engine 0 kills or detaches)."""
    event = case.event
    state: dict[str, Any] = {"armed": False, "prefilled": False, "met": [], "step": -1}
    case.injected.setdefault("met", []).append(state["met"])
    rnd = random.Random(case.seed)
    killers: list[threading.Thread] = []
    takers: list[threading.Thread] = []
    case.injected.setdefault("takers", []).append(takers)

    if event == "killstep":
        kinds = itertools.cycle(["killdrop", "killcut"])

        def start_kill() -> None:
            injector.arm(next(kinds))  # type: ignore[union-attr]

        lose_after_prefill(s.kv_cache_manager, METHODS, state, start_kill, at_the_allocation=True)

    if event in ("lost", "lostalloc"):
        adapter = s.kv_cache_manager
        script = [k for k, n in re.findall(r"(drop|cut)(\d+)", "drop2cut4") for _ in range(int(n))]

        def start_loss() -> None:
            injector.script = list(script)  # type: ignore[union-attr]

        lose_after_prefill(adapter, METHODS, state, start_loss, at_the_allocation=event == "lostalloc")

    def restart(delay: float) -> None:
        threading.Event().wait(delay)
        server.kill()
        server.start()

    def on_step(step: int) -> None:
        state["step"], state["prefilled"] = step, False
        if event in ("lost", "lostalloc", "killstep"):
            met = state["met"]
            if step >= 15 and len(met) < 4 and not state["armed"] and (not met or step >= met[-1][0] + 10):
                state["armed"] = True
        if e != 0:
            return
        if event == "sigkill" and step == 30:
            restart(0)
            state["met"].append(step)
        elif event == "sigkill" and step == 70:
            killers.append(threading.Thread(target=restart, args=(rnd.uniform(0, 0.005),)))
            killers[-1].start()
            state["met"].append(step)
        elif event == "sigkill" and step == 71:
            killers[-1].join(120)
        elif event == "detach" and step == 40:
            manager = s.kv_cache_manager.remote
            if hasattr(manager, "flush"):
                manager.flush()
            with KVCoordClient(server.address) as other:
                other.detach(manager.session_id)
            state["met"].append(step)
        elif event == "takeover" and step == 40:
            takers.append(_take_over(s.kv_cache_manager.remote, server.address, case.pool))
            state["met"].append(step)
        elif event == "partition" and step == 60 and injector is not None:
            injector.partitioned = True
            heal = threading.Timer(3 * LEASE, lambda: setattr(injector, "partitioned", False))
            heal.daemon = True
            heal.start()
            state["met"].append(step)
        elif event == "emptied" and step == 50:
            server.kill()
            shutil.rmtree(server.data_dir)
            server.start()
            state["met"].append(step)

    return on_step


def _take_over(manager: Any, address: str, pool: str) -> threading.Thread:
    """End ``manager``'s session as a lease running out would, then attach a second engine
    of the same client name (exclusive, the prefix cache reset) holding a request of 8
    blocks; it detaches 0.5 s later, on the returned thread."""
    if hasattr(manager, "flush"):
        manager.flush()
    other = KVCoordClient(address)
    other.detach(manager.session_id)
    cfg = other.get_pool(pool).pool.config
    name = f"{os.uname().nodename}:{os.getpid()}"  # (the engine's: KVCOORD_CLIENT_NAME's default)
    got = other.attach(pool, cfg.hash_algo, cfg.hash_block_size, cfg.hash_seed, name, 30, True,
                       profile=cfg.profile, num_hash_lookahead_tokens=cfg.num_hash_lookahead_tokens,
                       reset_prefix_cache=True)  # fmt: skip
    tokens = list(range(128))
    hashes = BlockHasher(cfg.hash_algo, cfg.hash_block_size, none_hash(cfg.hash_algo, cfg.hash_seed)).extend(
        tokens
    )
    sync = pb.RequestSync(
        request_id="taker-1", append_token_ids=tokens, append_block_hashes=hashes, new_request=True
    )
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=128))
    result = other.step(pool, [op], got.session_id, got.fence).results[0]
    assert not result.status_code, result

    def leave() -> None:
        threading.Event().wait(0.5)
        try:
            other.detach(got.session_id, got.fence)
        finally:
            other.close()

    t = threading.Thread(target=leave)
    t.start()
    return t


# gRPC's own wording of a connection it could not make: an UNAVAILABLE call's details end
# "failed to connect to all addresses; last error: UNKNOWN: ipv4:...: Connection refused"
# (the subchannel's last error, not the call's status; a server SIGKILLed does this)
_TRANSPORT_LAST_ERROR = re.compile(r"last error: [A-Z_]+")


def names_a_failed_call(msg: str) -> bool:
    """Whether a log message reports a call that ended INTERNAL or UNKNOWN (a server bug),
    leaving out the transport's "last error" inside an UNAVAILABLE's details."""
    status_words = _TRANSPORT_LAST_ERROR.sub("", msg)
    return "INTERNAL" in status_words or "UNKNOWN" in status_words


def verdict(case: Case, records: list[logging.LogRecord]) -> list[str]:
    """Every problem found: an engine's error, the oracle's violations, outputs other than
    vLLM's own, (network/sigkill, one engine) decisions other than vLLM's own, requests
    lost where nothing should lose them, UNKNOWN/INTERNAL anywhere, the pool's check,
    blocks still held after every engine shut down."""
    problems: list[str] = []
    for e, r in enumerate(case.results):
        if r["error"] is not None:
            problems.append(f"engine {e} raised {type(r['error']).__name__}: {r['error']}")
            continue
        o = r["oracle"]
        if o.violations:
            problems.append(f"engine {e} oracle {o.summary()} first {o.violations[:4]}")
        got, want = r["outputs"], case.wants_outputs[e]
        differ = sorted(rid for rid in want.keys() | got.keys() if got.get(rid) != want.get(rid))
        # (the harness's tokens with the async scheduler's drafts depend on the schedule:
        # vLLM's own repeat and skip positions; a recomputation schedules otherwise)
        if case.kind == "async" and case.speculative and case.event not in ("network", "sigkill", "killstep"):
            differ = [rid for rid in differ if got.get(rid, ([], ""))[1] != "length"]
        if differ:
            problems.append(
                f"engine {e} outputs differ: {[(d, want.get(d), got.get(d)) for d in differ[:3]]}"
            )
        lost = r["manager"].lost_requests if hasattr(r["manager"], "lost_requests") else None
        if case.event in ("network", "sigkill", "killstep") and lost:
            problems.append(f"engine {e} lost {lost} requests on a {case.event} fault")
        if case.engines == 1 and case.event in ("network", "sigkill", "killstep") and r["trace"] != case.want:
            from test_scheduler_equivalence import first_difference

            problems.append(f"engine {e} decisions differ: {first_difference(case.want, r['trace'])}")
    for rec in records:
        msg = rec.getMessage()
        if names_a_failed_call(msg) or (rec.levelno >= logging.ERROR and rec.name.startswith("kvcoord")):
            problems.append(f"log {rec.name} {rec.levelname}: {msg[:300]}")
    for word in ("INTERNAL", "Traceback", "UNKNOWN"):
        if word in case.server_log:
            at = case.server_log.index(word)
            problems.append(f"server log: {case.server_log[max(0, at - 200) : at + 600]}")
    if case.check:
        problems.append(f"CheckPool: {case.check[:5]}")
    if case.stats is not None and case.stats.num_free_blocks != case.blocks - 1:
        problems.append(f"after shutdown {case.blocks - 1 - case.stats.num_free_blocks} blocks still held")
    return problems


def run_case(case: Case, model_dir: Path, tmp_path: Path, caplog: Any = None) -> list[str]:
    """vLLM's own run, then kvcoord's under the fault; the problems found."""
    vllms_own(case, model_dir)
    handler_records: list[logging.LogRecord] = []

    class _Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            handler_records.append(record)

    keep = _Keep(logging.WARNING)
    logging.getLogger("kvcoord").addHandler(keep)
    try:
        with pytest.MonkeyPatch.context() as mp:
            run_on_kvcoord(case, model_dir, tmp_path, mp)
    finally:
        logging.getLogger("kvcoord").removeHandler(keep)
    return verdict(case, handler_records)
