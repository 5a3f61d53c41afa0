"""Fixtures of the cluster tests: a real etcd (one member, or three) per test module."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeVar

import pytest
from etcd_process import Etcd, EtcdCluster

S = TypeVar("S", Etcd, EtcdCluster)


def _until_done(server: S) -> Iterator[S]:
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Etcd]:
    yield from _until_done(Etcd(tmp_path_factory.mktemp("etcd")))


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """Three etcd members (a real Raft quorum: faults kill or restart members)."""
    yield from _until_done(EtcdCluster(tmp_path_factory.mktemp("etcd3")))
