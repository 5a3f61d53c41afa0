"""Answers lost, late, duplicated and reordered on the wire: every worker still sees
exactly the in-process engine's answers, and the server's request table equals each
worker's view after every step."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool, SlidingWindowSpec
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from shared_workers import run_threads
from support import Req

NUM_BLOCKS = 80


def pool_config(full_only: bool = False) -> pb.PoolConfig:
    groups = [pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))]
    if not full_only:
        groups.append(
            pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8))
        )
    return pb.PoolConfig(
        num_blocks=NUM_BLOCKS,
        groups=groups,
        hash_block_size=4,
        enable_caching=True,
        enable_kv_cache_events=True,
        max_model_len=256,
        hash_algo="sha256_cbor",
        hash_seed="0",
    )


def local_pool(full_only: bool = False) -> KVCachePool:
    return KVCachePool(
        KVCacheConfig(
            num_blocks=NUM_BLOCKS,
            groups=(FullAttentionSpec(4),) if full_only else (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
            hash_block_size=4,
            enable_kv_cache_events=True,
            max_model_len=256,
        )
    )


def table(requests: dict[str, tuple[tuple[tuple[int, ...], ...], int, int]]) -> dict[str, object]:
    return dict(sorted(requests.items()))


def server_table(client: KVCoordClient, pool: str) -> dict[str, object]:
    resp = client.inspect_pool(pool, all_requests=True)
    return table(
        {
            r.request_id: (tuple(tuple(g.block_ids) for g in r.groups), r.num_tokens, r.num_computed_tokens)
            for r in resp.requests
        }
    )


def local_table(local: KVCachePool) -> dict[str, object]:
    return table(
        {
            rid: (local.get_block_ids(rid), req.num_tokens, req.num_computed_tokens)
            for rid, req in local.requests.items()
        }
    )


def drive(
    remote: Any,
    local: KVCachePool,
    check: KVCoordClient,
    pool: str,
    seed: int,
    steps: int,
    check_every: int = 1,
) -> dict[str, int]:
    """A small scheduler: admit with prefix hits, chunked prefill, decode, preempt on
    refusal, free. Every answer is compared with the in-process pool; every
    ``check_every`` steps the server's request table is compared with the local one
    (the other steps end with ``take_events``, as vLLM's scheduler does)."""
    none = none_hash("sha256_cbor", "0")
    hashers: dict[str, BlockHasher] = {}
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(50) for _ in range(n)] for n in (0, 6, 13, 24)]
    live: dict[str, Req] = {}
    running: list[str] = []
    counts = {"steps": 0, "answers": 0, "hits": 0, "refusals": 0, "preemptions": 0, "frees": 0}

    def free(rid: str) -> None:
        remote.free(live[rid])
        local.free(rid)
        del live[rid]
        if rid in running:
            running.remove(rid)
        counts["frees"] += 1

    for step in range(steps):
        answered: list[tuple[object, object, str]] = []
        if rnd.random() < 0.4:
            rid = f"w{seed}-r{step}"
            tokens = (rnd.choice(prefixes) + [rnd.randrange(50) for _ in range(rnd.randint(1, 30))])[:60]
            live[rid] = Req(rid, tokens)
            hashers[rid] = BlockHasher("sha256_cbor", 4, none)
            local.add_request(rid, tokens, hashers[rid].extend(tokens))
        for rid in sorted(live):
            if rid not in live:
                continue
            r = live[rid]
            if rnd.random() < 0.06 or r.num_computed_tokens >= 200:
                free(rid)
                continue
            if rid not in running:
                hit_ids, hit_tokens = remote.get_computed_blocks(r)
                want = local.get_computed_blocks(rid)
                assert (hit_ids.get_block_ids(), hit_tokens) == (
                    tuple(list(x) for x in want.block_ids),
                    want.num_tokens,
                )
                n = min(len(r.all_token_ids) - hit_tokens, rnd.choice([4, 16, 64]))
                got = remote.allocate_slots(r, n, hit_tokens, hit_ids)
                exp = local.allocate_slots(rid, n, want.num_tokens, want)
                counts["hits"] += hit_tokens > 0
                computed = hit_tokens
            else:
                n = min(len(r.all_token_ids) - r.num_computed_tokens, 16)
                if n == 0:
                    continue
                got = remote.allocate_slots(r, n)
                exp = local.allocate_slots(rid, n)
                computed = r.num_computed_tokens
            counts["answers"] += 2
            # Refusals are known at once; block ids may arrive with the step's last call.
            assert (got is None) == (exp is None), f"step {step}, {rid}"
            if got is not None:
                answered.append((got, exp, f"step {step}, {rid}"))
            if exp is None:
                counts["refusals"] += 1
                if running and running[-1] != rid:  # vLLM: preempt from the end
                    victim = running.pop()
                    free(victim)
                    counts["preemptions"] += 1
                continue
            if rid not in running:
                running.append(rid)
            r.num_computed_tokens = computed + n
            new = [step % 50] if r.num_computed_tokens == len(r.all_token_ids) else []
            r.all_token_ids = r.all_token_ids + new
            local.update_request(rid, num_computed_tokens=r.num_computed_tokens, append_token_ids=new,
                                 append_block_hashes=hashers[rid].extend(new))  # fmt: skip
        counts["steps"] += 1
        for got, exp, where in answered:
            assert got.get_block_ids() == tuple(list(x) for x in exp), where  # type: ignore[attr-defined]
        if (step + 1) % check_every:
            remote.take_events()
            continue
        remote.flush()  # frees ride with the next call; the step ends here
        # The server holds what this worker believes, request for request, block for block.
        # (The server's view includes updates the worker has not sent yet only after
        # they were sent: compare the block tables and sizes the server acknowledged.)
        srv = server_table(check, pool)
        loc = local_table(local)
        assert srv.keys() == loc.keys(), f"step {step}: request sets differ"
        for rid in srv:
            assert srv[rid][0] == loc[rid][0], f"step {step}, {rid}: block tables differ"  # type: ignore[index]
        assert remote.usage == local.usage
    for rid in list(live):
        free(rid)
    remote.flush()
    assert server_table(check, pool) == {}
    return counts


def run_workers(worker: Any, count: int) -> None:
    """``worker(i)`` for each of ``count`` workers at once, on threads; the first
    exception any of them raised is raised here."""
    errors = run_threads(worker, count)
    if errors:
        raise errors[0]


@pytest.fixture
def server() -> Iterator[InProcessServer]:
    s = InProcessServer("").start()
    yield s
    s.stop()


@pytest.mark.parametrize(
    ("exclusive", "full_only"),
    [(False, False), (True, True)],
    ids=["shared-sessions", "exclusive-full-attention"],
)
def test_faulty_network_changes_no_answer(server: InProcessServer, exclusive: bool, full_only: bool) -> None:
    """Four workers, 400 steps each, 5% of answers dropped, 5% late, 5% duplicated, 5%
    re-delivered later: zero divergences, zero lost requests, on shared sessions and on
    sessions attached exclusively (which wait for every answer too)."""
    workers = 4
    results: dict[int, dict[str, int]] = {}
    injectors: list[FaultInjector] = []

    def worker(wid: int) -> None:
        pool = f"faults-{wid}"
        fi = FaultInjector(1000 + wid, drop=0.05, delay=0.05, duplicate=0.05, reorder=0.05)
        injectors.append(fi)
        with (
            KVCoordClient(server.address) as plain,
            KVCoordClient(server.address, interceptors=[fi]) as c,
        ):
            plain.create_pool(pool, pool_config(full_only))
            remote = RemoteKVCacheManager(c, pool, hash_seed="0", client_name=f"w{wid}", exclusive=exclusive)
            results[wid] = drive(remote, local_pool(full_only), plain, pool, wid, 400)
            results[wid]["lost"] = remote.lost_requests
            results[wid]["round_trips"] = remote.round_trips
            remote.close()

    run_workers(worker, workers)
    assert len(results) == workers
    total = {k: sum(r[k] for r in results.values()) for k in results[0]}
    faults = {k: sum(fi.counts[k] for fi in injectors) for k in injectors[0].counts}
    print(f"fault injection: {total} faults {faults}")
    assert total["lost"] == 0
    assert total["steps"] == workers * 400
    assert faults["dropped"] > 50 and faults["delayed"] > 50
    assert faults["duplicated"] > 50 and faults["reordered"] > 10
    assert total["refusals"] > 0 and total["hits"] > 0 and total["preemptions"] > 0


def test_admit_over_the_wire_equals_one_by_one(server: InProcessServer) -> None:
    """RemoteKVCacheManager.admit decides as lookups and allocations one by one do (on an
    in-process pool), and requests it did not reach are admitted by a later call."""
    with KVCoordClient(server.address) as c:
        c.create_pool("admit", pool_config())
        remote = RemoteKVCacheManager(c, "admit", hash_seed="0", exclusive=True)
        local = local_pool()
        rnd = random.Random(7)
        shared = [rnd.randrange(50) for _ in range(12)]
        waiting = [Req(f"r{i}", shared[: rnd.randint(4, 12)] + [rnd.randrange(50) for _ in range(rnd.randint(1, 20))])
                   for i in range(30)]  # fmt: skip
        admitted = 0
        for _ in range(12):
            if not waiting:
                break
            got = remote.admit(waiting[:8], 40)
            budget, want = 40, []
            for r in waiting[:8]:
                if budget <= 0:
                    break
                if r.request_id not in local.requests:
                    local.add_request(r.request_id, r.all_token_ids, BlockHasher(
                        "sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(r.all_token_ids))  # fmt: skip
                hit = local.get_computed_blocks(r.request_id)
                n = min(len(r.all_token_ids) - hit.num_tokens, budget)
                new = local.allocate_slots(r.request_id, n, hit.num_tokens, None if hit.is_empty else hit)
                want.append((tuple(map(list, hit.block_ids)), hit.num_tokens, n, new))
                if new is None:
                    break
                budget -= n
            assert [(h.get_block_ids(), ht, n, None if b is None else b.get_block_ids()) for h, ht, n, b in got] == [
                (h, ht, n, None if b is None else tuple(map(list, b))) for h, ht, n, b in want
            ]  # fmt: skip
            for (_, ht, n, b), r in zip(got, list(waiting), strict=False):
                if b is None:
                    break
                waiting.remove(r)
                admitted += 1
                r.num_computed_tokens = ht + n
                # finished at once: free, so later rounds have room
                remote.free(r)
                local.free(r.request_id)
        remote.flush()
        assert admitted >= 20 and server_table(c, "admit") == local_table(local)
        remote.close()


def test_predicted_answers_survive_a_faulty_network(server: InProcessServer) -> None:
    """PredictingKVCacheManager answers every call from its mirror and sends the calls
    without waiting; with 5% of answers dropped, late, duplicated and re-delivered, the
    retried Steps (idempotency keys) still apply once: two workers, 200 steps each,
    every answer the in-process engine's, the server's tables equal to the local ones
    every 5 steps, no request lost; then a second manager attaches to each used pool
    (its mirror from the state the server hands over) and runs 200 more."""
    results: dict[int, list[dict[str, int]]] = {}
    injectors: list[FaultInjector] = []

    def worker(wid: int) -> None:
        pool = f"predicted-{wid}"
        fi = FaultInjector(2000 + wid, drop=0.05, delay=0.05, duplicate=0.05, reorder=0.05)
        injectors.append(fi)
        local = local_pool(full_only=True)
        with (
            KVCoordClient(server.address) as plain,
            KVCoordClient(server.address, interceptors=[fi]) as c,
        ):
            plain.create_pool(pool, pool_config(full_only=True))
            results[wid] = []
            for run in range(2):  # the second from the used pool's state
                remote = PredictingKVCacheManager(c, pool, hash_seed="0", client_name=f"w{wid}")
                counts = drive(remote, local, plain, pool, wid * 10 + run, 200, check_every=5)
                counts["lost"] = remote.lost_requests
                counts["steps_sent"] = remote.steps_sent
                results[wid].append(counts)
                remote.close()

    run_workers(worker, 2)
    runs = [c for per in results.values() for c in per]
    assert len(runs) == 4
    total = {k: sum(c[k] for c in runs) for k in runs[0]}
    faults = {k: sum(fi.counts[k] for fi in injectors) for k in injectors[0].counts}
    print(f"fault injection (predicted): {total} faults {faults}")
    assert total["lost"] == 0
    assert total["steps"] == 4 * 200
    assert faults["dropped"] > 10 and faults["delayed"] > 10 and faults["duplicated"] > 10
    assert total["refusals"] > 0 and total["hits"] > 0 and total["preemptions"] > 0
