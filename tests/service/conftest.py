"""Service fixtures: a real server in-process on a free port, and a client to it."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
from kvcoord.client import KVCoordClient
from kvcoord.service.testing import InProcessServer, ManualClock
from support import POOL_TOML


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def make_server(clock: ManualClock) -> Iterator[Callable[..., InProcessServer]]:
    """Factory: start a server with the given TOML (default: pool "p", full4 + sliding4 w8)."""
    started: list[InProcessServer] = []

    def make(config_text: str = POOL_TOML, **kw: object) -> InProcessServer:
        s = InProcessServer(config_text, clock=clock, **kw).start()  # type: ignore[arg-type]
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def server(make_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_server()


@pytest.fixture
def client(server: InProcessServer) -> Iterator[KVCoordClient]:
    with KVCoordClient(server.address, timeout=10) as c:
        yield c
