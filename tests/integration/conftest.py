"""Fixtures for the integration suite: it reaches kvcoord only through the addresses in
the environment, so it runs against the CI container or any deployment.

  KVCOORD_TARGET      host:port of the gRPC listener (required)
  KVCOORD_METRICS     host:port of the /metrics listener (required)
  KVCOORD_PROMETHEUS  host:port of a Prometheus scraping KVCOORD_METRICS (required)
  KVCOORD_IMAGE       the image under test, for the tests that start containers of their
                      own (optional; those tests are collected only when it is set)
"""

from __future__ import annotations

import json
import os
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from kvcoord.client import KVCoordClient

collect_ignore = [] if os.environ.get("KVCOORD_IMAGE") else ["test_image.py"]


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
    with KVCoordClient(target, timeout=20) as c:
        yield c


def http_get(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 - loopback only
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
