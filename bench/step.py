"""Scheduler steps in-process and over the wire, side by side in one run. Not a test.

    python bench/step.py [--running 16 64 256] [--steps 200] [--warmup 300] [--hash-in-manager] [--phases]
                         [--modes predicted excl+admit exclusive shared per-call] [--pools ample fill]

A scheduler loop shaped like vLLM's (running requests first, preempting from the end
of the running list on a refusal; then waiting requests with a prefix lookup; block
ids read when the step's output is built; finished requests freed; usage, events and
statistics read every step) keeps N requests running: prompts 512-4,096 tokens, half
sharing one of 8 prefixes, outputs 16-256 tokens, token budget 8,192, full attention
with 16-token blocks, on each ``--pools`` choice (a row group each): ``ample``, room
for every request at its longest (nothing is ever preempted, no request waits for
blocks), and ``fill``, 96 blocks a request (about 60 % of what the requests would hold
at their mean length), so that the pool fills, requests wait and the loop preempts in
the measured steps (the group's ``pool`` line, under its in-process row, gives the
pool's peak and mean usage, the preemptions and the running and waiting counts). Each
request hashes its own blocks when it is created and as tokens are appended, as vLLM's
Request does with its block hasher, so no manager hashes (``--hash-in-manager``:
requests carry no hashes and each manager computes them when it first sees a request,
the shape of the figures before 2026-11-30). Prompts arrive
made: their tokens are drawn between steps, outside the timed step (before 2026-11-30
the timed step drew them: about 0.5 ms per step at 256 running, in every mode). The first
``--warmup`` steps are not measured: at 256 running the initial batch prefills for about
70 steps and its first generation ends by about 260, after which a step's cost is
steady. The same seeded workload runs on:

  vLLM           vLLM 0.16.0's own KVCacheManager in-process (when vLLM is importable:
                 run with the vLLM venv's python); its decisions must equal the engine's
  in-process     kvcoord's engine called directly
  predicted      PredictingKVCacheManager: every call answered from the client's mirror
                 of the pool (the engine itself, loaded from the server's state on Attach), each step's
                 calls sent as one Step from a background thread without waiting
                 (joining the next one while one is in flight), every answer compared
                 when it comes; its RTT column is a burst of no-op Steps before and after
                 the row (a probe between steps would let the Step in flight finish
                 untimed)
  exclusive      RemoteKVCacheManager(exclusive=True): one session per pool, every
                 lookup and allocation waits for the server (the waiting mode an
                 exclusive pool that cannot be predicted runs), frees and state batched
  excl+admit     the same, with the waiting loop sent as one Admit operation
                 (RemoteKVCacheManager.admit) instead of a lookup per admitted request
  shared         RemoteKVCacheManager: frees and state batched, every allocation waits
  per-call       one round trip per manager call (the old protocol's shape)
  no-op RTT      an empty Step round trip; for each remote row, one sent after each of
                 its steps (untimed by the step), so that the ratio's round trip is
                 sampled at the same moments as the steps (the machine's speed drifts)

The server is a separate process on loopback. Decisions (scheduled ids, token counts,
block ids) are compared between in-process and every remote run.

``--phases`` prints, under each row, the median of each phase of the step (the running
loop, the waiting loop, reading the output's block ids, the rest) and a split: for a
remote mode, the time the step spent waiting on round trips (request sent to answer
held, the manager's ``round_trip_seconds``) against the rest of the step (the loop and
the client's own work), and the server process's CPU per step (all its threads, from
``/proc``); in-process, a second, timed run splits the step into the time inside the
engine's calls and the loop's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import random
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server")]

from common import freeze_heap, pct  # noqa: E402
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager  # noqa: E402
from kvcoord.client.hashing import BlockHasher, none_hash  # noqa: E402
from kvcoord.client.testing import start_server  # noqa: E402
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

BS = 16
BUDGET = 8192
NONE = none_hash("sha256_cbor", "0")


@dataclasses.dataclass
class Req:
    request_id: str
    all_token_ids: list[int]
    max_output: int
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    num_prompt: int = 0
    #: the request's block hashes, kept up to date as tokens are appended, as vLLM's
    #: Request does with its block hasher (None: the manager hashes, ``--hash-in-manager``)
    block_hashes: list[bytes] | None = None
    hasher: BlockHasher | None = None

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        if self.hasher is not None:
            assert self.block_hashes is not None
            self.block_hashes.extend(self.hasher.extend((token,)))


class LocalManager:
    """The in-process engine behind RemoteKVCacheManager's methods (the baseline)."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = KVCachePool(
            KVCacheConfig(
                num_blocks=num_blocks,
                groups=(FullAttentionSpec(BS),),
                hash_block_size=BS,
                enable_kv_cache_events=True,
                max_model_len=1 << 20,
            )  # fmt: skip
        )
        self.sent: dict[str, tuple[int, int, BlockHasher | None]] = {}

    def _sync(self, r: Req) -> None:
        got = self.sent.get(r.request_id)
        given = r.block_hashes
        if got is None:
            h = None if given is not None else BlockHasher("sha256_cbor", BS, NONE)
            hashes = h.extend(r.all_token_ids) if h is not None else list(given or ())
            self.pool.add_request(r.request_id, r.all_token_ids, hashes,
                                  num_preemptions=r.num_preemptions)  # fmt: skip
            self.sent[r.request_id] = (len(r.all_token_ids), len(hashes), h)
            self.pool.update_request(r.request_id, num_computed_tokens=r.num_computed_tokens)
            return
        n, nh, h = got
        new = r.all_token_ids[n:]
        new_hashes = h.extend(new) if h is not None else (given or [])[nh:]
        self.pool.update_request(r.request_id, num_computed_tokens=r.num_computed_tokens,
                                 append_token_ids=new, append_block_hashes=new_hashes)  # fmt: skip
        self.sent[r.request_id] = (len(r.all_token_ids), nh + len(new_hashes), h)

    def get_computed_blocks(self, r: Req) -> tuple[Any, int]:
        self._sync(r)
        hit = self.pool.get_computed_blocks(r.request_id)
        return hit, hit.num_tokens

    def allocate_slots(self, r: Req, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        self._sync(r)
        return self.pool.allocate_slots(r.request_id, n, hit_tokens, hit if hit_tokens else None)

    def free(self, r: Req) -> None:
        self.pool.free(r.request_id)
        self.sent.pop(r.request_id, None)

    def admit(self, reqs: list[Req], budget: int) -> list[tuple[Any, int, int, Any]]:
        out = []
        for r in reqs:
            if budget <= 0:
                break
            hit, ht = self.get_computed_blocks(r)
            n = min(len(r.all_token_ids) - ht, budget)
            new = self.allocate_slots(r, n, ht, hit)
            out.append((hit, ht, n, new))
            if new is None:
                break
            budget -= n
        return out

    @property
    def usage(self) -> float:
        return self.pool.usage

    def take_events(self) -> list[Any]:
        return self.pool.take_events()

    def make_prefix_cache_stats(self) -> Any:
        return self.pool.make_prefix_cache_stats()


class TimedLocalManager(LocalManager):
    """LocalManager that adds up the seconds spent in its calls (the engine, with its
    request sync): the in-process step split into the engine's part and the loop's own.
    A separate run, so that the timing does not slow the baseline."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.round_trip_seconds = 0.0  # named as the remote manager's, for run()

    def _timed(self, call: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.round_trip_seconds += time.perf_counter() - t0

    def get_computed_blocks(self, r: Req) -> tuple[Any, int]:
        return self._timed(super().get_computed_blocks, r)  # type: ignore[no-any-return]

    def allocate_slots(self, r: Req, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        return self._timed(super().allocate_slots, r, n, hit_tokens, hit)

    def free(self, r: Req) -> None:
        self._timed(super().free, r)

    @property
    def usage(self) -> float:
        return self._timed(lambda: self.pool.usage)  # type: ignore[no-any-return]

    def take_events(self) -> list[Any]:
        return self._timed(super().take_events)  # type: ignore[no-any-return]

    def make_prefix_cache_stats(self) -> Any:
        return self._timed(super().make_prefix_cache_stats)


class VllmManager:
    """vLLM 0.16.0's own KVCacheManager in-process, behind the same methods (needs vLLM).

    vLLM's scheduler owns its Request objects; here each bench request is mirrored in
    one (created at its first call, then told its appended tokens and computed count),
    which is what vLLM's scheduler does to its requests as a step goes.
    """

    def __init__(self, num_blocks: int) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256_cbor
        from vllm.v1 import kv_cache_interface as k
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256_cbor)
        spec = k.FullAttentionSpec(BS, num_kv_heads=1, head_size=64, dtype=torch.float16)
        cfg = k.KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[k.KVCacheGroupSpec(["layer0"], spec)]
        )
        self.m = KVCacheManager(cfg, max_model_len=1 << 20, hash_block_size=BS, enable_caching=True,
                                log_stats=True, enable_kv_cache_events=True)  # fmt: skip
        hasher = get_request_block_hasher(BS, sha256_cbor)
        # a request that hashes its own blocks hands them over; else vLLM's Request hashes
        self._make = lambda r: Request(
            r.request_id,
            list(r.all_token_ids),
            SamplingParams(max_tokens=1 << 20),
            None,
            None,
            block_hasher=hasher if r.block_hashes is None else None,
        )
        self.reqs: dict[str, Any] = {}

    def _sync(self, r: Req) -> Any:
        v = self.reqs.get(r.request_id)
        if v is None:
            v = self.reqs[r.request_id] = self._make(r)
        elif len(r.all_token_ids) > v.num_tokens:
            v.append_output_token_ids(r.all_token_ids[v.num_tokens :])
        if r.block_hashes is not None and len(r.block_hashes) > len(v.block_hashes):
            v.block_hashes.extend(r.block_hashes[len(v.block_hashes) :])  # hashed by the request
        v.num_computed_tokens = r.num_computed_tokens
        v.num_preemptions = r.num_preemptions
        return v

    def get_computed_blocks(self, r: Req) -> tuple[Any, int]:
        return self.m.get_computed_blocks(self._sync(r))  # type: ignore[no-any-return]

    def allocate_slots(self, r: Req, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        return self.m.allocate_slots(self._sync(r), n, hit_tokens, hit)

    def free(self, r: Req) -> None:
        v = self.reqs.pop(r.request_id, None)
        if v is not None:
            self.m.free(v)

    @property
    def usage(self) -> float:
        return float(self.m.usage)

    def take_events(self) -> list[Any]:
        return self.m.take_events()  # type: ignore[no-any-return]

    def make_prefix_cache_stats(self) -> Any:
        return self.m.make_prefix_cache_stats()


def vllm_importable() -> bool:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except ImportError:
        return False
    return True


class PerCall:
    """RemoteKVCacheManager with every call sent and answered on its own."""

    def __init__(self, m: RemoteKVCacheManager) -> None:
        self.m = m

    def get_computed_blocks(self, r: Req) -> tuple[Any, int]:
        return self.m.get_computed_blocks(r)

    def allocate_slots(self, r: Req, n: int, hit_tokens: int = 0, hit: Any = None) -> Any:
        got = self.m.allocate_slots(r, n, hit_tokens, hit)
        if got is not None:
            got.get_block_ids()
        return got

    def free(self, r: Req) -> None:
        self.m.free(r)
        self.m.flush()

    @property
    def usage(self) -> float:
        return float(self.m.client.get_stats(self.m.pool).usage)

    def take_events(self) -> list[Any]:
        return self.m.take_events()

    def make_prefix_cache_stats(self) -> Any:
        self.m.flush()
        return self.m.make_prefix_cache_stats()


def ids_of(blocks: Any) -> tuple[tuple[int, ...], ...]:
    if hasattr(blocks, "get_block_ids"):
        return tuple(tuple(g) for g in blocks.get_block_ids())
    return tuple(tuple(g) for g in blocks)


#: one step's phases (seconds): the running loop, the waiting loop, reading the block
#: ids for the step's output, the rest (frees, new arrivals, usage, events, statistics);
#: the round trips made in the waiting loop; and the seconds the step spent waiting on
#: round trips (in the manager's calls, for the timed in-process run)
Phases = tuple[float, float, float, float, int, float]


def _mean(xs: list[float]) -> float:
    """The mean of ``xs`` (seconds), in milliseconds."""
    return statistics.fmean(xs) * 1e3


def _trips(kv: Any) -> int:
    m = getattr(kv, "m", kv)  # PerCall wraps the manager
    return int(getattr(m, "round_trips", getattr(m, "steps_sent", 0)))


def _waited(kv: Any) -> float:
    m = getattr(kv, "m", kv)
    return float(getattr(m, "round_trip_seconds", getattr(m, "waited_seconds", 0.0)))


def cpu_seconds(pid: int) -> float:
    """CPU seconds a process used so far, all its threads (``/proc``, nanoseconds)."""
    total = 0
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that just ended
            continue
    return total / 1e9


def run(
    kv: Any,
    running_target: int,
    steps: int,
    seed: int,
    admit: bool = False,
    hash_in_request: bool = True,
    phases: list[Phases] | None = None,
    between: Callable[[], float] | None = None,
    between_times: list[float] | None = None,
    fill: list[tuple[int, int, float]] | None = None,
) -> tuple[list[float], list[Any]]:
    """The scheduler loop; returns seconds per step and the decisions of every step
    (and each step's :data:`Phases` into ``phases``, when given). ``between`` runs after
    each step, untimed by the step; what it returns goes into ``between_times`` (the
    no-op round trip, sampled at the same moments as the steps). ``fill`` (when given)
    gets each step's running and waiting counts and the pool's usage (read in the step).

    With ``hash_in_request`` each request hashes its own blocks as it is created and as
    tokens are appended (vLLM's Request does, with its block hasher), inside the step
    that creates or extends it; else the manager hashes them when it first sees them.
    """
    rnd = random.Random(seed)  # the model's sampled tokens
    prompt_rnd = random.Random(seed * 7919 + 1)  # the users' prompts
    prefixes = [
        [prompt_rnd.randrange(32000) for _ in range(prompt_rnd.choice((256, 512, 1024)))] for _ in range(8)
    ]
    counter = 0

    def draw_prompt() -> tuple[list[int], int]:
        n = prompt_rnd.randint(512, 4096)
        tokens = (prompt_rnd.choice(prefixes) if prompt_rnd.random() < 0.5 else []) + [
            prompt_rnd.randrange(32000) for _ in range(n)
        ]
        return tokens[:n], prompt_rnd.randint(16, 256)

    # Prompts arrive made (a tokenizer made them, not the scheduler): drawn between
    # steps, outside the timed step, in the same order in every mode.
    prompts: deque[tuple[list[int], int]] = deque()

    def new_request() -> Req:
        nonlocal counter
        counter += 1
        tokens, max_output = prompts.popleft() if prompts else draw_prompt()
        r = Req(f"r{counter}", tokens, max_output, num_prompt=len(tokens))
        if hash_in_request:
            r.hasher = BlockHasher("sha256_cbor", BS, NONE)
            r.block_hashes = r.hasher.extend(tokens)
        return r

    running: list[Req] = []
    waiting: deque[Req] = deque(new_request() for _ in range(running_target))
    times: list[float] = []
    decisions: list[Any] = []
    for _ in range(steps):
        t0, waited0 = time.perf_counter(), _waited(kv)
        budget = BUDGET
        scheduled: list[tuple[Req, int, Any]] = []
        preempted: list[str] = []
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = min(len(r.all_token_ids) - r.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            while True:
                blocks = kv.allocate_slots(r, n)
                if blocks is not None:
                    break
                victim = running.pop()
                kv.free(victim)
                victim.num_computed_tokens = 0
                victim.num_preemptions += 1
                waiting.appendleft(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break
            if blocks is None:
                continue
            scheduled.append((r, n, blocks))
            budget -= n
            i += 1
        t1, trips1 = time.perf_counter(), _trips(kv)
        if admit and waiting and budget > 0 and not preempted:
            # the waiting loop in one operation: same decisions, one round trip
            for _hit, hit_tokens, n, blocks in kv.admit(list(waiting), budget):
                if blocks is None:
                    break
                r = waiting.popleft()
                r.num_computed_tokens = hit_tokens
                running.append(r)
                scheduled.append((r, n, blocks))
                budget -= n
        while not admit and waiting and budget > 0 and not preempted:
            r = waiting[0]
            hit, hit_tokens = kv.get_computed_blocks(r)
            n = min(len(r.all_token_ids) - hit_tokens, budget)
            blocks = kv.allocate_slots(r, n, hit_tokens, hit)
            if blocks is None:
                break
            waiting.popleft()
            r.num_computed_tokens = hit_tokens
            running.append(r)
            scheduled.append((r, n, blocks))
            budget -= n
        t2, trips2 = time.perf_counter(), _trips(kv)
        decisions.append([(r.request_id, n, ids_of(b)) for r, n, b in scheduled] + preempted)
        t3 = time.perf_counter()
        # the model ran; its output updates the requests
        for r, n, _ in scheduled:
            r.num_computed_tokens += n
            if r.num_computed_tokens >= len(r.all_token_ids):
                r.append(rnd.randrange(32000))
        for r in [r for r in running if len(r.all_token_ids) - r.num_prompt >= r.max_output]:
            running.remove(r)
            kv.free(r)
            waiting.append(new_request())
        usage = kv.usage
        kv.take_events()
        kv.make_prefix_cache_stats()
        t4 = time.perf_counter()
        times.append(t4 - t0)
        if fill is not None:
            fill.append((len(running), len(waiting), usage))
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3, trips2 - trips1, _waited(kv) - waited0))
        if between is not None and between_times is not None:
            between_times.append(between())
        while len(prompts) < 64:  # the next steps' arrivals, untimed
            prompts.append(draw_prompt())
    return times, decisions


def phase_line(phases: list[Phases]) -> str:
    """Medians of each phase, and how often the waiting loop made a round trip."""
    med = [statistics.median(p[i] for p in phases) * 1e3 for i in range(4)]
    waited = sum(1 for p in phases if p[4]) / len(phases)
    return (f"{'':7}   phases p50 ms: running {med[0]:.2f}, waiting {med[1]:.2f}, output {med[2]:.2f}, "
            f"rest {med[3]:.2f}; waiting loop made a round trip in {100 * waited:.0f} % of steps")  # fmt: skip


def split_line(times: list[float], phases: list[Phases], what: str, server_ms: float | None = None) -> str:
    """A step split into the time spent in ``what`` (round trips, or the engine
    in-process) and the caller's own work, p50 of each; the server's CPU per step."""
    inside = statistics.median(p[5] for p in phases) * 1e3
    own = statistics.median(t - p[5] for t, p in zip(times, phases, strict=True)) * 1e3
    line = f"{'':7}   split p50 ms: {what} {inside:.2f}, the rest of the step {own:.2f}"
    if server_ms is not None:
        line += f"; server CPU per step {server_ms:.2f} ms (mean, all its threads)"
    return line


#: ``fill`` pools: blocks a request's share (a request holds about 152 blocks at its
#: mean length, 2,440 tokens), so that at 16, 64 and 256 running the pool fills,
#: requests wait and the loop preempts in the measured steps
FILL_BLOCKS = 96


def pool_blocks(pools: str, n: int) -> int:
    """``ample``: room for every request at its longest (4,352 tokens), nothing is ever
    preempted; ``fill``: :data:`FILL_BLOCKS` a request."""
    return n * 4600 // BS + 1 if pools == "ample" else n * FILL_BLOCKS


def fill_line(decisions: list[Any], fill: list[tuple[int, int, float]], blocks: int) -> str:
    """How full the pool ran in the measured steps (the same in every mode: the
    decisions are)."""
    pre = [sum(1 for e in d if isinstance(e, str)) for d in decisions]
    running, waiting = [f[0] for f in fill], [f[1] for f in fill]
    return (
        f"{'':7}   pool {blocks} blocks: peak usage {max(f[2] for f in fill) * 100:.1f} % (mean "
        f"{statistics.fmean(f[2] for f in fill) * 100:.1f} %); {sum(pre)} preemptions in {sum(1 for x in pre if x)} "
        f"of {len(decisions)} measured steps; running {min(running)}-{max(running)} "
        f"(mean {statistics.fmean(running):.1f}), waiting {min(waiting)}-{max(waiting)} "
        f"(mean {statistics.fmean(waiting):.1f})"
    )


def pool_config(num_blocks: int) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=num_blocks, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BS))],
        hash_block_size=BS, enable_caching=True, enable_kv_cache_events=True, hash_algo="sha256_cbor",
        hash_seed="0",
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--running", type=int, nargs="+", default=[16, 64, 256])
    ap.add_argument("--steps", type=int, default=200, help="measured steps per mode")
    ap.add_argument(
        "--warmup", type=int, default=300,
        help="steps before the measured ones: the initial batch's prefill and first generation",
    )  # fmt: skip
    ap.add_argument(
        "--modes", nargs="+", default=["predicted", "excl+admit", "exclusive", "shared", "per-call"]
    )
    ap.add_argument(
        "--pools", nargs="+", default=["ample", "fill"], choices=["ample", "fill"],
        help="ample: nothing is ever preempted; fill: the pool fills, requests wait and the loop preempts",
    )  # fmt: skip
    ap.add_argument("--phases", action="store_true", help="print each mode's phase medians under its row")
    ap.add_argument(
        "--hash-in-manager",
        action="store_true",
        help="requests carry no block hashes: the manager computes them (the old shape)",
    )
    args = ap.parse_args()
    with_vllm = vllm_importable()
    hashed = not args.hash_in_manager
    if not with_vllm:
        print("vLLM is not importable here: its row is left out (run in the vLLM venv to include it)")
    server = start_server("", env=dict(os.environ, PYTHONPATH=f"{ROOT / 'client'}:{ROOT / 'server'}"))
    try:
        client = KVCoordClient(server.address, timeout=60)
        client.create_pool("noop", pool_config(64))

        def noop_once(session: Any) -> float:
            t0 = time.perf_counter()
            client.step("noop", [], session.session_id, session.fence, include_state=True)
            return time.perf_counter() - t0

        def noop_round_trip() -> tuple[float, float, float]:
            """The no-op Step's round trip now: p50 and p99 (ms), server CPU each (ms)."""
            noop = []
            s = client.attach("noop", "sha256_cbor", BS, "0")  # a fresh session: a mode may outlast a lease
            cpu0 = cpu_seconds(server.proc.pid)
            for _ in range(300):
                t0 = time.perf_counter()
                client.step("noop", [], s.session_id, s.fence, include_state=True)
                noop.append(time.perf_counter() - t0)
            cpu = (cpu_seconds(server.proc.pid) - cpu0) / len(noop) * 1e3
            client.detach(s.session_id, s.fence)
            return statistics.median(noop) * 1e3, pct(noop, 0.99), cpu

        rtt, rtt99, noop_cpu = noop_round_trip()
        print(f"no-op Step round trip: p50 {rtt:.3f} ms, p99 {rtt99:.3f} ms; server CPU {noop_cpu:.3f} ms each "
              "(a remote row's RTT column: a no-op Step after each of its steps, p50)")  # fmt: skip
        header = (f"{'running':>7} {'mode':<11} {'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'RTT/step':>8} "
                  f"{'+ms/step':>9} {'vs in-proc+RTT':>14} {'RTT ms':>7}")  # fmt: skip
        print(header)
        for pools, n in itertools.product(args.pools, args.running):
            blocks = pool_blocks(pools, n)
            print(f"-- {pools} pool")
            total = args.steps + args.warmup
            if with_vllm:
                vm = VllmManager(blocks)
                freeze_heap()
                v_t, v_d = run(vm, n, total, seed=n, hash_in_request=hashed)
                v_med = statistics.median(v_t[args.warmup :]) * 1e3
                print(f"{n:>7} {'vLLM':<11} {v_med:8.2f} {pct(v_t[args.warmup :], 0.99):8.2f} "
                      f"{_mean(v_t[args.warmup :]):8.2f}")  # fmt: skip
            lm = LocalManager(blocks)
            freeze_heap()
            base_ph: list[Phases] = []
            fill: list[tuple[int, int, float]] = []
            base_t, base_d = run(lm, n, total, seed=n, hash_in_request=hashed, phases=base_ph, fill=fill)
            base = statistics.median(base_t[args.warmup :]) * 1e3
            if with_vllm:
                assert v_d == base_d, "vLLM's manager decided differently from kvcoord's engine"
                print(f"{n:>7} {'in-process':<11} {base:8.2f} {pct(base_t[args.warmup :], 0.99):8.2f} "
                      f"{_mean(base_t[args.warmup :]):8.2f} {'':8} {'':9} {'':14} "
                      f"(kvcoord's engine; {base / v_med:.2f} x vLLM)")  # fmt: skip
            else:
                print(f"{n:>7} {'in-process':<11} {base:8.2f} {pct(base_t[args.warmup :], 0.99):8.2f} "
                      f"{_mean(base_t[args.warmup :]):8.2f}")  # fmt: skip
            print(fill_line(base_d[args.warmup :], fill[args.warmup :], blocks))
            if args.phases:
                print(phase_line(base_ph[args.warmup :]))
                tm = TimedLocalManager(blocks)
                freeze_heap()
                timed_ph: list[Phases] = []
                timed_t, timed_d = run(tm, n, total, seed=n, hash_in_request=hashed, phases=timed_ph)
                assert timed_d == base_d
                print(
                    split_line(timed_t[args.warmup :], timed_ph[args.warmup :], "in the engine (timed run)")
                )
            for mode in args.modes:
                name = f"p{n}-{pools}-{mode.replace('+', '-')}"
                client.create_pool(name, pool_config(blocks))
                m: Any
                if mode == "predicted":
                    m = PredictingKVCacheManager(client, name, hash_seed="0")
                else:
                    m = RemoteKVCacheManager(client, name, hash_seed="0", exclusive=mode.startswith("excl"))
                kv: Any = PerCall(m) if mode == "per-call" else m
                # The machine's speed drifts over minutes: the ratio's round trip is a no-op
                # Step sent after each step of this mode (untimed by the step). Not for
                # "predicted": its Step in flight would run on while the probe waits,
                # untimed; its round trip is a burst of no-op Steps before and after it.
                probe = client.attach("noop", "sha256_cbor", BS, "0")
                noops: list[float] = []
                predicted = mode == "predicted"
                before = noop_round_trip()[0] if predicted else 0.0
                freeze_heap()
                ph: list[Phases] = []
                cpu0 = cpu_seconds(server.proc.pid)
                t, d = run(
                    kv, n, total, seed=n, admit=mode == "excl+admit", hash_in_request=hashed, phases=ph,
                    between=None if predicted else lambda probe=probe: noop_once(probe), between_times=noops,
                )  # fmt: skip
                if predicted:
                    m.flush()  # every answer confirmed by the server
                probes = 0 if predicted else total
                server_ms = (cpu_seconds(server.proc.pid) - cpu0 - noop_cpu / 1e3 * probes) / total * 1e3
                client.detach(probe.session_id, probe.fence)
                if predicted:
                    rtt = statistics.median([before, noop_round_trip()[0]])
                else:
                    rtt = statistics.median(noops[args.warmup :]) * 1e3
                assert d == base_d, f"{mode}: decisions differ from in-process"
                med = statistics.median(t[args.warmup :]) * 1e3
                trips = _trips(m) / total
                print(f"{n:>7} {mode:<11} {med:8.2f} {pct(t[args.warmup:], 0.99):8.2f} {_mean(t[args.warmup:]):8.2f} "
                      f"{trips:8.1f} "
                      f"{med - base:9.2f} {med / (base + rtt):14.2f} {rtt:7.3f}")  # fmt: skip
                if args.phases:
                    print(phase_line(ph[args.warmup :]))
                    print(
                        split_line(t[args.warmup :], ph[args.warmup :], "waiting on round trips", server_ms)
                    )
                m.close()
                client.delete_pool(name)
        print("decisions (scheduled ids, tokens, block ids, preemptions) identical in every mode")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
