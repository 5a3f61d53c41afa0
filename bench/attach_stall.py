"""What an exclusive Attach's engine state (``want_engine_state``: a mirror starting)
costs the calls of other pools: GetStats latency on a small pool while a large pool's
state is exported, against the same calls with nothing else happening. Not a test.

    PYTHONPATH=client:server python bench/attach_stall.py [--blocks 1000000] [--attaches 3]
        [--sources DIR]

One ``kvcoord serve`` process (no journal) with a pool of ``--blocks`` 16-token blocks,
filled by requests with random block hashes that are then freed (their blocks stay in
the prefix cache: the state a mirror loads), and a small pool. A client thread calls
GetStats on the small pool every 2 ms, first for 2 s alone, then while another client
makes ``--attaches`` exclusive Attaches with the engine state (each detached after).
``--sources``: the checkout whose ``client`` and ``server`` the server runs (default:
this one), to compare two builds with one bench.

Printed: p50, p99 and max of GetStats idle and during the Attaches, each Attach's
duration and the size of the state it carried.
"""

from __future__ import annotations

import argparse
import os
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
REQUEST_BLOCKS = 4096


def probe(address: str, stop: threading.Event, out: list[tuple[float, float]]) -> None:
    """GetStats on "small" every 2 ms until ``stop``: (start, latency) pairs."""
    with KVCoordClient(address, timeout=600) as c:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.get_stats("small")
            out.append((t0, time.perf_counter() - t0))
            time.sleep(0.002)


def line(name: str, lat: list[float]) -> str:
    return (
        f"{name:<28} n={len(lat):5d}  p50 {pct(lat, 0.5):8.2f} ms  p99 {pct(lat, 0.99):8.2f} ms"
        f"  max {max(lat) * 1e3:8.2f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=1_000_000)
    ap.add_argument("--attaches", type=int, default=3)
    ap.add_argument("--sources", type=Path, default=ROOT)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvcoord-attach-stall-"))
    port = free_port()
    config = work / "kvcoord.toml"
    config.write_text(
        f'[server]\nlisten = ["127.0.0.1:{port}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n'
        f'durability = "none"\nmax_message_bytes = {1 << 30}\n'
        f"[limits]\nmax_blocks_per_pool = {args.blocks + 1}\nmax_tokens_per_request = {REQUEST_BLOCKS * BS}\n"
        f'[[pools]]\nname = "big"\nnum_blocks = {args.blocks}\nhash_block_size = {BS}\n'
        'hash_algo = "sha256_cbor"\nhash_seed = "0"\nenable_caching = true\n'
        f'[[pools.groups]]\ntype = "full"\nblock_size = {BS}\n'
        f'[[pools]]\nname = "small"\nnum_blocks = 1024\nhash_block_size = {BS}\n'
        f'[[pools.groups]]\ntype = "full"\nblock_size = {BS}\n'
    )
    src = args.sources.resolve()
    log = open(work / "server.log", "wb")  # noqa: SIM115 - closed at the end
    server = serve(config, src, log)
    address = f"127.0.0.1:{port}"
    print(f"sources: {src}; machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} (shared)")
    try:
        wait_serving(address)
        c = KVCoordClient(address, timeout=600, max_message_bytes=1 << 30)
        s = c.attach("big", "sha256_cbor", BS, "0", "fill")
        t0 = time.perf_counter()
        for n in range((args.blocks - 1) // REQUEST_BLOCKS):
            sync = pb.RequestSync(
                request_id=f"r{n}", new_request=True, append_token_ids=[n % 32000] * (REQUEST_BLOCKS * BS),
                append_block_hashes=[os.urandom(32) for _ in range(REQUEST_BLOCKS)],
            )  # fmt: skip
            op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=REQUEST_BLOCKS * BS))
            done = pb.Operation(free=pb.FreeOp(request_id=f"r{n}"))  # computed, finished: stays cached
            c.step("big", [op, done], s.session_id, s.fence)
        c.detach(s.session_id, s.fence)
        print(
            f"filled {args.blocks:,} blocks in {time.perf_counter() - t0:.1f} s; server RSS {rss_mib(server.pid):.0f} MiB"
        )
        idle: list[tuple[float, float]] = []
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(address, stop, idle))
        t.start()
        time.sleep(2.0)
        stop.set()
        t.join()
        busy: list[tuple[float, float]] = []
        stop = threading.Event()
        t = threading.Thread(target=probe, args=(address, stop, busy))
        t.start()
        time.sleep(0.2)
        spans, took, sizes = [], [], []
        for _ in range(args.attaches):
            a0 = time.perf_counter()
            got = c.attach("big", "sha256_cbor", BS, "0", "mirror", exclusive=True, want_pool_state=True,
                           want_engine_state=True)  # fmt: skip
            a1 = time.perf_counter()
            spans.append((a0, a1))
            took.append(a1 - a0)
            sizes.append(len(got.pool_state.engine_state))
            c.detach(got.session_id, got.fence)
            time.sleep(0.3)
        stop.set()
        t.join()
        during = [lat for at, lat in busy if any(a <= at <= b for a, b in spans)]
        print(line("GetStats 'small', idle", [lat for _, lat in idle]))
        print(line("  during the Attaches", during or [0.0]))
        print("Attach with the engine state: " + ", ".join(f"{x * 1e3:.0f} ms" for x in took)
              + f"; state {sizes[0] / (1 << 20):.1f} MiB")  # fmt: skip
        c.close()
    finally:
        server.terminate()
        server.wait(300)
        log.close()


if __name__ == "__main__":
    main()
