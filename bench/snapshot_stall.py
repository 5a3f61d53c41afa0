"""What a snapshot costs the calls it overlaps: p99, p50 and mean of a small call
(Heartbeat) while a snapshot of ``--tokens`` live tokens is taken, against the same
calls with no snapshot, in one run. Not a test.

    PYTHONPATH=client:server python bench/snapshot_stall.py [--tokens 10000000] [--seconds 8]

One ``kvcoord serve`` process with the journal on (``synchronous = NORMAL``) and one
pool of full attention (16-token blocks, prefix caching on, room for every token). The
bench fills it with requests of ``--request-tokens`` tokens (random hashes: the server
does not recompute them) until ``--tokens`` are live, then:

1. baseline: Heartbeats back to back for ``--seconds``;
2. snapshot: ``snapshot_every`` was set so that the 20th keyed empty Step after the
   fill triggers a snapshot; Heartbeats back to back from that moment until the
   snapshot is in the journal (read from the journal file) and at least ``--seconds``.

Printed per phase: calls, p50, p99, max and mean latency; then how long the snapshot
took to land, and the server's RSS before and during it.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]

from common import free_port, pct, rss_mib, serve, wait_serving  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16
PER_STEP = 8  # allocations per fill Step


def snapshots(path: Path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
    try:
        return int(db.execute("SELECT coalesce(max(seq), 0) FROM snapshots").fetchone()[0])
    finally:
        db.close()


def heartbeats(
    c: KVCoordClient, session: str, fence: pb.Fence, until: threading.Event, floor: float
) -> list[float]:
    """Heartbeats back to back until ``until`` is set and ``floor`` (monotonic) passed."""
    lat = []
    while not until.is_set() or time.monotonic() < floor:
        t0 = time.perf_counter()
        c.heartbeat(session, fence)
        lat.append(time.perf_counter() - t0)
    return lat


def report(name: str, lat: list[float]) -> None:
    print(
        f"{name:<12} {len(lat):7d} calls  p50 {pct(lat, 0.5):8.2f} ms  p99 {pct(lat, 0.99):8.2f} ms"
        f"  max {max(lat) * 1e3:8.2f} ms  mean {statistics.fmean(lat) * 1e3:8.2f} ms",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=10_000_000)
    ap.add_argument("--request-tokens", type=int, default=4096)
    ap.add_argument("--seconds", type=float, default=8.0)
    args = ap.parse_args()

    requests = -(-args.tokens // args.request_tokens)
    fill_steps = -(-requests // PER_STEP)
    num_blocks = requests * (args.request_tokens // BS + 1) + 1024
    # start, limits, create, attach, the fill Steps: the 20th Step after them snapshots
    snapshot_every = 4 + fill_steps + 20
    work = Path(tempfile.mkdtemp(prefix="kvcoord-stall-"))
    port = free_port()
    config = work / "kvcoord.toml"
    config.write_text(
        f'[server]\nlisten = ["127.0.0.1:{port}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n'
        f'data_dir = "{work / "data"}"\nsynchronous = "NORMAL"\nsnapshot_every = {snapshot_every}\n'
        f'[[pools]]\nname = "big"\nnum_blocks = {num_blocks}\nhash_block_size = {BS}\n'
        'hash_algo = "sha256_cbor"\nhash_seed = "0"\nenable_caching = true\n'
        f'[[pools.groups]]\ntype = "full"\nblock_size = {BS}\n'
    )
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed at the end
    server = serve(config, ROOT, log)
    address = f"127.0.0.1:{port}"
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared: figures vary)")
    try:
        wait_serving(address)
        c = KVCoordClient(address, timeout=600)
        s = c.attach("big", "sha256_cbor", BS, "0", "stall")
        t0 = time.perf_counter()
        made = 0
        for _ in range(fill_steps):
            ops = []
            for _ in range(min(PER_STEP, requests - made)):
                sync = pb.RequestSync(
                    request_id=f"r{made}", new_request=True,
                    append_token_ids=[(made * 31 + j) % 32000 for j in range(args.request_tokens)],
                    append_block_hashes=[os.urandom(32) for _ in range(args.request_tokens // BS)],
                )  # fmt: skip
                ops.append(
                    pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=args.request_tokens))
                )
                made += 1
            c.step("big", ops, s.session_id, s.fence)
        stats = c.get_stats("big")
        print(
            f"filled: {made} requests x {args.request_tokens} tokens = {made * args.request_tokens:,} live tokens, "
            f"{stats.num_total_blocks - stats.num_free_blocks:,} blocks used, in {time.perf_counter() - t0:.1f} s; "
            f"server RSS {rss_mib(server.pid):.0f} MiB"
        )
        hb = KVCoordClient(address, timeout=600)
        stop = threading.Event()
        stop.set()
        report("baseline", heartbeats(hb, s.session_id, s.fence, stop, time.monotonic() + args.seconds))
        journal = work / "data" / "journal.sqlite"
        before = snapshots(journal)
        landed = threading.Event()
        during: list[float] = []
        rss_during = [0.0]
        start = time.monotonic()
        measure = threading.Thread(
            target=lambda: during.extend(heartbeats(hb, s.session_id, s.fence, landed, start + args.seconds))
        )
        measure.start()
        for _ in range(20):  # keyed empty Steps: the last one's record starts the snapshot
            c.step("big", [], s.session_id, s.fence)
        for _ in range(100_000):
            if snapshots(journal) != before:
                break
            if time.monotonic() - start > 600:
                raise TimeoutError("no snapshot within 600 s")
            if time.monotonic() - start > 5:  # a kvcoord that counts records otherwise: one more
                c.step("big", [], s.session_id, s.fence)
            rss_during[0] = max(rss_during[0], rss_mib(server.pid))
            time.sleep(0.05)
        took = time.monotonic() - start
        landed.set()
        measure.join()
        report("snapshot", during)
        print(f"the snapshot was in the journal {took:.1f} s after it started; server RSS during it up to "
              f"{rss_during[0]:.0f} MiB; journal file {journal.stat().st_size / (1 << 20):.0f} MiB")  # fmt: skip
        hb.close()
        c.close()
    finally:
        server.terminate()
        server.wait(300)
        log.close()
        print(f"server log: {work / 'server.log'}")


if __name__ == "__main__":
    main()
