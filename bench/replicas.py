"""Pools sharded over replicas, side by side: Step throughput and latency with 1, 2 and
4 replica processes, server CPU per block operation, and the cost of a failover. Not a test.

    PYTHONPATH=client:server python bench/replicas.py [--replicas 1 2 4] [--workers 8] \
        [--running 64] [--seconds 4] [--warmup 1.5] [--lease 3] [--before 2] [--after 10] \
        [--no-scale] [--no-failover] [--verbose]

Needs ``etcd`` on PATH (Debian's etcd-server) and the ``aetcd`` client, as the cluster
tests do (it uses their etcd starters, tests/cluster/etcd_process.py); every process
runs on loopback and is stopped at the end. About 100 s on 2 cores.

**Scale-out.** bench/workers.py's load and worker code, batched mode: ``--workers``
worker processes, each with its own pool and session, each keeping ``--running``
requests in decode (one Step per scheduler step: one slot per running request, frees of
the requests that finish, prefills of the new ones; pools sized so nothing is refused).
Each worker's client is given the whole replica set (comma-separated) and follows
NOT_OWNER to the pool's owner. Rows:

  1, no cluster   one ``kvcoord serve`` without ``[cluster]`` (the baseline)
  N, etcd         N ``kvcoord serve`` processes of one cluster (a fresh 1-member etcd
                  holds membership and ownership; journal "local")

Every server runs ``durability = "none"`` (no disk in the figures, as workers.py's
"none" rows) and metrics off. Pool names are chosen so that each replica owns an equal
share (rendezvous placement over the replica ids), and the row waits until every pool
is listed on the replica placement names before it starts. Per row: block operations/s
and Steps/s summed over workers; p50 / mean / p99 of a Step as a worker sees it; server
CPU per operation (utime + stime of every replica process over the measured window,
over the operations) and the cores the replicas used; the same for the workers; the
machine's busy fraction (every process, others' included); under each clustered row,
the cores etcd used over the whole row.

**Failover.** A 3-member etcd cluster and 3 replicas with ``journal = "store"``
(``lease_seconds = --lease``, local data directories, synchronous NORMAL) run the same
worker load; after ``--before`` s the owner of worker 0's pool is SIGKILLed and the
workers go on for ``--after`` s. Each worker logs every Step (sent, answered, outcome,
attempts) and, through a gRPC client interceptor, every attempt its client made and how
it ended (the client's own retries and NOT_OWNER redirects). Reported per pool: Steps
acknowledged in the run; for the killed owner's pools, the seconds from the kill until
the pool answered the worker again, and until a survivor's ListPools listed it (the
takeover as the servers see it); the longest acknowledged Step after the kill (for
the other pools: what the takeover cost them) and before it; Steps that needed retries;
failed Steps (a worker stops at its first: the outcome of an UNAVAILABLE one is
unknown, a typed error applied nothing). Then every attempt by status, and the check: each worker's
acknowledged allocations (each live request's block ids, accumulated from its
acknowledged answers) against InspectPool on the survivors, and no block held twice.
``--verbose`` lists each failed attempt on the killed owner's pools.

Workers, replicas and etcd share the machine's cores: on 2 cores, 4 replicas cannot use
more than 2, and the workers need about as much CPU per operation as the servers (say so
next to any figure).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
from workers import (
    BARRIER_TIMEOUT,
    ROOT,
    Worker,
    WorkerProcs,
    config_text,
    pool_config,
    run_phase,
    server_cpu,
    worker_blocks,
)

sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "cluster")]
from etcd_process import Etcd, EtcdCluster  # noqa: E402 - the cluster tests' etcd starters
from kvcoord.client import NO_RETRY, KVCoordClient  # noqa: E402
from kvcoord.client.errors import KVCoordError, UnavailableError, error_from_rpc  # noqa: E402
from kvcoord.client.testing import ServerProcess, start_server  # noqa: E402
from kvcoord.service.ownership import Member, owner_of  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "client"), str(ROOT / "server")]))


# ---------------------------------------------------------------------------
# helpers (pure: tests/unit/test_bench_replicas.py)


def placed_pools(prefix: str, replica_ids: list[str], count: int) -> list[str]:
    """``count`` pool names, the ``i``-th placed on ``replica_ids[i % len]`` by the
    cluster's rendezvous rule: each replica owns an equal share (to within one)."""
    members = [Member(r, "") for r in replica_ids]
    wanted = [replica_ids[i % len(replica_ids)] for i in range(count)]
    out: list[str] = []
    n = 0
    for rid in wanted:
        while True:
            name = f"{prefix}{n}"
            n += 1
            if owner_of(name, members).replica_id == rid:  # type: ignore[union-attr]
                out.append(name)
                break
    return out


def back_after(
    steps: list[tuple[float, float, str, int]], at: float
) -> tuple[float | None, float, float] | None:
    """From (sent, answered, outcome, attempts) records: (seconds from ``at`` to the
    pool's first answer after it, the longest acknowledged Step answered after ``at``,
    when that Step was answered, in seconds after ``at``); ``None`` when no Step was
    acknowledged after ``at``. The first answer is the first acknowledged Step sent
    after ``at``, or one in flight at ``at`` that needed more than one attempt (one
    answered at once came from before ``at``); ``None`` in first place without one."""
    after = [(t0, t1, n) for t0, t1, outcome, n in steps if outcome == "ok" and t1 > at]
    if not after:
        return None
    again = [t1 for t0, t1, n in after if t0 >= at or n > 1]
    t0, t1, _ = max(after, key=lambda s: s[1] - s[0])
    return (min(again) - at if again else None), t1 - t0, t1 - at


def compare_pool(acked: dict[str, list[int]], unknown: set[str], found: dict[str, list[int]]) -> list[str]:
    """What is wrong with a pool's ``found`` requests (id -> block ids, as InspectPool
    shows them) against the ``acked`` ones: an acknowledged request missing or with
    other blocks, a request nobody was acknowledged (outside ``unknown``: calls whose
    outcome the worker could not learn), a block held by two requests."""
    problems = [
        f"{rid}: acknowledged {len(blocks)} blocks, found {found.get(rid)!r:.60}"
        for rid, blocks in acked.items()
        if found.get(rid) != blocks
    ]
    problems += [f"{rid}: present, never acknowledged" for rid in sorted(set(found) - set(acked) - unknown)]
    held = Counter(b for ids in found.values() for b in ids)
    problems += [f"block {b} held by {n} requests" for b, n in sorted(held.items()) if n > 1]
    return problems


# ---------------------------------------------------------------------------
# replicas


def replica_config(endpoints: list[str], cluster: str, replica: str, **extra: Any) -> str:
    """A clustered replica's config; ``extra`` goes into ``[cluster]`` (strings quoted)."""
    listed = ", ".join(f'"{e}"' for e in endpoints)
    lines = [f"endpoints = [{listed}]", f'name = "{cluster}"', f'replica_id = "{replica}"']
    lines += [f"{k} = {v!r}".replace("'", '"') for k, v in extra.items()]
    return "\n".join(["[cluster]", *lines]) + "\n"


@contextmanager
def replicas(configs: list[str]) -> Iterator[list[ServerProcess]]:
    """One ``kvcoord serve`` process per config, stopped at the end."""
    procs: list[ServerProcess] = []
    try:
        for text in configs:
            procs.append(start_server(text, env=ENV, startup_timeout=60))
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait_placed(address: str, pools: list[str], owners: list[str], timeout: float = 60.0) -> None:
    """Create the pools (sized for one worker) and wait until ``pools[i]`` is listed as
    served by ``owners[i]`` (every replica has joined and the claims have settled)."""
    running = ARGS.running
    deadline = time.monotonic() + timeout
    want = dict(zip(pools, owners, strict=True))
    got: dict[str, str] = {}
    with KVCoordClient(address, timeout=10) as c:
        for name in pools:
            c.create_pool(name, pool_config(worker_blocks(running)))
        while time.monotonic() < deadline:
            try:
                got = {p.name: p.replica for p in c.list_pools().pools if p.name in want}
            except KVCoordError:
                got = {}
            if got == want:
                return
            time.sleep(0.2)
    raise RuntimeError(f"pools not placed after {timeout:g} s: want {want}, listed {got}")


# ---------------------------------------------------------------------------
# scale-out


def scale_row(label: str, address: str, pids: list[int], pools: list[str], etcd: int = 0) -> dict[str, float]:
    """One row: run_phase's batched load; ``etcd``: the store's pid (its CPU over the
    whole row, warm-up included, is printed after the row)."""
    e0, t0 = (server_cpu(etcd), time.monotonic()) if etcd else (0.0, 0.0)
    m = run_phase(address, pids, pools, "batched", ARGS)
    print(
        f"{label:<16} {m['ops_s']:9.0f} {m['calls_s']:8.0f} {m['ops_call']:8.1f} {m['p50']:8.2f} "
        f"{m['mean']:8.2f} {m['p99']:8.2f} {m['srv_us']:9.1f} {m['srv_cores']:9.2f} "
        f"{m['wrk_us']:9.1f} {m['wrk_us'] * m['ops_s'] / 1e6:9.2f} {m['busy']:5.0%}",
        flush=True,
    )
    if etcd:
        print(f"{'':16} etcd used {(server_cpu(etcd) - e0) / (time.monotonic() - t0):.2f} cores (whole row)")
    return m


def scale_out(tmp: Path) -> None:
    print(
        f"\n== scale-out: {ARGS.workers} workers x {ARGS.running} running requests, one pool each, "
        f"{ARGS.seconds:g} s measured after {ARGS.warmup:g} s warm-up"
    )
    print(
        f"{'replicas':<16} {'ops/s':>9} {'Steps/s':>8} {'ops/Step':>8} {'p50 ms':>8} {'mean ms':>8} "
        f"{'p99 ms':>8} {'srv µs/op':>9} {'srv cores':>9} {'wrk µs/op':>9} {'wrk cores':>9} {'busy':>5}"
    )
    pools = [f"solo-w{i}" for i in range(ARGS.workers)]
    server = start_server(config_text("none", "", "NORMAL"), env=ENV)
    try:
        scale_row("1, no cluster", server.address, [server.proc.pid], pools)
    finally:
        server.stop()
    etcd = Etcd(tmp)
    try:
        for n in ARGS.replicas:
            ids = [f"r{i}" for i in range(n)]
            pools = placed_pools(f"n{n}-w", ids, ARGS.workers)
            base = config_text("none", "", "NORMAL")
            configs = [base + replica_config([etcd.endpoint], f"bench-n{n}", r) for r in ids]
            with replicas(configs) as procs:
                targets = ",".join(p.address for p in procs)
                wait_placed(targets, pools, [ids[i % n] for i in range(len(pools))])
                scale_row(f"{n}, etcd", targets, [p.proc.pid for p in procs], pools, etcd.proc.pid)
    finally:
        etcd.stop()


# ---------------------------------------------------------------------------
# failover


class AttemptLog(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Counts every attempt the client makes, by RPC and how it ended (OK, or the
    typed error it maps to): the client's own retries and redirects included."""

    def __init__(self) -> None:
        self.attempts: Counter[str] = Counter()
        self.calls = 0  # attempts so far
        #: (when, what) of each failed attempt (``--verbose`` prints the killed owner's)
        self.failures: list[tuple[float, str]] = []

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        outcome = continuation(details, request)
        self.calls += 1
        rpc = details.method.rsplit("/", 1)[-1]
        code = outcome.code()
        if code == grpc.StatusCode.OK:
            self.attempts[f"{rpc} OK"] += 1
        else:
            err = error_from_rpc(outcome, rpc)
            self.failures.append((time.monotonic(), f"{err} {getattr(err, 'owner', '')}"[:160]))
            self.attempts[
                f"{rpc} {type(err).__name__} ({code.name}{', ' + err.reason if err.reason else ''})"
            ] += 1
        return outcome


class FailoverWorker(Worker):
    """workers.py's worker, logging each Step (sent, answered, outcome, attempts) and
    keeping what was acknowledged: each live request's block ids (accumulated from its
    answers) and the requests whose outcome it could not learn. It stops after its
    first Step that did not apply in full (its local view of the requests is then
    wrong); what the server answered for that Step is still recorded."""

    def __init__(self, idx: int, address: str, pool: str, running: int, seed: int, log: AttemptLog) -> None:
        super().__init__(idx, address, pool, running, seed, interceptors=(log,))
        self.log = log
        self.acked: dict[str, list[int]] = {}
        self.unknown: set[str] = set()
        self.steps: list[tuple[float, float, str, int]] = []

    def run_logged(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            ops = self.step_ops()
            tried = self.log.calls
            t0 = time.monotonic()
            try:
                resp = self.client.step(self.pool, ops, self.session, self.fence)
            except KVCoordError as exc:
                self.steps.append((t0, time.monotonic(), type(exc).__name__, self.log.calls - tried))
                if isinstance(exc, UnavailableError):  # outcome unknown (retries ran out)
                    for op in ops:
                        rid = request_of(op)
                        self.acked.pop(rid, None)
                        self.unknown.add(rid)
                return  # a typed error: nothing applied, the acknowledged state stands
            t1 = time.monotonic()
            outcome = "ok"
            for op, res in zip(ops, resp.results, strict=True):
                rid = request_of(op)
                if res.status_code != 0:  # not applied, nor is anything after it (ABORTED)
                    if outcome == "ok":
                        outcome = f"operation {pb.ErrorReason.Name(res.reason) or res.status_code}"
                elif op.HasField("free"):
                    self.acked.pop(rid, None)
                elif res.allocate.refused or res.allocate.stale_hit:
                    outcome = "refused (pool too small)"
                    self.acked.pop(rid, None)
                    self.unknown.add(rid)
                else:
                    self.acked.setdefault(rid, []).extend(res.allocate.new_block_ids[0].block_ids)
            self.steps.append((t0, t1, outcome, self.log.calls - tried))
            if outcome != "ok":
                return


def request_of(op: Any) -> str:
    return str(op.free.request_id if op.HasField("free") else op.allocate.request.request_id)


def failover_worker(
    idx: int, targets: str, pool: str, running: int, warmup: float, seconds: float, barrier: Any, results: Any
) -> None:
    try:
        log = AttemptLog()
        w = FailoverWorker(idx, targets, pool, running, 2000 + idx, log)
        w.run_logged(time.monotonic() + warmup)
        w.steps.clear()
        log.attempts.clear()
        log.failures.clear()
        barrier.wait(BARRIER_TIMEOUT)
        w.run_logged(time.monotonic() + seconds)
        w.client.close()
        results.put((idx, None, w.steps, dict(log.attempts), w.acked, sorted(w.unknown), log.failures))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        barrier.abort()
        results.put((idx, f"{type(exc).__name__}: {exc}", [], {}, {}, [], []))


def failover(tmp: Path) -> None:
    ids = ["r0", "r1", "r2"]
    print(
        f'\n== failover: 3 replicas, journal = "store" on a 3-member etcd, lease {ARGS.lease} s; '
        f"{ARGS.workers} workers x {ARGS.running} running; the owner of worker 0's pool is "
        f"SIGKILLed {ARGS.before:g} s into the run, which goes on {ARGS.after:g} s"
    )
    (tmp / "etcd3").mkdir()
    store = EtcdCluster(tmp / "etcd3")
    try:
        configs = []
        for r in ids:
            data = tmp / f"data-{r}"
            server = f'[server]\nlog_level = "WARNING"\nmetrics_listen = ""\ndata_dir = "{data}"\nsynchronous = "NORMAL"\n'
            configs.append(
                server
                + replica_config(
                    store.endpoints,
                    "bench-failover",
                    r,
                    lease_seconds=ARGS.lease,
                    store_timeout_seconds=1.0,
                    journal="store",
                )  # fmt: skip
            )
        with replicas(configs) as procs:
            _failover_run(procs, ids)
    finally:
        store.stop()


def watch_takeover(
    survivors: list[str], pools: list[str], since: float, seconds: float
) -> dict[str, tuple[float, str]]:
    """Poll each survivor's ListPools (one attempt each, every 0.1 s) until every pool
    in ``pools`` is listed: pool -> (seconds after ``since``, the replica serving it)."""
    seen: dict[str, tuple[float, str]] = {}
    clients = [KVCoordClient(a, timeout=1, retry=NO_RETRY) for a in survivors]
    try:
        deadline = time.monotonic() + seconds
        while len(seen) < len(pools) and time.monotonic() < deadline:
            for c in clients:
                try:
                    listed = c.list_pools().pools
                except KVCoordError:
                    continue
                now = time.monotonic()
                for info in listed:
                    if info.name in pools and info.name not in seen:
                        seen[info.name] = (now - since, info.replica)
            time.sleep(0.1)
    finally:
        for c in clients:
            c.close()
    return seen


def _failover_run(procs: list[ServerProcess], ids: list[str]) -> None:
    targets = ",".join(p.address for p in procs)
    pools = placed_pools("fo-w", ids, ARGS.workers)
    owners = [ids[i % len(ids)] for i in range(len(pools))]
    wait_placed(targets, pools, owners)
    victim = owners[0]
    hit = [i for i, o in enumerate(owners) if o == victim]
    workers = WorkerProcs(
        failover_worker,
        ARGS.workers,
        lambda i: (targets, pools[i], ARGS.running, ARGS.warmup, ARGS.before + ARGS.after),
    )
    broken: BaseException | None = None
    try:
        try:
            workers.barrier.wait(BARRIER_TIMEOUT)
        except threading.BrokenBarrierError as exc:  # a worker failed: its report says why
            broken = exc
        else:
            time.sleep(ARGS.before)
            dead = procs[ids.index(victim)]
            dead.proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            dead.proc.wait(10)
            alive = [p.address for p in procs if p.proc.poll() is None]
            served = watch_takeover(alive, [pools[i] for i in hit], killed, ARGS.after)
        got = workers.gather(ARGS.after + 120, broken)  # a Step in flight may retry for 90 s
    finally:
        workers.reap()
    survivors = ",".join(p.address for p in procs if p.proc.poll() is None)
    print(f"killed {victim} (owner of {', '.join(pools[i] for i in hit)})")
    print(
        f"{'pool':<8} {'owner':<6} {'Steps':>6} {'answers again after s':>22} {'longest Step s (answered at)':>28} {'before kill':>11} "
        f"{'retried Steps':>13} {'most attempts':>13} {'listed again after s':>20}  failed"
    )
    for i in range(len(pools)):
        steps = got[i][2]
        back = back_after(steps, killed)
        failed = [s[2] for s in steps if s[2] != "ok"]
        again = f"{back[0]:22.2f}" if back and back[0] is not None and i in hit else f"{'-':>22}"
        longest = f"{f'{back[1]:.2f} ({back[2]:.2f})':>28}" if back else f"{'never':>28}"
        before = max(
            (t1 - t0 for t0, t1, outcome, _ in steps if outcome == "ok" and t1 <= killed), default=0.0
        )
        retried = sum(1 for s in steps if s[3] > 1)
        most = max((s[3] for s in steps), default=0)
        listed = served.get(pools[i])
        where = f"{listed[0]:.2f} on {listed[1]}" if listed else ("never" if i in hit else "-")
        print(
            f"{pools[i]:<8} {owners[i]:<6} {len(steps):6d} {again} {longest} {before:11.2f} {retried:13d} {most:13d} "
            f"{where:>20}  {', '.join(failed) or '-'}"
        )
    attempts: Counter[str] = Counter()
    for g in got:
        attempts.update(g[3])
    print("attempts by the workers' clients (each retry and redirect counted), after the warm-up:")
    for what, n in sorted(attempts.items()):
        print(f"  {n:7d}  {what}")
    if ARGS.verbose:
        for i in hit:
            print(f"failed attempts of {pools[i]}'s worker (seconds after the kill):")
            for at, what in got[i][6]:
                print(f"  {at - killed:7.2f}  {what}")
    print("check (InspectPool on the survivors, every pool):")
    bad = 0
    with KVCoordClient(survivors, timeout=30) as c:
        for i, pool in enumerate(pools):
            acked, unknown = got[i][4], got[i][5]
            view = c.inspect_pool(pool, all_requests=True)
            found = {r.request_id: list(r.groups[0].block_ids) for r in view.requests}
            problems = compare_pool(acked, set(unknown), found)
            bad += len(problems)
            print(
                f"  {pool:<8} {len(acked):4d} acknowledged requests, {len(found):4d} present, "
                f"{len(unknown):3d} of unknown outcome: {'OK' if not problems else 'WRONG: ' + '; '.join(problems[:5])}"
            )
            c.delete_pool(pool)
    print(
        f"every acknowledged allocation present, no block held twice: {'yes' if not bad else f'NO ({bad} problems)'}"
    )


# ---------------------------------------------------------------------------


ARGS = argparse.Namespace()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--running", type=int, default=64, help="running requests per worker (ops per Step)")
    ap.add_argument("--seconds", type=float, default=4.0, help="measured time per scale-out row")
    ap.add_argument("--warmup", type=float, default=1.5, help="per worker, before the measured time")
    ap.add_argument("--lease", type=int, default=3, help="failover: the replicas' lease_seconds")
    ap.add_argument("--before", type=float, default=2.0, help="failover: seconds before the kill")
    ap.add_argument("--after", type=float, default=10.0, help="failover: seconds after the kill")
    ap.add_argument("--no-failover", action="store_true")
    ap.add_argument("--no-scale", action="store_true")
    ap.add_argument(
        "--verbose", action="store_true", help="failover: each failed attempt on the killed owner's pools"
    )
    ARGS.__dict__.update(vars(ap.parse_args()))
    print(
        f"machine: {os.cpu_count()} CPUs ({len(os.sched_getaffinity(0))} usable), Python "
        f"{sys.version.split()[0]}; replicas, etcd and {ARGS.workers} workers share them"
    )
    print("load average (1, 5, 15 min) at start: " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    tmp = Path(tempfile.mkdtemp(prefix="kvcoord-bench-replicas-"))
    started = time.monotonic()
    try:
        if not ARGS.no_scale:
            scale_out(tmp)
        if not ARGS.no_failover:
            failover(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nwhole run {time.monotonic() - started:.0f} s; load average at the end: "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )


if __name__ == "__main__":
    main()
