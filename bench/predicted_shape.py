"""What the "predicted" step shape would cost, measured before it is built. Not a test.

    python bench/predicted_shape.py [--running 16 64 256] [--steps 200] [--warmup 300] [--rounds 3]

``bench/README.md`` ("Why the 1.2 x target is not met") names the one step shape that
could meet issue 9's item 2: an exclusive client answers every call itself from a
replica of the pool (free queue, prefix-cache map, tables), sends what it did to the
server without waiting, and the server's answers are compared with its own afterwards.
This script measures that shape's cost with a stand-in for the replica, before anyone
writes the replica:

  in-process   kvcoord's engine called directly (bench/step.py's baseline)
  predicted    the same engine, in the client, answers every call (the replica's
               stand-in: a client replica does the same work, in the same Python); each
               call is also built into the operation the real client would send (syncs
               through the client's RequestTracker, decode allocations as columns of one
               AllocateRunOp, first allocations as AllocateOp with their hit, lookups as
               answered lookups, frees), and the step's operations go to a real server
               as one Step from a background thread, at most one Step in flight (the
               next step's send waits for the previous answer); every answer's block ids
               are compared with the engine's, and a difference stops the run
  no-op RTT    an empty Step round trip, sampled in a burst before and after the
               predicted row (a probe between steps would let the in-flight Step finish
               untimed, hiding its cost)

Each round runs both rows and prints the ratio predicted / (in-process + RTT); the
median over rounds is the figure. What this leaves out, so what a real implementation
adds: the replica's own bookkeeping beyond the engine's (none expected), KV events and
statistics made in the client (the engine's are used here), and the failure handling of
a pipelined Step (a failed Step found one step late: its requests and the next step's
are reported lost).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]

from common import freeze_heap, pct  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.batch import Run  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.client.tracking import RequestTracker  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402
from step import BS, NONE, LocalManager, Req, pool_config, run  # noqa: E402


class Predicted(LocalManager):
    """The engine answers; every call is also carried to the server, one Step per
    scheduler step, sent without waiting and checked when the next one is sent."""

    def __init__(self, num_blocks: int, client: KVCoordClient, pool: str, max_backlog: int) -> None:
        super().__init__(num_blocks)
        self.client, self.pool_name = client, pool
        self.tracker = RequestTracker(client.get_pool(pool).pool.config, NONE)
        self.session = client.attach(pool, "sha256_cbor", BS, "0", "predicted", 0, True)
        self.ops: list[pb.Operation] = []
        #: per op: the new block ids the engine gave (None: nothing to compare)
        self.expected: list[Any] = []
        self.run_: Run | None = None
        self.run_ids: list[tuple[int, ...]] = []
        self.sender = concurrent.futures.ThreadPoolExecutor(1)
        self.in_flight: concurrent.futures.Future[None] | None = None
        self.steps_sent = 0
        #: scheduler steps whose operations wait for the Step in flight to be answered
        self.backlog = 0
        self.max_backlog = max_backlog
        self.waited = 0.0

    def _close_run(self) -> None:
        if self.run_ is not None:
            self.ops.append(self.run_.op())
            self.expected.append((self.run_, self.run_ids))
            self.run_, self.run_ids = None, []

    def get_computed_blocks(self, r: Req) -> tuple[Any, int]:
        hit, n = super().get_computed_blocks(r)
        self._close_run()
        op = pb.Operation()
        self.tracker.sync(r, op.lookup.request)
        op.lookup.answered.groups.extend(pb.BlockIds(block_ids=g) for g in hit.block_ids)
        op.lookup.answered.num_tokens = n
        self.ops.append(op)
        self.expected.append(None)
        return hit, n

    def allocate_slots(self, r: Req, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        new = super().allocate_slots(r, n, hit_tokens, hit)
        if new is None:
            return None  # refused: changes nothing; the next sync carries its tokens
        fields = None if hit_tokens else self.tracker.sync_run(r)
        if fields is not None:
            if self.run_ is None:
                self.run_ = Run(1, lambda: None)
            self.run_.add(r.request_id, fields, n, 0, None, None)
            self.run_ids.append(new[0])
            return new
        self._close_run()
        op = pb.Operation()
        a = op.allocate
        self.tracker.sync(r, a.request)
        a.num_new_tokens = n
        a.must_succeed = True
        if hit_tokens:
            a.num_new_computed_tokens = hit_tokens
            a.new_computed_blocks.groups.extend(pb.BlockIds(block_ids=g) for g in hit.block_ids)
            a.new_computed_blocks.num_tokens = hit_tokens
        self.ops.append(op)
        self.expected.append(new)
        return new

    def free(self, r: Req) -> None:
        super().free(r)
        self._close_run()
        self.tracker.forget([r.request_id])
        self.ops.append(pb.Operation(free=pb.FreeOp(request_id=r.request_id)))
        self.expected.append(None)

    def take_events(self) -> list[Any]:
        self.send()
        return super().take_events()

    def send(self) -> None:
        """This step's operations as one Step, once the previous one is answered."""
        self._close_run()
        self.backlog += 1
        if self.in_flight is not None:
            if not self.in_flight.done() and self.backlog <= self.max_backlog:
                return  # coalesced into the next Step
            t0 = time.perf_counter()
            self.in_flight.result()  # raises what the previous answer's check found
            self.waited += time.perf_counter() - t0
        self.backlog = 0
        ops, expected = self.ops, self.expected
        self.ops, self.expected = [], []
        if ops:
            self.in_flight = self.sender.submit(self._step, ops, expected)
            self.steps_sent += 1

    def _step(self, ops: list[pb.Operation], expected: list[Any]) -> None:
        s = self.session
        resp = self.client.step(self.pool_name, ops, s.session_id, s.fence, include_state=True)
        for i, (result, want) in enumerate(zip(resp.results, expected, strict=True)):
            if result.status_code:
                raise AssertionError(f"op {i} failed on the server: {result.status_message}")
            if want is None:
                continue
            if isinstance(want, tuple) and isinstance(want[0], Run):
                run_, ids = want
                if run_.answered(result.allocate_run) is None:
                    raise AssertionError("a run's answer does not fit it")
                got = [tuple(run_.ids_of(k)[0]) for k in range(len(ids))]
                if got != [tuple(x) for x in ids]:
                    raise AssertionError("the server gave a run other block ids than the client's engine")
            elif tuple(tuple(g.block_ids) for g in result.allocate.new_block_ids) != tuple(
                tuple(g) for g in want
            ):
                raise AssertionError(f"op {i}: the server gave other block ids than the client's engine")

    def close(self) -> None:
        self.send()
        if self.in_flight is not None:
            self.in_flight.result()
        self.sender.shutdown()
        self.client.detach(self.session.session_id, self.session.fence)


def noop_rtt(client: KVCoordClient, pool: str, n: int = 200) -> float:
    """p50 of ``n`` empty Step round trips (ms)."""
    s = client.attach(pool, "sha256_cbor", BS, "0")
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.step(pool, [], s.session_id, s.fence, include_state=True)
        times.append(time.perf_counter() - t0)
    client.detach(s.session_id, s.fence)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--max-backlog", type=int, default=8,
        help="scheduler steps whose operations may wait for the Step in flight (0: one Step per step)",
    )  # fmt: skip
    args = ap.parse_args()
    server = start_server("", env=dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}"))
    try:
        client = KVCoordClient(server.address, timeout=60)
        client.create_pool("noop", pool_config(64))
        print(f"{'running':>7} {'round':>5} {'in-proc':>8} {'predicted':>9} {'p99':>7} {'RTT':>6} "
              f"{'ratio':>6} {'waited/step':>11} {'steps/Step':>5}")  # fmt: skip
        for n in args.running:
            blocks = n * 4600 // BS + 1
            total = args.steps + args.warmup
            ratios = []
            for rnd in range(args.rounds):
                lm = LocalManager(blocks)
                freeze_heap()
                base_t, base_d = run(lm, n, total, seed=n)
                base = statistics.median(base_t[args.warmup :]) * 1e3
                name = f"pred-{n}-{rnd}"
                client.create_pool(name, pool_config(blocks))
                pm = Predicted(blocks, client, name, args.max_backlog)
                rtt_before = noop_rtt(client, "noop")
                freeze_heap()
                t, d = run(pm, n, total, seed=n)
                pm.close()
                rtt = statistics.median([rtt_before, noop_rtt(client, "noop")])
                client.delete_pool(name)
                assert d == base_d, "the predicted run decided otherwise than in-process"
                med = statistics.median(t[args.warmup :]) * 1e3
                ratio = med / (base + rtt)
                ratios.append(ratio)
                print(f"{n:>7} {rnd:>5} {base:8.2f} {med:9.2f} {pct(t[args.warmup:], 0.99):7.2f} {rtt:6.3f} "
                      f"{ratio:6.2f} {pm.waited / total * 1e3:9.3f}ms {total / pm.steps_sent:5.1f}")  # fmt: skip
            print(f"{n:>7} median ratio predicted / (in-process + RTT): {statistics.median(ratios):.2f}")
        print("every Step's block ids equal the client's engine's; decisions equal in-process")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
