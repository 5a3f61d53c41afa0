"""Worker threads sharing one pool, on a network that loses, delays, duplicates and
re-delivers answers, with a model of the KV memory their blocks hold: what
test_shared_pool_faults.py and the cluster's shared-pool tests run."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from kvcoord.client import DEFAULT_RETRY, KVCoordClient, RemoteKVCacheManager, RetryPolicy
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb
from support import Req

NUM_BLOCKS = 60
BLOCK = 4


def shared_config() -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=NUM_BLOCKS,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BLOCK))],
        hash_block_size=BLOCK,
        enable_caching=True,
        enable_kv_cache_events=True,
        max_model_len=256,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


class KVMemory:
    """The workers' KV memory, modelled: block id -> the token prefix its KV was computed
    for. A worker allocating, writing and checking its hits holds :attr:`turn`, so no
    other worker hits a block between the server caching it and its writer writing it
    (the race engines sharing a pool rule out themselves)."""

    def __init__(self) -> None:
        self.turn = threading.Lock()
        #: block id -> (the writer's tenant, the token prefix)
        self.kv: dict[int, tuple[str, tuple[int, ...]]] = {}

    def write(self, blocks: list[int], tokens: list[int], computed: int, n: int, tenant: str = "") -> None:
        """The KV of tokens ``computed .. computed + n`` written to their blocks."""
        for i in range(computed // BLOCK, (computed + n + BLOCK - 1) // BLOCK):
            self.kv[blocks[i]] = (tenant, tuple(tokens[: min(BLOCK * (i + 1), computed + n)]))

    def check_hit(self, blocks: list[int], tokens: list[int], where: str, tenant: str = "") -> None:
        for i, b in enumerate(blocks):
            want = (tenant, tuple(tokens[: BLOCK * (i + 1)]))
            assert self.kv.get(b) == want, f"{where}: hit block {b} (index {i}) holds KV of {self.kv.get(b)}"


def server_tables(client: KVCoordClient, pool: str) -> dict[str, list[int]]:
    resp = client.inspect_pool(pool, all_requests=True)
    return {r.request_id: list(r.groups[0].block_ids) for r in resp.requests}


def shared_worker(address: str | Sequence[str], pool: str, wid: int, steps: int, memory: KVMemory, counts: dict[str, int],
                  injectors: list[FaultInjector], tenant: str = "", token: str | None = None,
                  admin: str | None = None, route: Callable[[Req], None] | None = None,
                  retry: RetryPolicy = DEFAULT_RETRY) -> None:  # fmt: skip
    """A small scheduler on the shared pool: admits prompts sharing prefixes with the other
    workers', prefills in chunks, decodes, preempts the newest on a refusal, frees, and
    now and then evicts a block id (as a failed KV load does). ``token``: its tenant's
    (``tenant`` names it in the KV memory); ``admin``: the token that inspects the pool;
    ``route``: called with each new request before its first allocation (a router);
    ``retry``: its clients' policy, the manager's and the one reading the server's tables
    after every step (a server restarted under it: one that outlasts a restart)."""
    rnd = random.Random(100 + wid)
    # the same prefixes in every worker: they hit each other's blocks
    prefixes = [[random.Random(7 + i).randrange(50) for _ in range(n)] for i, n in enumerate((0, 8, 13, 24))]
    fi = FaultInjector(200 + wid, drop=0.05, delay=0.05, duplicate=0.05, reorder=0.05)
    injectors.append(fi)
    with (
        KVCoordClient(address, interceptors=[fi], token=token, retry=retry) as c,
        KVCoordClient(address, token=admin, retry=retry) as plain,  # (its reads meet restarts too)
    ):
        m = RemoteKVCacheManager(c, pool, hash_seed="0", client_name=f"w{wid}")
        live: dict[str, Req] = {}
        mine: dict[str, list[int]] = {}  # the block table each request was answered
        running: list[str] = []

        def free(rid: str) -> None:
            m.free(live.pop(rid))
            mine.pop(rid, None)
            if rid in running:
                running.remove(rid)

        for step in range(steps):
            if rnd.random() < 0.5:
                rid = f"w{wid}-r{step}"
                body = [rnd.randrange(50) for _ in range(rnd.randint(1, 30))]
                live[rid] = Req(rid, (rnd.choice(prefixes) + body)[:60])
                if route is not None:
                    route(live[rid])
            for rid in sorted(live):
                if rid not in live:
                    continue  # preempted by a refusal this step
                r = live[rid]
                if rnd.random() < 0.08 or r.num_computed_tokens >= 120:
                    free(rid)
                    continue
                with memory.turn:
                    if rid not in running:
                        hit, computed = m.get_computed_blocks(r)
                        n = min(len(r.all_token_ids) - computed, rnd.choice([4, 16, 64]))
                        got = m.allocate_slots(r, n, computed, hit)
                        base = list(hit.get_block_ids()[0])
                    else:
                        computed = r.num_computed_tokens
                        n = min(len(r.all_token_ids) - computed, 16)
                        if n == 0:
                            continue
                        got = m.allocate_slots(r, n)
                        base = mine[rid]
                    if got is not None:
                        mine[rid] = base + list(got.get_block_ids()[0])
                        memory.write(mine[rid], r.all_token_ids, computed, n, tenant)
                        if rid not in running and computed:
                            memory.check_hit(
                                mine[rid][: computed // BLOCK], r.all_token_ids, f"w{wid} {rid}", tenant
                            )
                            counts["hits"] += 1
                if got is None:
                    counts["refusals"] += 1
                    if rid not in running:
                        mine[rid] = []  # registered, nothing allocated
                    if running and running[-1] != rid:
                        free(running[-1])
                        counts["preemptions"] += 1
                    continue
                if rid not in running:
                    running.append(rid)
                r.num_computed_tokens = computed + n
                if r.num_computed_tokens == len(r.all_token_ids):
                    r.all_token_ids = r.all_token_ids + [step % 50]
            if rnd.random() < 0.05:
                m.evict_blocks([rnd.randrange(1, NUM_BLOCKS)])
                counts["evictions"] += 1
            m.flush()  # frees ride with the next call: the step ends here
            held = {k: v for k, v in server_tables(plain, pool).items() if k.startswith(f"w{wid}-")}
            assert held == mine, f"w{wid} step {step}: the server holds {held}, the worker was told {mine}"
            counts["steps"] += 1
        for rid in list(live):
            free(rid)
        m.flush()
        counts["lost"] += m.lost_requests
        m.close()


def run_threads(target: Any, count: int, *args: Any) -> list[BaseException]:
    """``target(i, *args)`` for each of ``count`` workers at once, on threads; what they
    raised, in the order raised."""
    errors: list[BaseException] = []

    def guarded(wid: int) -> None:
        try:
            target(wid, *args)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=guarded, args=(w,)) for w in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return errors


@contextmanager
def routed_by_reservations(
    address: str | Sequence[str], wid: int, counts: dict[str, int], injectors: list[FaultInjector],
    token: str | None, share: float = 0.7, pool: str = "shared", retry: RetryPolicy = DEFAULT_RETRY,
) -> Iterator[Callable[[Req], None]]:  # fmt: skip
    """A router for worker ``wid``'s requests (``shared_worker``'s ``route``): ``share``
    of them are scored first with a reservation of their hit (ScorePools, 0.05-1.5 s),
    on a channel that loses, duplicates and re-delivers its answers; ``retry``: the
    router's client's policy."""
    rnd = random.Random(500 + wid)
    fi = FaultInjector(300 + wid, drop=0.1, duplicate=0.1, reorder=0.1, methods=("ScorePools",))
    injectors.append(fi)
    none = none_hash("sha256_cbor", "0")
    with KVCoordClient(address, interceptors=[fi], token=token, retry=retry) as router:

        def route(r: Req) -> None:
            if rnd.random() < share:
                prompt = pb.HashedPrompt(
                    hash_algo="sha256_cbor", hash_block_size=BLOCK, hash_seed="0",
                    block_hashes=BlockHasher("sha256_cbor", BLOCK, none).extend(r.all_token_ids),
                )  # fmt: skip
                router.score_pools(
                    len(r.all_token_ids),
                    [prompt],
                    candidate_pools=[pool],
                    reserve_seconds=rnd.uniform(0.05, 1.5),
                )
                counts["routed"] += 1

        yield route


def run_beside(
    worker: Callable[[int], None], count: int, side: Callable[[], None], stop: threading.Event
) -> None:
    """``count`` threads of ``worker`` (given 0 .. count-1) with ``side`` (a checker, a
    killer, a mover) running beside them until they end, then ``stop`` set for it to end;
    raises the first error of a worker, else of ``side``."""
    side_errors: list[BaseException] = []

    def guarded() -> None:
        try:
            side()
        except BaseException as exc:  # noqa: BLE001 - raised below
            side_errors.append(exc)

    beside = threading.Thread(target=guarded)
    beside.start()
    try:
        errors = run_threads(worker, count)
    finally:
        stop.set()
        beside.join(300)
    assert not beside.is_alive(), "the thread beside the workers did not end"
    assert not errors, errors[0]
    assert not side_errors, side_errors[0]
