"""How long a small call on one pool waits while another pool does something large
(every pool of a server shares one event loop). Not a test.

    python bench/stall.py [--scenarios step alloc lifecycle] [--rounds 3] [--old REV]
        [--step-ops 65536] [--step-tokens 80] [--alloc-blocks 65536] [--blocks 5000000]
        [--piece-bytes N]

A server process (journal in a temporary directory, ``synchronous = NORMAL``) serves a
small pool and a large one. A client in a process of its own calls GetStats on the
small pool every 2 ms and times each answer; another client meanwhile, ``--rounds`` times:

  step       sends one Step of ``--step-ops`` operations to the large pool, each
             registering a request of ``--step-tokens`` tokens and allocating its
             blocks (65,536 x 80 tokens: about 15 MB, sent in pieces of at most
             ``--piece-bytes``, 1 MiB by default, 0: one message), then frees them
  alloc      allocates ``--alloc-blocks`` blocks to one request in one operation,
             then frees it
  lifecycle  creates a pool of ``--blocks`` blocks, fills it with 65,536-block
             allocations and deletes it

Printed per scenario (and per code with ``--old``): p50 / p99 / max of the probe's
latency while the large call runs (the Step or allocation alone: the Free after it is
outside the window), next to the idle server's, and how long the large call took; then
the server's own loop probe (bench/loop_probe.py: a task on the server's event loop
waking every millisecond notes the loop thread's CPU time since its previous wake-up)
over the same window: the longest such stretch and their p99. CPU time, not wall time:
a busy machine delays the probe but does not lengthen the stretches. ``--old REV`` runs the same on a server of git revision REV's code in turns
(old, new, old, new, ...), so a busy machine slows both alike.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from common import old_tree  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.step_pieces import DEFAULT_STEP_PIECE_BYTES  # noqa: E402
from kvcoord.client.testing import ServerProcess, start_server  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402
from loop_probe import read as read_probe  # noqa: E402

BS = 16


def pool_config(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS,
        max_model_len=0,
    )


def probe(address: str, stop: Any, out: list[tuple[float, float]], ready: Any = None) -> None:
    """GetStats on "small" every 2 ms: (start, seconds) of each."""
    with KVCoordClient(address, timeout=600) as c:
        while not stop.is_set():
            t0 = time.monotonic()
            c.get_stats("small")
            out.append((t0, time.monotonic() - t0))
            if ready is not None:
                ready.set()
            time.sleep(0.002)


def _probe_process(address: str, stop: Any, ready: Any, send: Any) -> None:
    samples: list[tuple[float, float]] = []
    probe(address, stop, samples, ready)
    send.send(samples)


class Prober:
    """:func:`probe` in a process of its own: in this one the large call's client (15 MB
    serialized) would hold the GIL the probe's calls need, and count as the server's
    delay. Times are ``time.monotonic`` (one clock for every process)."""

    def __init__(self, address: str) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        ready = ctx.Event()
        self.recv, send = ctx.Pipe(duplex=False)
        self.proc = ctx.Process(target=_probe_process, args=(address, self.stop, ready, send), daemon=True)
        self.proc.start()
        if not ready.wait(120):
            raise RuntimeError("the probe process did not start")

    def samples(self) -> list[tuple[float, float]]:
        """Stop probing; the probe's (start, seconds) pairs."""
        self.stop.set()
        out: list[tuple[float, float]] = self.recv.recv()
        self.proc.join(60)
        return out


def held(path: str, windows: list[tuple[float, float]]) -> str:
    """The server loop's stretches (loop_probe.py) noted within ``windows``: count,
    p99 and longest."""
    xs = sorted(dt for at, dt in read_probe(path) if any(t0 <= at <= t1 + 0.002 for t0, t1 in windows))
    if not xs:
        return "loop held: no wake-ups"
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return (
        f"loop held (CPU between 1 ms wake-ups): n={len(xs)} p99={p99 * 1e3:.2f} ms max={xs[-1] * 1e3:.2f} ms"
    )


def summary(xs: list[float]) -> str:
    if not xs:
        return "n=    0"
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(len(xs) * 0.99))]
    return (
        f"n={len(xs):5d} p50={statistics.median(xs) * 1e3:7.2f} ms p99={p99 * 1e3:8.2f} ms "
        f"max={xs[-1] * 1e3:8.2f} ms"
    )


def big_step(c: KVCoordClient, session: str, ops: int, tokens: int, rnd: int) -> tuple[float, float]:
    step = [
        pb.Operation(
            allocate=pb.AllocateOp(
                request=pb.RequestSync(
                    request_id=f"s{rnd}-{i}",
                    new_request=True,
                    append_token_ids=[(i * 7919 + k * 131) % 32000 for k in range(tokens)],
                ),
                num_new_tokens=tokens,
            )
        )
        for i in range(ops)
    ]
    t0 = time.monotonic()
    answer = c.step("big", step, session)
    t1 = time.monotonic()
    if any(r.status_code or r.allocate.refused for r in answer.results):
        raise RuntimeError("the large Step was refused: pool too small")
    time.sleep(0.2)
    c.free("big", [f"s{rnd}-{i}" for i in range(ops)], session_id=session)
    return t0, t1


def big_alloc(c: KVCoordClient, session: str, blocks: int, rnd: int) -> tuple[float, float]:
    sync = pb.RequestSync(request_id=f"a{rnd}", new_request=True, append_token_ids=[1] * (blocks * BS))
    op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=blocks * BS))
    t0 = time.monotonic()
    answer = c.step("big", [op], session)
    t1 = time.monotonic()
    if answer.results[0].allocate.refused:
        raise RuntimeError("the large allocation was refused: pool too small")
    time.sleep(0.2)
    c.free("big", [f"a{rnd}"], session_id=session)
    return t0, t1


def lifecycle(c: KVCoordClient, blocks: int) -> tuple[float, float]:
    t0 = time.monotonic()
    c.create_pool("huge", pool_config(blocks))
    sid = c.attach("huge", "", BS, "").session_id
    per_request = 65_536  # 1,048,576 tokens: [limits] max_tokens_per_request
    for i in range((blocks - 1) // per_request):
        sync = pb.RequestSync(request_id=f"r{i}", append_token_ids=[1] * (per_request * BS), new_request=True)
        c.step(
            "huge", [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=per_request * BS))], sid
        )
    c.delete_pool("huge")
    time.sleep(1.0)  # the teardown runs on the loop in slices meanwhile
    return t0, time.monotonic()


def run(
    server: ServerProcess, scenario: str, args: argparse.Namespace, rnd: int
) -> tuple[list[float], float, tuple[float, float]]:
    """One large call while the probe runs: the probe's latencies, the call's time and
    its window (time.monotonic)."""
    with KVCoordClient(server.address, timeout=600, step_piece_bytes=args.piece_bytes) as c:
        session = c.attach("big", "", BS, "").session_id
        prober = Prober(server.address)
        time.sleep(0.1)
        if scenario == "step":
            t0, t1 = big_step(c, session, args.step_ops, args.step_tokens, rnd)
        elif scenario == "alloc":
            t0, t1 = big_alloc(c, session, args.alloc_blocks, rnd)
        else:
            t0, t1 = lifecycle(c, args.blocks)
        samples = prober.samples()
        c.detach(session)
    # the probes that started while the large call ran (or waited on it)
    return [dt for at, dt in samples if t0 <= at <= t1 or (at < t0 < at + dt)], t1 - t0, (t0, t1)


def idle(server: ServerProcess) -> tuple[list[float], tuple[float, float]]:
    prober = Prober(server.address)
    t0 = time.monotonic()
    time.sleep(1.0)
    samples = prober.samples()
    return [dt for _, dt in samples], (t0, time.monotonic())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--scenarios", nargs="+", choices=("step", "alloc", "lifecycle"), default=["step", "alloc"]
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--old", metavar="REV", help="also run the server of git revision REV, in turns")
    ap.add_argument("--step-ops", type=int, default=65_536)
    ap.add_argument("--step-tokens", type=int, default=80)
    ap.add_argument("--alloc-blocks", type=int, default=65_536)
    ap.add_argument(
        "--piece-bytes", type=int, default=DEFAULT_STEP_PIECE_BYTES,
        help="the large call's client's step_piece_bytes (0: the Step in one message, as older clients send it)",
    )  # fmt: skip
    ap.add_argument("--blocks", type=int, default=5_000_000, help="lifecycle: the created pool's blocks")
    args = ap.parse_args()
    print(
        f"machine: {os.cpu_count()} CPUs, load average {', '.join(f'{x:.2f}' for x in os.getloadavg())} "
        "(shared: other processes slow every figure)"
    )
    trees = {"new": ROOT}
    if args.old:
        trees = {"old": old_tree(args.old), "new": ROOT}
    tmp = tempfile.mkdtemp(prefix="kvcoord-stall-")
    big_blocks = max(args.step_ops * (-(-args.step_tokens // BS)), args.alloc_blocks) + 16
    servers: dict[str, ServerProcess] = {}
    try:
        for code, tree in trees.items():
            text = (
                f'[server]\nlog_level = "WARNING"\nmetrics_listen = ""\ndata_dir = "{tmp}/data-{code}"\n'
                f'synchronous = "NORMAL"\nmax_message_bytes = 67108864\n'
                # a Step of the old code may hold the loop longer than a default lease
                "max_session_lease_seconds = 3600\nsession_lease_seconds = 3600\nidempotency_window_seconds = 7200\n"
                f"[limits]\nmax_blocks_per_pool = {max(args.blocks, big_blocks) + 1}\n"
            )
            env = dict(os.environ, PYTHONPATH=f"{tree / 'client'}:{tree / 'server'}")
            probe_out = f"{tmp}/probe-{code}.bin"
            launcher = (sys.executable, str(ROOT / "bench" / "loop_probe.py"), probe_out)
            servers[code] = server = start_server(text, env=env, launcher=launcher)
            with KVCoordClient(server.address, timeout=600) as c:
                c.create_pool("small", pool_config(1024))
                c.create_pool("big", pool_config(big_blocks))
        for code, server in servers.items():
            lat, window = idle(server)
            time.sleep(0.3)  # the probe's last notes written
            print(f"{code:<4} GetStats on 'small', idle server:      {summary(lat)}")
            print(f"{code:<4}   {held(f'{tmp}/probe-{code}.bin', [window])}")
        for scenario in args.scenarios:
            got: dict[str, list[float]] = {code: [] for code in servers}
            took: dict[str, list[float]] = {code: [] for code in servers}
            windows: dict[str, list[tuple[float, float]]] = {code: [] for code in servers}
            for rnd in range(args.rounds):
                for code, server in servers.items():
                    lat, seconds, window = run(server, scenario, args, rnd)
                    got[code] += lat
                    took[code].append(seconds)
                    windows[code].append(window)
            time.sleep(0.3)  # the probes' last notes written
            what = {
                "step": f"a Step of {args.step_ops:,} ops x {args.step_tokens} tokens",
                "alloc": f"one {args.alloc_blocks:,}-block allocation",
                "lifecycle": f"create, fill, delete a {args.blocks:,}-block pool",
            }[scenario]
            for code in servers:
                print(
                    f"{code:<4} while {what}: {summary(got[code])}; the call took "
                    + ", ".join(f"{x * 1e3:.0f}" for x in took[code])
                    + " ms"
                )
                print(f"{code:<4}   {held(f'{tmp}/probe-{code}.bin', windows[code])}")
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        if args.old:
            shutil.rmtree(trees["old"], ignore_errors=True)


if __name__ == "__main__":
    main()
