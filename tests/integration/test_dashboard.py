"""The Grafana dashboard and the Prometheus rules proven on real data: a scripted load
against the container, mirrored on an in-process engine, then every panel's query,
every recording rule and every alert's expression evaluated by the real Prometheus
that scrapes the container (with deploy/prometheus/alerts.yml loaded, scripts/test.sh):
each returns the series, with the values, that the load implies."""

from __future__ import annotations

import json
import math
import re
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import SchedulerRequest, connect, http_get, mirrored_step, prom_query, wait_for
from kvcoord.client import KVCoordError, RemoteKVCacheManager
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool
from kvcoord.v1 import allocator_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "dashboards" / "kvcoord.json").read_text())
RULES = yaml.safe_load((ROOT / "deploy" / "prometheus" / "alerts.yml").read_text())["groups"]
NUM_BLOCKS = 40  # 39 usable
BLOCK = 16
#: refused allocations in the load: more than 1/s over the alert's 5-minute window
REFUSED_ATTEMPTS = 420
#: one-block requests allocated and freed on the pool's last free block: each stores a
#: block and evicts the one before, pushing the pool's first events out of its buffer
#: (bounded at about two events per block, budget.event_buffer_bytes)
CHURN = 4 * NUM_BLOCKS


def _value(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def _load(target: str, prometheus: str, pool: str) -> dict[str, Any]:
    """Fill the pool past 95 % with requests sharing a system prompt, retry a request
    that does not fit (refused each time, as a scheduler retries it), churn one-block
    requests through the last free block until the pool's first events are dropped
    (a watcher from the start is told of the gap), attach once with the wrong block
    size and once with an 11-second lease (above the 10 s stall bound) never renewed (the reaper expires it); the same
    calls on the reference engine give the expectations. The requests stay held (the
    manager returned, still attached)."""
    cfg = pb.PoolConfig(
        num_blocks=NUM_BLOCKS, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=BLOCK))],
        hash_block_size=BLOCK, enable_caching=True, enable_kv_cache_events=True, hash_algo="sha256_cbor",
        hash_seed="0", max_model_len=4096,
    )  # fmt: skip
    ref = KVCachePool(KVCacheConfig(num_blocks=NUM_BLOCKS, groups=(FullAttentionSpec(BLOCK),),
                                    hash_block_size=BLOCK, enable_kv_cache_events=True, max_model_len=4096))  # fmt: skip
    hasher_none = none_hash("sha256_cbor", "0")
    c = connect(target, timeout=20)
    c.create_pool(pool, cfg)
    # Prometheus holds the counters at 0 before the load: a rate over a window starts there
    assert wait_for(
        lambda: prom_query(prometheus, f'kvcoord_prefix_cache_queries_tokens_total{{pool="{pool}"}} == 0')
    )
    m = RemoteKVCacheManager(c, pool, hash_seed="0")
    system = list(range(1000, 1160))  # 10 shared blocks
    prompts = [system + list(range(i * 50, i * 50 + 30)) for i in range(4)]  # 2 own blocks each
    prompts.append(list(range(5000, 5000 + 20 * BLOCK)))  # 20 more: 38 of 39 blocks held
    waiting = list(range(9000, 9000 + 100))  # 7 blocks: never fits

    for i, tokens in enumerate([*prompts, waiting]):
        r = SchedulerRequest(f"q{i}", tokens)
        ref.add_request(r.request_id, tokens, BlockHasher("sha256_cbor", BLOCK, hasher_none).extend(tokens))
        placed = mirrored_step(m, ref, r)
        while not placed and ref.num_refusals < REFUSED_ATTEMPTS:
            placed = mirrored_step(m, ref, r)
        assert placed == (tokens is not waiting)
    for i in range(CHURN):
        r = SchedulerRequest(f"churn{i}", list(range(20_000 + i * BLOCK, 20_000 + (i + 1) * BLOCK)))
        ref.add_request(
            r.request_id,
            r.all_token_ids,
            BlockHasher("sha256_cbor", BLOCK, hasher_none).extend(r.all_token_ids),
        )
        assert mirrored_step(m, ref, r)
        m.free(r)
        ref.free(r.request_id)
    m.flush()  # the last free is queued for the manager's next Step: send it
    gap = [e.gap for e in c.watch_events(pool, 1, timeout=1.0)]  # the watcher of the gap alert
    assert gap[0] and not any(gap[1:]), "the churn did not push the first events out of the buffer"
    with pytest.raises(KVCoordError):
        c.attach(pool, "sha256_cbor", BLOCK // 2, "0")  # hashes differently: refused and counted
    c.attach(pool, "sha256_cbor", BLOCK, "0", client_name="gone", lease_seconds=12.0)  # never renewed
    assert wait_for(
        lambda: prom_query(prometheus, f'kvcoord_sessions_expired_total{{pool="{pool}"}} == 1'), 30
    )
    lc = ref.lookup_counters
    return {"client": c, "manager": m, "hits": lc.hits, "queries": lc.queries, "refusals": ref.num_refusals,
            "free": ref.num_free_blocks, "usage": ref.usage, "requests": len(ref.requests),
            "evictions": ref.block_pool.num_evictions}  # fmt: skip


def _panel_queries() -> list[tuple[str, str, str]]:
    out = []
    for panel in DASHBOARD["panels"]:
        for t in panel["targets"]:
            out.append((panel["title"], t.get("legendFormat", ""), t["expr"]))
    return out


def _instant(expr: str, pool: str) -> str:
    """The query Grafana sends with the dashboard's $pool set to ``pool`` (1-minute rates)."""
    return expr.replace("$pool", pool).replace("$__rate_interval", "1m")


def _query_at(prometheus: str, expr: str, at: float) -> list[dict[str, Any]]:
    """An instant query evaluated at ``at`` (Unix seconds): several queries, one instant."""
    query = urllib.parse.urlencode({"query": expr, "time": f"{at:.3f}"})
    body = json.loads(http_get(f"http://{prometheus}/api/v1/query?{query}"))
    assert body["status"] == "success", body
    return list(body["data"]["result"])


_STEP_ENGINE = "sum(kvcoord_step_engine_seconds_count) or vector(0)"
_STEP_OK = 'sum(grpc_server_handled_total{grpc_method="Step",grpc_code="OK"}) or vector(0)'


def _steps_so_far(prometheus: str) -> tuple[float, float]:
    """Steps the engine applied and Step RPCs answered OK, as of one instant."""
    at = time.time()
    return _value(_query_at(prometheus, _STEP_ENGINE, at)), _value(_query_at(prometheus, _STEP_OK, at))


def _steps_since(prometheus: str, before: tuple[float, float]) -> float:
    """Steps answered OK since ``before`` once the engine has observed nearly as many
    (0 until then). The two counters need not be equal on a loaded machine: a Step the
    engine applied whose caller gave up first is observed but not answered OK, and a
    Step answered OK just after its caller's deadline is retried and answered from the
    kept answer, OK without the engine. Each such Step moves them apart by one, so they
    may differ by a few, never by a share of the load."""
    engine, ok = _steps_so_far(prometheus)
    d_engine, d_ok = engine - before[0], ok - before[1]
    return d_ok if d_engine > 0 and abs(d_engine - d_ok) <= max(3, 0.01 * d_ok) else 0


def test_every_panel_rule_and_alert_returns_what_the_load_implies(target: str, prometheus: str) -> None:
    pool = f"dash-{uuid.uuid4().hex[:6]}"
    steps_before = _steps_so_far(prometheus)
    want = _load(target, prometheus, pool)
    client = want["client"]
    try:
        assert want["hits"] > 0 and want["refusals"] >= REFUSED_ATTEMPTS and want["usage"] > 0.95
        sel = f'{{pool="{pool}"}}'
        # Prometheus scraped the load's end, and evaluated the rules after it
        assert wait_for(
            lambda: prom_query(prometheus, f"kvcoord_allocation_refusals_total{sel} == {want['refusals']}")
        )
        assert wait_for(lambda: prom_query(prometheus, f"kvcoord_hash_handshake_refusals_total{sel} == 1"))
        ratio = want["hits"] / want["queries"]
        assert wait_for(
            lambda: prom_query(
                prometheus, f"abs(pool:kvcoord_prefix_cache_hit_ratio:rate1m{sel} - {ratio}) < 1e-9"
            )
        )

        # a counter series born with the refused Attach has a rate once scraped twice
        refused = 'grpc_server_handled_total{grpc_method="Attach",grpc_code="FAILED_PRECONDITION"}'
        assert wait_for(lambda: prom_query(prometheus, f"count_over_time({refused}[1m]) >= 2"))
        got: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for title, legend, expr in _panel_queries():
            result = prom_query(prometheus, _instant(expr, pool))
            assert result, f"panel {title!r} ({legend}) returned no series: {_instant(expr, pool)}"
            got[(title, legend.split(" {{")[0])] = result  # the legend without its labels

        def of_pool(key: tuple[str, str]) -> float:
            return _value([r for r in got[key] if r["metric"].get("pool") == pool])

        assert of_pool(("KV cache usage", "{{pool}}")) == pytest.approx(want["usage"], abs=1e-12)
        assert of_pool(("Prefix cache hit rate", "{{pool}}")) == pytest.approx(ratio, rel=1e-9)
        assert of_pool(("Free blocks and requests", "free")) == want["free"]
        assert of_pool(("Free blocks and requests", "total")) == NUM_BLOCKS - 1
        assert of_pool(("Free blocks and requests", "requests")) == want["requests"]
        assert of_pool(("Sessions", "live")) == 1  # the manager; the 1-second lease expired
        assert of_pool(("Sessions", "expired")) > 0
        assert of_pool(("Sessions", "refused")) > 0
        # 1-minute rates of counters that moved by a known amount within the minute: the
        # rate times 60 s is at least that amount (Prometheus extrapolates to the window's end)
        assert of_pool(("Allocation refusals", "{{pool}}")) * 60 >= want["refusals"]
        assert of_pool(("KV events published", "{{pool}}")) > 0
        assert of_pool(("KV events published", "evictions")) * 60 >= want["evictions"]
        gaps = {r["metric"]["stream"]: float(r["value"][1]) for r in got[("KV events published", "gaps")]
                if r["metric"].get("pool") == pool}  # fmt: skip
        assert set(gaps) == {"watch", "step", "zmq"} and gaps["watch"] > 0, (
            gaps
        )  # (every stream exported at 0)
        methods = {
            (r["metric"]["grpc_method"], r["metric"]["grpc_code"])
            for r in got[("RPC rate by method", "{{grpc_method}}")]
        }
        # the manager's Step calls and the refused Attach (a hash mismatch)
        assert {("Step", "OK"), ("Attach", "OK"), ("Attach", "FAILED_PRECONDITION")} <= methods
        for q in ("p50", "p99"):
            latency = {
                r["metric"]["grpc_method"]: float(r["value"][1]) for r in got[("RPC latency p50 / p99", q)]
            }
            assert 0 < latency["Step"] <= 10 and math.isfinite(latency["Step"]), latency
        # the load's mutations waited for journal commits (the image journals)
        for q in ("p50", "p99"):
            commit = _value(got[("Journal commit latency p50 / p99", q)])
            assert 0 < commit <= 10 and math.isfinite(commit), (q, commit)
        # Step latency: the RPC's quantiles, the engine's share and its cost per operation
        step = "Step latency p50 / p99"
        for legend in ("RPC p50", "RPC p99", "engine p50", "engine p99", "engine per operation"):
            value = _value(got[(step, legend)])
            assert 0 < value <= 10 and math.isfinite(value), (legend, value)
        assert {r["metric"]["grpc_method"] for r in got[(step, "RPC p99")]} == {"Step"}
        # the Steps of the load the server answered OK were (nearly all) observed by the engine
        assert wait_for(lambda: _steps_since(prometheus, steps_before) > 0), (
            steps_before,
            _steps_so_far(prometheus),
        )
        cores = _value(got[("Server CPU and memory", "cores")])
        assert 0 < cores < 64 and math.isfinite(cores), cores
        assert _value(got[("Server CPU and memory", "resident")]) > 1 << 20
        pools_now = {r["metric"]["pool"] for r in prom_query(prometheus, "kvcoord_blocks_usable")}
        assert pool in pools_now  # $pool values
        # a single node serves every pool it holds: one series (no replica label) counting them
        per_replica = got[("Pools per replica", "{{replica}}")]
        assert [r["metric"].get("replica", "") for r in per_replica] == [""]
        assert _value(per_replica) == len(pools_now)

        # every recording rule has a series for this pool (or method), every alert fires
        # exactly where the load says it must
        for group in RULES:
            for rule in group["rules"]:
                if "record" in rule:
                    result = prom_query(prometheus, rule["record"])
                    assert result, f"recording rule {rule['record']} has no series"
        alerts = {r["alert"]: r["expr"] for g in RULES for r in g["rules"] if "alert" in r}
        # True / False: the load makes this pool's (or the target's) condition hold or not;
        # None: a latency or CPU threshold that depends on the machine, not on the load
        expected = {"KVCoordPoolNearlyFull": True, "KVCoordRefusalsRising": True,
                    "KVCoordHashHandshakeRefused": True, "KVCoordTargetDown": False,
                    "KVCoordSessionsExpiring": True, "KVCoordEventStreamGaps": True,
                    "KVCoordStepSlow": None, "KVCoordJournalCommitSlow": None,
                    "KVCoordCPUSaturated": None}  # fmt: skip
        assert set(alerts) == set(expected), "a new alert needs its expectation here"
        at = time.time()
        for name, expr in alerts.items():
            # each alert is `<series> <op> <threshold>`: its series exist (for this pool
            # where they have one), and the alert holds exactly where they pass it
            lhs, op, threshold = re.fullmatch(r"(.+) (>|==) ([0-9.]+)", expr).groups()  # type: ignore[union-attr]
            series = _query_at(prometheus, lhs, at)
            result = _query_at(prometheus, expr, at)
            if any("pool" in r["metric"] for r in series):
                series = [r for r in series if r["metric"].get("pool") == pool]
                result = [r for r in result if r["metric"].get("pool") == pool]
            assert series, (name, lhs)
            passing = [r for r in series if (float(r["value"][1]) > float(threshold) if op == ">"
                                             else float(r["value"][1]) == float(threshold))]  # fmt: skip
            assert sorted(json.dumps(r["metric"], sort_keys=True) for r in result) == sorted(
                json.dumps(r["metric"], sort_keys=True) for r in passing
            ), (name, series, result)
            if expected[name] is not None:
                assert bool(result) == expected[name], (name, series, result)
        # the rules without a `for` are firing in Prometheus itself
        at_once = [r["alert"] for g in RULES for r in g["rules"] if "alert" in r and "for" not in r]
        assert set(at_once) == {
            "KVCoordHashHandshakeRefused",
            "KVCoordSessionsExpiring",
            "KVCoordEventStreamGaps",
        }

        def firing() -> set[str]:
            alerts = json.loads(http_get(f"http://{prometheus}/api/v1/alerts"))["data"]["alerts"]
            return {
                a["labels"]["alertname"]
                for a in alerts
                if a["labels"].get("pool") == pool and a["state"] == "firing"
            }

        assert wait_for(lambda: set(at_once) <= firing()), firing()
    finally:
        want["manager"].close()
        client.delete_pool(pool)
        client.close()
