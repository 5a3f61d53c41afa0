"""Where a ScorePools call's time goes on the server (bench/score.py's 64-pool workload).

``--stages``: on an in-process server's loop, each stage of the handler for the same
calls, in turns: the request parsed, bounds-checked and its hashes copied out; the
scoring (``score_pools`` with the index); the answer built as messages and serialized
(the block-id path, and main's path before fix-router22) and the same answer as
``ScoreEncoder`` bytes (asserted byte-equal on every call).

``--inside``: an in-process server whose handler and ``score_pools`` are timed from
inside while a client in another process calls ScorePools and GetPool in turns: how
much of the client's time is the handler, and how much of that the scoring.

    python3 bench/score_stages.py --stages --samples 1000
    python3 bench/score_stages.py --inside --samples 1000
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "client"), str(ROOT / "server"), str(ROOT / "bench")]

import score as bench  # noqa: E402
from kvcoord.client import KVCoordClient  # noqa: E402
from kvcoord.client import _requests as rq  # noqa: E402
from kvcoord.client.routing import hash_prompt  # noqa: E402
from kvcoord.service import routing_calls  # noqa: E402
from kvcoord.service import servicer as servicer_module  # noqa: E402
from kvcoord.service.bounds import check_request  # noqa: E402
from kvcoord.service.score_wire import (  # noqa: E402
    ScoreEncoder,  # noqa: E402
    prompts_from_pb,
    scores_to_pb,
)
from kvcoord.service.scoring import score_pools  # noqa: E402
from kvcoord.service.testing import InProcessServer  # noqa: E402
from kvcoord.v1 import allocator_pb2 as pb  # noqa: E402

POOLS = 64


def _server() -> tuple[InProcessServer, list[str], list[bytes]]:
    prompt, others = bench.prompts()
    local = InProcessServer("[limits]\nmax_pools = 128\n").start()
    with KVCoordClient(local.address, timeout=30) as c:
        names = bench.build(c, POOLS, prompt)
        infos = [p for p in c.list_pools().pools if p.name in names]
        requests = [
            rq.score_pools(bench.PROMPT_TOKENS, hash_prompt(infos, t), names, False, 0.0).SerializeToString()
            for t in [prompt, *others]
        ]
    return local, names, requests


def stages(samples: int) -> None:
    local, _, requests = _server()
    registry = local.running.servicer.registry  # type: ignore[union-attr]
    encoder = ScoreEncoder()

    def run(n: int) -> dict[str, float]:
        out: dict[str, list[float]] = {
            "parse + bounds check + prompts copied out": [],
            "score_pools (the index)": [],
            "answer as messages, serialized": [],
            "answer as ScoreEncoder bytes": [],
        }
        for k in range(n):
            t0 = time.perf_counter()
            request = pb.ScorePoolsRequest.FromString(requests[k % len(requests)])
            check_request(request, registry.limits)
            prompts = prompts_from_pb(request.prompts)
            t1 = time.perf_counter()
            s = score_pools(registry.served(), lambda _: True, list(request.candidate_pools), request.num_tokens,
                            prompts, "", None, registry.score_index)  # fmt: skip
            t2 = time.perf_counter()
            as_messages = scores_to_pb(s.scores, s.unscored, False).SerializeToString()
            t3 = time.perf_counter()
            as_bytes = encoder.encode(s.scores, s.unscored)
            t4 = time.perf_counter()
            assert as_messages == as_bytes
            for series, a, b in zip(out.values(), (t0, t1, t2, t3), (t1, t2, t3, t4), strict=True):
                series.append(b - a)
        return {k: statistics.median(v) * 1e6 for k, v in out.items()}

    try:
        for _ in range(3):
            print(
                "  ".join(f"{k}: {v:.1f} us" for k, v in local.call(functools.partial(run, samples)).items())
            )
    finally:
        local.stop()


_CLIENT = r"""
import json, statistics, sys, time
sys.path[:0] = [ROOT + "/client", ROOT + "/server", ROOT + "/bench"]
import score as bench
from kvcoord.client import KVCoordClient
from kvcoord.client.routing import hash_prompt
prompt, others = bench.prompts()
with KVCoordClient(ADDRESS, timeout=30) as c:
    infos = list(c.list_pools().pools)
    names = [p.name for p in infos]
    hashed = [hash_prompt(infos, t) for t in [prompt, *others]]
    score, get = [], []
    for k in range(WARM + SAMPLES):
        t = time.perf_counter(); c.score_pools(bench.PROMPT_TOKENS, hashed[k % 8], names); score.append(time.perf_counter() - t)
        t = time.perf_counter(); c.get_pool(names[0]); get.append(time.perf_counter() - t)
print(json.dumps([statistics.median(score[WARM:]), statistics.median(get[WARM:])]))
"""


def inside(samples: int, warm: int = 200) -> None:
    handler_times: list[float] = []
    scoring_times: list[float] = []
    real_score = routing_calls.score_pools
    real_handler = servicer_module.AllocatorServicer.ScorePools

    def timed_score(*args: Any, **kw: Any) -> Any:
        t = time.perf_counter()
        try:
            return real_score(*args, **kw)
        finally:
            scoring_times.append(time.perf_counter() - t)

    async def timed_handler(self: Any, request: Any, context: Any) -> Any:
        t = time.perf_counter()
        try:
            return await real_handler(self, request, context)
        finally:
            handler_times.append(time.perf_counter() - t)

    routing_calls.score_pools = timed_score  # type: ignore[assignment]
    servicer_module.AllocatorServicer.ScorePools = timed_handler  # type: ignore[method-assign]
    local, _, _ = _server()
    try:
        code = (
            _CLIENT.replace("ROOT", repr(str(ROOT)))
            .replace("ADDRESS", repr(local.address))
            .replace("WARM", str(warm))
            .replace("SAMPLES", str(samples))
        )
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
        )
        score, get = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        local.stop()
        routing_calls.score_pools = real_score
        servicer_module.AllocatorServicer.ScorePools = real_handler  # type: ignore[method-assign]
    p50 = lambda v: statistics.median(v[warm:]) * 1e3  # noqa: E731
    print(f"client: ScorePools p50 {score * 1e3:.3f} ms, GetPool p50 {get * 1e3:.3f} ms")
    print(
        f"server: ScorePools handler p50 {p50(handler_times):.3f} ms, of which score_pools {p50(scoring_times):.3f} ms"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--stages", action="store_true")
    ap.add_argument("--inside", action="store_true")
    ap.add_argument("--samples", type=int, default=1000)
    a = ap.parse_args()
    if not (a.stages or a.inside):
        ap.error("choose --stages and/or --inside")
    if a.stages:
        stages(a.samples)
    if a.inside:
        inside(a.samples)


if __name__ == "__main__":
    main()
