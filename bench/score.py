"""ScorePools and the vLLM-format KV event publisher, measured.

Scoring: a 4,096-token prompt (16-token blocks) is scored across 1, 16 and 64 pools of
four layouts (full attention; full + sliding window; full + sliding window with larger
blocks; full with EAGLE), 4,096 blocks each. Half of the pools (0-3, 8-11, ...: every
layout has some) hold the prompt's first 2,048 tokens, the others nothing of it. Each
call scores the next of 8 prompts in turn (the prompt, and 7 sharing its first 0 to
3,072 tokens), never the previous call's: nothing a call computes is kept for the next
one anyway, and a router scores a new prompt each time. "in-process" calls the plain
scoring function on an in-process server's pools, on its loop (what the handler runs,
without the message conversion); "wire" sends ScorePools over gRPC on loopback to a
server in another process (the client hashes nothing: the hashed prompts are built
once, and that hashing is timed apart), and "GetPool, wire" is the call right after
each ScorePools on the same connection. "gRPC floor" is a bare grpc.aio server in a
process of its own (no interceptors, no protobuf: bytes in, bytes out), sent a request
of the ScorePools request's size and answering with as many bytes as the ScorePools
answer, called in the same turns: what any Python gRPC call of these sizes costs here.

``--profile vllm-0.33`` scores pools of that semantics profile instead (the same
layouts; EAGLE's becomes look-ahead hashes, L = 1, as vLLM 0.33 hashes for EAGLE; no
``--old`` with it: a tree without profile-aware prompt hashing cannot score them).

``--old REV`` runs the same workload on the code of git revision REV beside this
checkout's, in one run: two servers and two in-process children, called in turns
(one call each, and rounds of in-process samples), so a busy machine slows both alike.

Events: one pool with a [[kv_events]] publisher; a client allocates and frees
128-token requests with shared prefixes, while 0, 1 or 16 ZMQ subscribers (in a process
of their own) decode every batch; events per second are the events each subscriber
received over the run's wall time, and the requests allocated show whether the
subscribers slowed the pool.

    python bench/score.py                 # about a minute
    python bench/score.py --only scoring --old main --samples 1000

Needs the zmq extra (pyzmq, msgspec) for the events part.
"""

from __future__ import annotations

import argparse
import functools
import gc
import multiprocessing
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# a --child process imports kvcoord from the tree its PYTHONPATH names (this one or --old's)
sys.path[:0] = (
    [str(ROOT / "bench")]
    if "--child" in sys.argv or "--step-child" in sys.argv
    else [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]
)

from common import freeze_heap, old_tree, pct  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client import _requests as rq  # noqa: E402
from kvcoord.client.routing import hash_prompt  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

G = pb.KVCacheGroupSpec
PROMPT_TOKENS = 4096
BLOCK = 16
#: the pools' semantics profile (--profile; children read it from the environment)
PROFILE = os.environ.get("KVCOORD_BENCH_PROFILE", "vllm-0.16")

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
    cfg = pb.PoolConfig(
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
    if PROFILE != "vllm-0.16":
        # vLLM 0.33 hashes EAGLE's next token into each block instead of dropping one
        cfg.profile, cfg.use_eagle = PROFILE, False
        cfg.num_hash_lookahead_tokens = 1 if layout == "eagle" else 0
    return cfg


def start_server(config_text: str, tmp: Path, tree: Path = ROOT) -> tuple[subprocess.Popen[bytes], str]:
    """A server process running the code of ``tree`` (this checkout, or ``--old``'s)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = tmp / "kvcoord.toml"
    cfg.write_text(
        f'[server]\nlisten = ["127.0.0.1:{port}"]\nmetrics_listen = ""\nlog_level = "WARNING"\n'
        f"[limits]\nmax_pools = 128\n{config_text}"
    )
    # the journal in the temporary directory, never the default one under the home directory
    env = dict(
        os.environ, PYTHONPATH=f"{tree / 'client'}:{tree / 'server'}", KVCOORD_DATA_DIR=str(tmp / "data")
    )
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


def floor_server() -> None:
    """``--floor PORT``: the bare gRPC server of the floor row. Each request's first 4
    bytes (big-endian) say how long the answer is; the answer is that many zero bytes."""
    import asyncio

    import grpc

    port = int(sys.argv[sys.argv.index("--floor") + 1])

    async def answer(request: bytes, _context: Any) -> bytes:
        return bytes(int.from_bytes(request[:4], "big"))

    async def serve() -> None:
        server = grpc.aio.server()
        handler = grpc.unary_unary_rpc_method_handler(answer)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Floor", {"Call": handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(serve())


def start_floor() -> tuple[subprocess.Popen[bytes], Any]:
    """The floor server in a process of its own, and a channel to it (plain grpcio, as
    KVCoordClient's)."""
    import grpc
    from common import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--floor", str(port)])
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    return proc, channel


def fill(client: KVCoordClient, name: str, cfg: pb.PoolConfig, prefix: list[int]) -> None:
    """Cache ``prefix`` in the pool (a request allocates it and is freed)."""
    prompts = hash_prompt([pb.PoolInfo(name=name, config=cfg)], prefix)
    if cfg.profile:
        r = client.attach(name, "sha256_cbor", BLOCK, "0", profile=cfg.profile,
                          num_hash_lookahead_tokens=cfg.num_hash_lookahead_tokens)  # fmt: skip
    else:
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


def layout_of(i: int) -> str:
    return list(LAYOUTS)[i % len(LAYOUTS)]


def holds_prefix(i: int) -> bool:
    """Half the pools hold the prompt's first half: pools 0-3 (one of each layout)
    do, 4-7 do not, and so on, so every layout has pools with and without it."""
    return (i // len(LAYOUTS)) % 2 == 0


def build(client: KVCoordClient, n: int, prompt: list[int]) -> list[str]:
    names = [f"s{i}-{layout_of(i)}" for i in range(n)]
    for i, name in enumerate(names):
        cfg = pool_config(layout_of(i))
        client.create_pool(name, cfg)
        if holds_prefix(i):
            fill(client, name, cfg, prompt[:2048])
    return names


def inprocess_child(n: int) -> None:
    """``--child N``: an in-process server (of the code on PYTHONPATH) with the
    benchmark's N pools; each line on stdin is a sample count: time the scoring
    function that many times on the server's loop (a new prompt each call, drawn from
    a fixed set) and print the seconds as one JSON line."""
    import json

    from kvcoord.service.scoring import score_pools

    try:
        from kvcoord.service.score_wire import prompts_from_pb
    except ImportError:  # code from before fix-split7s
        from kvcoord.service.convert import prompts_from_pb  # type: ignore[attr-defined,no-redef]
    from kvcoord.service.testing import InProcessServer

    prompt, others = prompts()
    local = InProcessServer("[limits]\nmax_pools = 128\n")
    local.start()
    try:
        with KVCoordClient(local.address, timeout=30) as c:
            names = build(c, n, prompt)
            infos = [p for p in c.list_pools().pools if p.name in names]
            wire = [prompts_from_pb(hash_prompt(infos, t)) for t in [prompt, *others]]
        registry = local.running.servicer.registry  # type: ignore[union-attr]
        pools = registry.pools
        # what the handler passes without include_block_ids: the cross-pool index (a
        # code without one scores each pool by its own search)
        index = getattr(registry, "score_index", None)
        extra = {"index": index} if index is not None else {}

        def run(samples: int) -> dict[str, Any]:
            out = []
            before = [g["collections"] for g in gc.get_stats()]
            for k in range(samples):
                hashed = wire[k % len(wire)]
                t = time.perf_counter()
                r = score_pools(pools, lambda _: True, names, PROMPT_TOKENS, hashed, **extra)
                out.append(time.perf_counter() - t)
            assert len(r.scores) == n, r
            after = [g["collections"] for g in gc.get_stats()]
            return {"seconds": out, "collections": [b - a for a, b in zip(before, after, strict=True)]}

        freeze_heap()
        for line in sys.stdin:
            print(json.dumps(local.call(functools.partial(run, int(line)))), flush=True)
    finally:
        local.stop()


def prompts() -> tuple[list[int], list[list[int]]]:
    """The prompt, and 7 others sharing 0 to 3,072 of its first tokens: scored in turn,
    so no call repeats the previous one (a router scores a new prompt each time)."""
    rnd = random.Random(1)
    prompt = [rnd.randrange(30000) for _ in range(PROMPT_TOKENS)]
    others = []
    for shared in (0, 512, 1024, 1536, 2048, 2560, 3072):
        others.append(prompt[:shared] + [rnd.randrange(30000) for _ in range(PROMPT_TOKENS - shared)])
    return prompt, others


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


def bench_scoring(samples: int, old: str | None) -> None:
    import json

    prompt, others = prompts()
    t0 = time.perf_counter()
    n_hash = 20
    for _ in range(n_hash):
        hash_prompt([pb.PoolInfo(name="x", config=pool_config("full"))], prompt)
    print(f"hashing the 4,096-token prompt (256 blocks, sha256_cbor), client side: "
          f"{(time.perf_counter() - t0) / n_hash * 1e3:.2f} ms")  # fmt: skip
    trees = {"new": ROOT}
    if old:
        trees = {"old": old_tree(old), "new": ROOT}
    temporary: list[Path] = [trees["old"]] if old else []
    print()
    print("| pools | code | where | p50 ms | p99 ms | mean ms |")
    print("| ---: | --- | --- | ---: | ---: | ---: |")
    gc_note: list[str] = []
    for n in (1, 16, 64):
        procs: list[subprocess.Popen[Any]] = []
        try:
            addresses, children = {}, {}
            for label, tree in trees.items():
                tmp = Path(tempfile.mkdtemp(prefix="kvcoord-score-"))
                temporary.append(tmp)
                proc, addresses[label] = start_server("", tmp, tree)
                procs.append(proc)
                env = dict(os.environ, PYTHONPATH=f"{tree / 'client'}:{tree / 'server'}")
                children[label] = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "--child", str(n)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                )  # fmt: skip
                procs.append(children[label])
            clients = {label: KVCoordClient(a, timeout=30) for label, a in addresses.items()}
            hashed = {}
            for label, c in clients.items():
                names = build(c, n, prompt)
                infos = [p for p in c.list_pools().pools if p.name in names]
                hashed[label] = [hash_prompt(infos, t) for t in [prompt, *others]]
            local: dict[str, list[float]] = {label: [] for label in trees}
            collections: dict[str, list[int]] = {label: [0, 0, 0] for label in trees}
            wire: dict[str, list[float]] = {label: [] for label in trees}
            floor: dict[str, list[float]] = {label: [] for label in trees}
            # the gRPC floor: messages of the new code's ScorePools sizes, no kvcoord
            floor_proc, floor_channel = start_floor()
            procs.append(floor_proc)
            floor_call = floor_channel.unary_unary("/floor.Floor/Call")
            last = list(trees)[-1]
            sizes = [
                (
                    rq.score_pools(PROMPT_TOKENS, h, names, False, 0.0).ByteSize(),
                    clients[last].score_pools(PROMPT_TOKENS, h, names).ByteSize(),
                )
                for h in hashed[last]
            ]
            floor_requests = [answer.to_bytes(4, "big") + bytes(max(asked - 4, 0)) for asked, answer in sizes]
            bare: list[float] = []
            rounds = 5
            for r in range(rounds):
                # in-process: each code's own process, in turns
                for label, child in children.items():
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write(f"{samples // rounds}\n")
                    child.stdin.flush()
                    answer = json.loads(child.stdout.readline())
                    local[label] += answer["seconds"]
                    collections[label] = [
                        a + b for a, b in zip(collections[label], answer["collections"], strict=True)
                    ]
                # wire: one call to each server in turn
                for k in range(samples // rounds + (50 if r == 0 else 0)):
                    for label, c in clients.items():
                        h = hashed[label][k % len(hashed[label])]
                        t = time.perf_counter()
                        c.score_pools(PROMPT_TOKENS, h, names)
                        t1 = time.perf_counter()
                        c.get_pool(names[0])
                        t2 = time.perf_counter()
                        if r or k >= 50:  # the first 50 warm up
                            wire[label].append(t1 - t)
                            floor[label].append(t2 - t1)
                    t = time.perf_counter()
                    floor_call(floor_requests[k % len(floor_requests)], timeout=30)
                    if r or k >= 50:
                        bare.append(time.perf_counter() - t)
            for label in trees:
                rows = (("in-process", local[label]), ("wire", wire[label]), ("GetPool, wire", floor[label]))
                for where, xs in rows:
                    print(f"| {n} | {label} | {where} | {pct(xs, 0.5):.3f} | {pct(xs, 0.99):.3f} | "
                          f"{statistics.mean(xs) * 1e3:.3f} |")  # fmt: skip
            for label in trees:
                gc_note.append(f"{n} pools, {label}: " + "/".join(map(str, collections[label])))
            print(f"| {n} | - | gRPC floor | {pct(bare, 0.5):.3f} | {pct(bare, 0.99):.3f} | "
                  f"{statistics.mean(bare) * 1e3:.3f} |")  # fmt: skip
            for c in clients.values():
                c.close()
            floor_channel.close()
        finally:
            for proc in procs:
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.terminate()
                proc.wait(10)
    print()
    print(f"in-process garbage collections (generations 0/1/2) over {samples} calls: " + "; ".join(gc_note))
    for path in temporary:  # the servers' journals and --old's sources
        shutil.rmtree(path, ignore_errors=True)


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


def step_child(watched: bool) -> None:
    """``--step-child plain|watched``: bench/engine.py's scheduler workload (the code on
    PYTHONPATH) on a pool that a ScoreIndex watches or not; each line on stdin is a
    seed: run that many steps' workload and print the engine's total nanoseconds in
    lookups, allocations and frees (where a watched map reports its keys)."""
    import importlib
    import json

    from kvcoord.engine import FullAttentionSpec

    # bench/engine.py, imported after kvcoord: it puts this checkout's sources first on
    # sys.path, and an old tree's child must keep the kvcoord its PYTHONPATH gave it
    workload = importlib.import_module("engine")

    if watched:
        from kvcoord.service.pool_service import Fence, Limits, PoolService
        from kvcoord.service.scoring import ScoreIndex
        from kvcoord.service.sessions import SessionTable
        from kvcoord.service.testing import ManualClock

        index = ScoreIndex()

        def made_and_watched(cfg: Any) -> Any:
            sessions = SessionTable(ManualClock(), 30.0, 60.0)
            service = PoolService("p", cfg, ("sha256_cbor", 16, "0"), Fence("i", 1), Limits(), sessions)
            index.forget("p")  # the previous run's pool
            assert index.watch("p", service) is not None
            return service.engine

        workload.KVCachePool = made_and_watched  # type: ignore[attr-defined]
    for line in sys.stdin:
        seed = int(line)
        t = workload.run((FullAttentionSpec(16),), 4096, workload.make_requests(seed, 300), 60)
        print(json.dumps([sum(t.lookup), sum(t.allocate), sum(t.free), len(t.allocate)]), flush=True)


def bench_step_cost(rounds: int, old: str | None) -> None:
    """What a watched pool's Steps pay: the engine workload on this code's pool
    unwatched and watched, and on ``old``'s, in turns (one run each per round)."""
    import json

    trees: dict[str, tuple[Path, str]] = {
        "new, not watched": (ROOT, "plain"),
        "new, watched": (ROOT, "watched"),
    }
    if old:
        trees = {"old": (old_tree(old), "plain"), **trees}
    children = {}
    for label, (tree, mode) in trees.items():
        env = dict(os.environ, PYTHONPATH=f"{tree / 'client'}:{tree / 'server'}")
        children[label] = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--step-child", mode],
            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
    totals: dict[str, list[list[int]]] = {label: [] for label in trees}
    try:
        for r in range(rounds):
            for label, child in children.items():
                assert child.stdin is not None and child.stdout is not None
                child.stdin.write(f"{r}\n")
                child.stdin.flush()
                totals[label].append(json.loads(child.stdout.readline()))
    finally:
        for child in children.values():
            if child.stdin is not None:
                child.stdin.close()
            child.wait(30)
    print()
    print("| code | pool | engine ms per run (median) | per allocate_slots us (median run) |")
    print("| --- | --- | ---: | ---: |")
    for label, runs in totals.items():
        ms = statistics.median((a + b + c) / 1e6 for a, b, c, _ in runs)
        per = statistics.median(b / n / 1e3 for _, b, _, n in runs)
        print(f"| {label.split(',')[0]} | {label.split(', ')[-1] if ',' in label else 'not watched'} | "
              f"{ms:.1f} | {per:.2f} |")  # fmt: skip
    if old:
        shutil.rmtree(trees["old"][0], ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=500)
    ap.add_argument("--event-seconds", type=float, default=5.0)
    ap.add_argument("--only", choices=("scoring", "events", "step-cost"), help="run one part")
    ap.add_argument("--rounds", type=int, default=10, help="step-cost: workload runs per code")
    ap.add_argument("--old", metavar="REV", help="also score with the code of git revision REV, side by side")
    ap.add_argument("--profile", choices=("vllm-0.16", "vllm-0.33"), help="scoring: the pools' profile")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # inprocess_child
    ap.add_argument("--floor", type=int, help=argparse.SUPPRESS)  # floor_server
    ap.add_argument("--step-child", choices=("plain", "watched"), help=argparse.SUPPRESS)  # step_child
    a = ap.parse_args()
    if a.profile:
        if a.profile != "vllm-0.16" and a.old:
            ap.error("--profile vllm-0.33 has no --old: older trees hash every prompt by 0.16's rules")
        os.environ["KVCOORD_BENCH_PROFILE"] = a.profile  # this process's children
        globals()["PROFILE"] = a.profile
    if a.step_child:
        step_child(a.step_child == "watched")
        return
    if a.only == "step-cost":
        bench_step_cost(a.rounds, a.old)
        return
    if a.floor:
        floor_server()
        return
    if a.child:
        inprocess_child(a.child)
        return
    if a.only != "events":
        bench_scoring(a.samples, a.old)
    if a.only != "scoring":
        bench_events(a.event_seconds)


if __name__ == "__main__":
    main()
