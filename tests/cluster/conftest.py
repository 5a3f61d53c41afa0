"""Fixtures of the cluster tests: a real etcd per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from etcd_process import Etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    server = Etcd(tmp_path_factory.mktemp("etcd"))
    try:
        yield server
    finally:
        server.stop()
