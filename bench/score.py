"""ScorePools and the vLLM-format KV event publisher, measured.

Scoring: a 4,096-token prompt (16-token blocks) is scored across 1, 16 and 64 pools of
four layouts (full attention; full + sliding window; full + sliding window with larger
blocks; full with EAGLE), half of which hold the prompt's first 2,048 tokens, each
pool with 4,096 blocks. "in-process" calls the plain scoring function on the server's
pools (what the handler runs); "wire" sends ScorePools over gRPC on loopback to a
server in another process (the client hashes nothing: the hashed prompt is built
once, as a router would per request, and that hashing is timed apart).

Events: one pool with a [[kv_events]] publisher; a client allocates and frees
128-token requests with shared prefixes, while 0, 1 or 16 ZMQ subscribers (in a process
of their own) decode every batch; events per second are the events each subscriber
received over the run's wall time, and the requests allocated show whether the
subscribers slowed the pool.

    python bench/score.py                 # about a minute
    python bench/score.py --samples 2000

Needs the zmq extra (pyzmq, msgspec) for the events part.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]

from common import freeze_heap, pct  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client.routing import hash_prompt  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

G = pb.KVCacheGroupSpec
PROMPT_TOKENS = 4096
BLOCK = 16

LAYOUTS = {
    "full": [G(full=pb.FullAttentionSpec(block_size=BLOCK))],
    "hybrid": [
        G(full=pb.FullAttentionSpec(block_size=BLOCK)),
        G(sliding_window=pb.SlidingWindowSpec(block_size=BLOCK, sliding_window=1024)),
    ],
    "hybrid-32": [
        G(full=pb.FullAttentionSpec(block_size=32)),
        G(sliding_window=pb.SlidingWindowSpec(block_size=32, sliding_window=512)),
    ],
    "eagle": [G(full=pb.FullAttentionSpec(block_size=BLOCK))],
}


def pool_config(layout: str, num_blocks: int = 4096) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=LAYOUTS[layout],
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=True,
        use_eagle=layout == "eagle",
        max_model_len=8192,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


def start_server(config_text: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp / "kvcoord.toml"
    cfg.write_text(
        f'[server]\nlisten = ["127.0.0.1:{port}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n{config_text}'
    )
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcoord.service.cli", "serve", "--config", str(cfg)], env=env
    )
    address = f"127.0.0.1:{port}"
    with KVCoordClient(address, timeout=5) as c:
        for _ in range(200):
            try:
                c.list_pools()
                break
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.05)
    return proc, address


def fill(client: KVCoordClient, name: str, cfg: pb.PoolConfig, prefix: list[int]) -> None:
    """Cache ``prefix`` in the pool (a request allocates it and is freed)."""
    prompts = hash_prompt([pb.PoolInfo(name=name, config=cfg)], prefix)
    r = client.attach(name, "sha256_cbor", BLOCK, "0")
    sync = pb.RequestSync(
        request_id="fill",
        append_token_ids=prefix,
        append_block_hashes=prompts[0].block_hashes,
        new_request=True,
    )
    client.allocate(name, pb.AllocateOp(request=sync, num_new_tokens=len(prefix), lookup=True), r.session_id)
    client.free(name, ["fill"], session_id=r.session_id)
    client.detach(r.session_id)


def _score_local(pools: Any, names: list[str], prompts: Any, n: int, samples: int) -> list[float]:
    """The scoring function itself, ``samples`` times (run on the server's loop)."""
    from kvcoord.service.scoring import score_pools

    freeze_heap()
    out = []
    for _ in range(samples):
        t = time.perf_counter()
        r = score_pools(pools, lambda _: True, names, PROMPT_TOKENS, prompts)
        out.append(time.perf_counter() - t)
    assert len(r.scores) == n and r.scores[0].hit.num_tokens >= 2032, r.scores[0]
    return out


def _reader(ctx: Any, port: int, stop: Any, counts: list[int], i: int) -> None:
    """A subscriber counting the events it receives."""
    import msgspec
    import zmq

    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv")
    sock.connect(f"tcp://127.0.0.1:{port}")
    while not stop.is_set():
        if sock.poll(100):
            _, _, payload = sock.recv_multipart()
            counts[i] += len(msgspec.msgpack.decode(payload)[1])
    sock.close(linger=0)


def _readers(port: int, subs: int, stop: Any, out: Any) -> None:
    """``subs`` subscribers in a process of their own (not competing with the client
    that drives the pool for one interpreter lock); their counts go to ``out``."""
    import zmq

    ctx = zmq.Context.instance()
    counts = [0] * subs
    threads = [threading.Thread(target=_reader, args=(ctx, port, stop, counts, i)) for i in range(subs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.put(counts)


def bench_scoring(samples: int) -> None:
    from kvcoord.service.convert import prompts_from_pb
    from kvcoord.service.testing import InProcessServer

    rnd = random.Random(1)
    prompt = [rnd.randrange(30000) for _ in range(PROMPT_TOKENS)]
    t0 = time.perf_counter()
    n_hash = 20
    for _ in range(n_hash):
        hashed = hash_prompt([pb.PoolInfo(name="x", config=pool_config("full"))], prompt)
    print(f"hashing the 4,096-token prompt (256 blocks, sha256_cbor), client side: "
          f"{(time.perf_counter() - t0) / n_hash * 1e3:.2f} ms")  # fmt: skip
    print()
    print("| pools | where | p50 ms | p99 ms | mean ms |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for n in (1, 16, 64):
        layouts = list(LAYOUTS)
        names = [f"s{i}-{layouts[i % len(layouts)]}" for i in range(n)]
        tmp = Path(tempfile.mkdtemp())
        proc, address = start_server("", tmp)
        local = InProcessServer("")
        local.start()
        try:
            with (
                KVCoordClient(address, timeout=30) as remote,
                KVCoordClient(local.address, timeout=30) as near,
            ):
                for i, name in enumerate(names):
                    cfg = pool_config(layouts[i % len(layouts)])
                    for c in (remote, near):
                        c.create_pool(name, cfg)
                        if i % 2 == 0:  # half hold the prompt's first half
                            fill(c, name, cfg, prompt[:2048])
                pools = {p.name: p for p in remote.list_pools().pools if p.name in names}
                hashed = hash_prompt(pools.values(), prompt)
                # in-process: the scoring function on the server's own pools, on its loop
                reg = local.running.servicer.registry  # type: ignore[union-attr]
                wire_prompts = prompts_from_pb(hashed)

                local_times = local.call(
                    functools.partial(_score_local, reg.pools, names, wire_prompts, n, samples)
                )
                wire_times = []
                for _ in range(min(samples, 50)):  # warm up
                    remote.score_pools(PROMPT_TOKENS, hashed, names)
                for _ in range(samples):
                    t = time.perf_counter()
                    remote.score_pools(PROMPT_TOKENS, hashed, names)
                    wire_times.append(time.perf_counter() - t)
                for where, xs in (("in-process", local_times), ("wire", wire_times)):
                    print(f"| {n} | {where} | {pct(xs, 0.5):.3f} | {pct(xs, 0.99):.3f} | "
                          f"{statistics.mean(xs) * 1e3:.3f} |")  # fmt: skip
        finally:
            local.stop()
            proc.terminate()
            proc.wait(10)


def bench_events(seconds: float) -> None:
    print()
    print("| subscribers | requests allocated | events received (most) | events / s per subscriber |")
    print("| ---: | ---: | ---: | ---: |")
    for subs in (0, 1, 16):
        tmp = Path(tempfile.mkdtemp())
        pool_toml = (
            '[[pools]]\nname = "ev"\nnum_blocks = 2048\nhash_block_size = 16\nhash_algo = "sha256_cbor"\n'
            'hash_seed = "0"\nenable_caching = true\nenable_kv_cache_events = true\nmax_model_len = 4096\n'
            '[[pools.groups]]\ntype = "full"\nblock_size = 16\n'
        )
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        events_toml = f'[[kv_events]]\npool = "ev"\nendpoint = "tcp://*:{port}"\ntopic = "kv"\n'
        proc, address = start_server(pool_toml + events_toml, tmp)
        mp = multiprocessing.get_context("spawn")
        stop, out = mp.Event(), mp.Queue()
        readers = mp.Process(target=_readers, args=(port, subs, stop, out))
        readers.start()
        time.sleep(2.0)  # the process starts and its subscriptions reach the publisher
        rnd = random.Random(2)
        prefixes = [[rnd.randrange(30000) for _ in range(48)] for _ in range(8)]
        try:
            with KVCoordClient(address, timeout=30) as client:
                cfg = client.get_pool("ev").pool.config
                r = client.attach("ev", "sha256_cbor", 16, "0")
                held: list[str] = []
                n = 0
                t0 = time.perf_counter()
                while time.perf_counter() - t0 < seconds:
                    tokens = rnd.choice(prefixes) + [rnd.randrange(30000) for _ in range(80)]
                    h = hash_prompt([pb.PoolInfo(name="ev", config=cfg)], tokens)[0].block_hashes
                    rid = f"r{n}"
                    n += 1
                    sync = pb.RequestSync(request_id=rid, append_token_ids=tokens, append_block_hashes=h,
                                          new_request=True)  # fmt: skip
                    res = client.allocate("ev", pb.AllocateOp(request=sync, num_new_tokens=len(tokens), lookup=True),
                                          r.session_id).result  # fmt: skip
                    held.append(rid)
                    if res.refused or len(held) > 60:
                        client.free("ev", held, session_id=r.session_id)
                        held = []
                elapsed = time.perf_counter() - t0
                time.sleep(1.0)  # let the subscribers drain
        finally:
            stop.set()
            counts = out.get(timeout=30)
            readers.join(10)
            proc.terminate()
            proc.wait(10)
        per = [c / elapsed for c in counts] or [0.0]
        print(f"| {subs} | {n} | {max(counts, default=0)} | {min(per):,.0f} - {max(per):,.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--event-seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=("scoring", "events"), help="run one part")
    a = ap.parse_args()
    if a.only != "events":
        bench_scoring(a.samples)
    if a.only != "scoring":
        bench_events(a.event_seconds)


if __name__ == "__main__":
    main()
