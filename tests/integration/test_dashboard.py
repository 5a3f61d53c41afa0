"""The Grafana dashboard and the Prometheus rules proven on real data: a scripted load
against the container, mirrored on an in-process engine, then every panel's query,
every recording rule and every alert's expression evaluated by the real Prometheus
that scrapes the container (with deploy/prometheus/alerts.yml loaded, scripts/test.sh):
each returns the series, with the values, that the load implies."""

from __future__ import annotations

import json
import math
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


def _value(result: list[dict[str, Any]]) -> float:
    assert len(result) == 1, result
    return float(result[0]["value"][1])


def _load(target: str, prometheus: str, pool: str) -> dict[str, Any]:
    """Fill the pool past 95 % with requests sharing a system prompt, retry a request
    that does not fit (refused each time, as a scheduler retries it), attach once with
    the wrong block size; the same calls on the reference engine give the expectations.
    The requests stay held (the manager returned, still attached)."""
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
    with pytest.raises(KVCoordError):
        c.attach(pool, "sha256_cbor", BLOCK // 2, "0")  # hashes differently: refused and counted
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


def test_every_panel_rule_and_alert_returns_what_the_load_implies(target: str, prometheus: str) -> None:
    pool = f"dash-{uuid.uuid4().hex[:6]}"
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
            got[(title, legend.split(" ")[0])] = result

        def of_pool(key: tuple[str, str]) -> float:
            return _value([r for r in got[key] if r["metric"].get("pool") == pool])

        assert of_pool(("KV cache usage", "{{pool}}")) == pytest.approx(want["usage"], abs=1e-12)
        assert of_pool(("Prefix cache hit rate", "{{pool}}")) == pytest.approx(ratio, rel=1e-9)
        assert of_pool(("Free blocks and requests", "free")) == want["free"]
        assert of_pool(("Free blocks and requests", "total")) == NUM_BLOCKS - 1
        assert of_pool(("Free blocks and requests", "requests")) == want["requests"]
        assert of_pool(("Clients and handshake refusals", "clients")) == 1
        assert of_pool(("Clients and handshake refusals", "refused")) > 0
        # 1-minute rates of counters that moved by a known amount within the minute: the
        # rate times 60 s is at least that amount (Prometheus extrapolates to the window's end)
        assert of_pool(("Allocation refusals", "{{pool}}")) * 60 >= want["refusals"]
        assert of_pool(("KV events published", "{{pool}}")) > 0
        assert of_pool(("KV events published", "evictions")) * 60 >= want["evictions"]
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
        expected = {"KVCoordPoolNearlyFull": True, "KVCoordRefusalsRising": True,
                    "KVCoordHashHandshakeRefused": True, "KVCoordTargetDown": False}  # fmt: skip
        assert set(alerts) == set(expected), "a new alert needs its expectation here"
        for name, expr in alerts.items():
            result = prom_query(prometheus, expr)
            mine = [r for r in result if r["metric"].get("pool") == pool]
            if name == "KVCoordTargetDown":
                assert result == [], result
            else:
                assert bool(mine) == expected[name], (name, result)
        # the rule without a `for` is firing in Prometheus itself
        firing = wait_for(
            lambda: [
                a for a in json.loads(http_get(f"http://{prometheus}/api/v1/alerts"))["data"]["alerts"]
                if a["labels"].get("alertname") == "KVCoordHashHandshakeRefused"
                and a["labels"].get("pool") == pool and a["state"] == "firing"
            ]
        )  # fmt: skip
        assert firing
    finally:
        want["manager"].close()
        client.delete_pool(pool)
        client.close()
