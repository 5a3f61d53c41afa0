"""The dockerized server, reached only through its published ports (with TLS when the
suite is configured for it, as in CI), and a real Prometheus that scrapes it."""

from __future__ import annotations

import re
import urllib.error
import uuid
from pathlib import Path

import grpc
import pytest
from conftest import (
    METRICS_SCHEME,
    TLS,
    SchedulerRequest,
    connect,
    http_get,
    metrics_text,
    mirrored_step,
    prom_query,
    wait_for,
)
from kvcoord.client import NO_RETRY, KVCoordClient, RemoteKVCacheManager, TLSOptions, UnavailableError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.conformance import load_trace, replay
from kvcoord.conformance.remote import RemoteTarget
from kvcoord.engine import FullAttentionSpec, KVCacheConfig, KVCachePool
from kvcoord.v1 import allocator_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from workload import pool_config, run_many_workers

ROOT = Path(__file__).resolve().parents[2]
TRACES = sorted((ROOT / "tests" / "conformance" / "data").glob("*.jsonl"))
DOCS = (ROOT / "docs" / "metrics.md").read_text()


def scrape(metrics_address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Samples of /metrics, parsed by prometheus-client's own parser."""
    out = {}
    for family in text_string_to_metric_families(metrics_text(metrics_address)):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_health_and_embedded_default(client: KVCoordClient) -> None:
    """The container serves the embedded default pool and reports SERVING."""
    assert client.health() == "SERVING"
    default = client.get_pool("default").pool
    assert default.coordinator == "hybrid" and default.config.num_blocks == 16384


def test_conformance_traces_over_the_wire(target: str) -> None:
    """Every public vLLM trace replays identically against the container."""
    failures = []
    for path in TRACES:
        result = replay(load_trace(path), RemoteTarget(target, timeout=20, tls=TLS))
        if not result.passed:
            failures.append(f"{path.name}: {result.mismatch}")
    assert not failures, failures
    assert len(TRACES) == 19


def test_many_workers_against_the_container(target: str) -> None:
    """Four worker processes share one pool; the checker finds no illegal sharing."""
    pool = f"workers-{uuid.uuid4().hex[:6]}"
    with connect(target) as c:
        c.create_pool(pool, pool_config(120))
    try:
        report = run_many_workers(target, pool, num_workers=4, steps=40, tls=TLS)
        assert not [r["error"] for r in report["results"] if r["error"]]
        assert sum(r["refusals"] for r in report["results"]) > 0
        assert report["final"].num_free_blocks == report["num_blocks"] - 1 and report["reset"]
    finally:
        with connect(target) as c:
            c.delete_pool(pool)


def _known_workload(target: str, pool: str) -> dict[str, int]:
    """Run a fixed workload through the client and the same calls on an in-process engine;
    the engine's answers are the expected metric movements."""
    cfg = pb.PoolConfig(
        num_blocks=40, groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=16))], hash_block_size=16,
        enable_caching=True, enable_kv_cache_events=True, hash_algo="sha256_cbor", hash_seed="0", max_model_len=4096,
    )  # fmt: skip
    ref = KVCachePool(KVCacheConfig(num_blocks=40, groups=(FullAttentionSpec(16),), hash_block_size=16,
                                    enable_kv_cache_events=True, max_model_len=4096))  # fmt: skip
    none = none_hash("sha256_cbor", "0")
    events = 0
    with connect(target) as c:
        c.create_pool(pool, cfg)
        m = RemoteKVCacheManager(c, pool, hash_seed="0")
        system = list(range(1000, 1000 + 160))
        prompts = [system + list(range(i * 50, i * 50 + 30)) for i in range(6)]
        prompts.append(list(range(5000, 5000 + 300)))  # unique: reuses (evicts) freed cached blocks
        prompts.append(list(range(9000, 9000 + 700)))  # 44 blocks > 39 usable: refused
        held = {}
        for i, tokens in enumerate(prompts):
            r = SchedulerRequest(f"q{i}", tokens)
            held[r.request_id] = r
            ref.add_request(
                r.request_id, r.all_token_ids, BlockHasher("sha256_cbor", 16, none).extend(r.all_token_ids)
            )
            mirrored_step(m, ref, r)
            if i % 2:
                m.free(r)
                ref.free(r.request_id)
            events += len(ref.take_events())
        for rid in sorted(ref.requests):  # the rest finish: freed, their blocks stay cached
            m.free(held[rid])
            ref.free(rid)
        m.close()
    lc = ref.lookup_counters
    return {"hits": lc.hits, "queries": lc.queries, "lookups": lc.lookups, "refusals": ref.num_refusals,
            "evictions": ref.block_pool.num_evictions, "allocated": ref.block_pool.num_allocated,
            "events": events + len(ref.take_events())}  # fmt: skip


def test_metric_values_after_a_known_workload(target: str, metrics_address: str, prometheus: str) -> None:
    """Counters move by exactly what the reference engine computed; Prometheus sees the same."""
    pool = f"metrics-{uuid.uuid4().hex[:6]}"
    want = _known_workload(target, pool)
    assert want["hits"] > 0 and want["refusals"] > 0 and want["evictions"] > 0
    got = scrape(metrics_address)
    key = (("pool", pool),)
    assert got[("kvcoord_prefix_cache_hits_tokens_total", key)] == want["hits"]
    assert got[("kvcoord_prefix_cache_queries_tokens_total", key)] == want["queries"]
    assert got[("kvcoord_prefix_cache_lookups_total", key)] == want["lookups"]
    assert got[("kvcoord_allocation_refusals_total", key)] == want["refusals"]
    assert got[("kvcoord_block_evictions_total", key)] == want["evictions"]
    assert got[("kvcoord_blocks_allocated_total", key)] == want["allocated"]
    assert got[("kvcoord_kv_events_published_total", key)] == want["events"]
    assert got[("kvcoord_kv_cache_usage_ratio", key)] == 0.0
    assert got[("kvcoord_blocks_usable", key)] == 39
    # the real Prometheus scraped the same numbers
    expr = f'kvcoord_prefix_cache_hits_tokens_total{{pool="{pool}"}}'
    result = wait_for(
        lambda: [r for r in prom_query(prometheus, expr) if float(r["value"][1]) == want["hits"]]
    )
    assert result, prom_query(prometheus, expr)
    with connect(target) as c:
        c.delete_pool(pool)


def test_prometheus_scrapes_every_documented_series(metrics_address: str, prometheus: str) -> None:
    """Every metric in docs/metrics.md is exported, and Prometheus stores the kvcoord series."""
    documented = set(re.findall(r"^\| `([a-z_]+)`", DOCS, flags=re.M))
    assert len(documented) >= 18
    names = {n for n, _ in scrape(metrics_address)}
    for metric in documented:
        assert any(n == metric or n.startswith(metric + "_") for n in names), f"{metric} not exported"
    up = wait_for(lambda: [r for r in prom_query(prometheus, 'up{job="kvcoord"}') if r["value"][1] == "1"])
    assert up, "Prometheus does not scrape kvcoord"
    series = wait_for(
        lambda: prom_query(prometheus, 'count by (__name__) ({__name__=~"kvcoord_.+|grpc_server_.+"})')
    )
    stored = {r["metric"]["__name__"] for r in series}
    assert {"kvcoord_kv_cache_usage_ratio", "kvcoord_build_info", "grpc_server_handled_total",
            "grpc_server_handling_seconds_bucket"} <= stored  # fmt: skip
    rules = http_get(f"http://{prometheus}/api/v1/rules")
    documented = re.findall(
        r"^\s*- alert: (\w+)", (ROOT / "deploy" / "prometheus" / "alerts.yml").read_text(), re.M
    )
    assert len(documented) >= 9, documented
    for alert in documented:
        assert alert in rules, alert


def test_grpc_series_count_status_codes(target: str, metrics_address: str) -> None:
    """grpc_server_handled_total counts calls by method and status code."""
    before = scrape(metrics_address)
    with connect(target) as c:
        try:
            c.get_stats("no-such-pool")
        except Exception:  # noqa: BLE001 - the NOT_FOUND is what is counted
            pass
    after = scrape(metrics_address)
    labels = (("grpc_code", "NOT_FOUND"), ("grpc_method", "GetStats"), ("grpc_service", "kvcoord.v1.Allocator"),
              ("grpc_type", "unary"))  # fmt: skip
    assert (
        after[("grpc_server_handled_total", labels)]
        == before.get(("grpc_server_handled_total", labels), 0) + 1
    )


@pytest.mark.skipif(TLS is None, reason="the suite runs without TLS (KVCOORD_CLIENT_TLS_CA unset)")
def test_container_refuses_clients_without_tls_or_certificate(target: str) -> None:
    """The TLS container refuses a plaintext client and, when it requires client
    certificates, a TLS client without one: UNAVAILABLE, the call never reaches it."""
    assert TLS is not None
    attempts: list[TLSOptions | None] = [None]
    if TLS.cert_file is not None:
        attempts.append(TLSOptions(ca_file=TLS.ca_file))
    for tls in attempts:
        with KVCoordClient(target, tls=tls, timeout=5, retry=NO_RETRY) as c:
            with pytest.raises(UnavailableError) as info:
                c.list_pools()
        assert info.value.code == grpc.StatusCode.UNAVAILABLE


@pytest.mark.skipif(METRICS_SCHEME != "https", reason="/metrics is plain HTTP in this run")
def test_metrics_endpoint_is_https_only(metrics_address: str) -> None:
    """/metrics answers a verified HTTPS scrape and refuses plain HTTP."""
    assert "kvcoord_build_info" in metrics_text(metrics_address)
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        http_get(f"http://{metrics_address}/metrics", timeout=5)
