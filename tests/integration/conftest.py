"""Fixtures for the integration suite: it reaches kvcoord only through the addresses in
the environment, so it runs against the CI container or any deployment.

  KVCOORD_TARGET      host:port of the gRPC listener (required)
  KVCOORD_METRICS     host:port of the /metrics listener (required)
  KVCOORD_PROMETHEUS  host:port of a Prometheus scraping KVCOORD_METRICS (required)
  KVCOORD_IMAGE       the image under test, for the tests that start containers of their
                      own (optional; those tests are collected only when it is set)
  KVCOORD_CONTAINER   the container serving KVCOORD_TARGET, on fixed host ports with its
                      data directory on a volume: test_container_restart.py kills and
                      starts it mid-workload (optional; skipped when unset)
  KVCOORD_CLIENT_TLS_CA, KVCOORD_CLIENT_TLS_CERT, KVCOORD_CLIENT_TLS_KEY
                      PEM files: the suite's gRPC clients and metrics scrapes use TLS
                      (mutual TLS with the cert and key) when the CA is set (optional;
                      scripts/test.sh sets them: the CI container runs with mutual TLS)
  KVCOORD_METRICS_SCHEME  http (default) or https
  KVCOORD_CLUSTER_TARGETS, KVCOORD_CLUSTER_CONTAINERS, KVCOORD_CLUSTER_PROMETHEUS
                      the cluster stack (deploy/docker-compose.cluster.yml) for
                      test_cluster.py (collected only when the targets are set;
                      scripts/test.sh starts the stack and sets them)
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, TLSOptions

collect_ignore = [] if os.environ.get("KVCOORD_IMAGE") else ["test_image.py"]
if not os.environ.get("KVCOORD_CLUSTER_TARGETS"):
    collect_ignore.append("test_cluster.py")

_CA = os.environ.get("KVCOORD_CLIENT_TLS_CA") or None
_CERT = os.environ.get("KVCOORD_CLIENT_TLS_CERT") or None
_KEY = os.environ.get("KVCOORD_CLIENT_TLS_KEY") or None
#: TLS of the suite's clients (None: plaintext), from the environment.
TLS = TLSOptions(_CA, _CERT, _KEY) if _CA else None
METRICS_SCHEME = os.environ.get("KVCOORD_METRICS_SCHEME", "http")


def connect(target: str, **kwargs: Any) -> KVCoordClient:
    """A client to the deployment under test, with the suite's TLS settings."""
    return KVCoordClient(target, tls=TLS, **kwargs)


def metrics_context() -> ssl.SSLContext | None:
    """The HTTPS client context for /metrics (the suite's CA and client certificate)."""
    if METRICS_SCHEME != "https":
        return None
    ctx = ssl.create_default_context(cafile=_CA)
    if _CERT and _KEY:
        ctx.load_cert_chain(_CERT, _KEY)
    return ctx


def metrics_text(metrics_address: str) -> str:
    return http_get(f"{METRICS_SCHEME}://{metrics_address}/metrics", context=metrics_context())


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set: run the integration suite with `make integration`")
    return value


@pytest.fixture(scope="session")
def target() -> str:
    return _env("KVCOORD_TARGET")


@pytest.fixture(scope="session")
def metrics_address() -> str:
    return _env("KVCOORD_METRICS")


@pytest.fixture(scope="session")
def prometheus() -> str:
    return _env("KVCOORD_PROMETHEUS")


@pytest.fixture
def client(target: str) -> Iterator[KVCoordClient]:
    with connect(target, timeout=20) as c:
        yield c


def http_get(url: str, timeout: float = 10.0, context: ssl.SSLContext | None = None) -> str:
    with urllib.request.urlopen(url, timeout=timeout, context=context) as resp:  # noqa: S310 - loopback only
        return str(resp.read().decode("utf-8"))


def prom_query(prometheus: str, expr: str) -> list[dict[str, Any]]:
    """Instant query through Prometheus' HTTP API."""
    url = f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    body = json.loads(http_get(url))
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def wait_for(predicate: Any, timeout: float = 60.0, interval: float = 0.5) -> Any:
    """Poll ``predicate`` until it returns a truthy value or ``timeout`` passes (bounded)."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    return last


class SchedulerRequest:
    """What RemoteKVCacheManager reads of a vLLM request."""

    def __init__(self, rid: str, tokens: list[int]) -> None:
        self.request_id = rid
        self.all_token_ids = tokens
        self.num_computed_tokens = 0


def mirrored_step(manager: Any, ref: Any, r: SchedulerRequest) -> bool:
    """One scheduling attempt of ``r`` through the remote manager and the same on the
    in-process reference engine ``ref``: their hits and refusals must agree. True when
    the blocks were allocated."""
    hit, n = manager.get_computed_blocks(r)
    want = ref.get_computed_blocks(r.request_id)
    assert n == want.num_tokens
    new = manager.allocate_slots(r, len(r.all_token_ids) - n, n, hit)
    exp = ref.allocate_slots(r.request_id, len(r.all_token_ids) - n, n, want)
    assert (new is None) == (exp is None)
    return new is not None
