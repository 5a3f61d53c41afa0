"""A retried Attach (AttachRequest.attach_key) gets the session its lost first answer
named, across a restart too (the key is journaled and in snapshots). The servicer's
handlers are called directly (no gRPC)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from kvcoord.client import _requests as rq
from kvcoord.v1 import allocator_pb2 as pb
from test_journal import Aborted, Node, _pool_config, state_of


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _attach(node: Node, key: str, exclusive: bool = True) -> pb.AttachResponse:
    request = rq.attach("p", "sha256_cbor", 4, "0", "engine-0", 5, exclusive=exclusive)
    request.attach_key = key
    return node.call("Attach", request)


@pytest.mark.parametrize("snapshot", [False, True])
def test_a_retried_attach_gets_the_same_session_after_a_restart(
    loop: asyncio.AbstractEventLoop, tmp_path: Path, snapshot: bool
) -> None:
    """The key is journaled with the session (in the attach record, or a snapshot
    taken after it): a retry answered by the recovered server gets the same session;
    another key is refused the exclusive pool."""
    node = Node(loop, tmp_path)
    node.call("CreatePool", pb.CreatePoolRequest(name="p", config=_pool_config()))
    first = _attach(node, "k1")
    assert _attach(node, "k1").session_id == first.session_id  # a retry, before any restart
    if snapshot:

        async def take() -> None:
            node.recovery.recorder.snapshot()  # type: ignore[attr-defined]

        loop.run_until_complete(take())
    node.settle()
    before = state_of(node)
    node.crash()
    again = Node(loop, tmp_path)
    assert state_of(again) == before
    assert (again.recovery.snapshot_seq > 0, again.recovery.records == 0) == (snapshot, snapshot)
    assert again.registry.sessions.sessions[first.session_id].attach_key == "k1"
    retry = _attach(again, "k1")
    assert retry.session_id == first.session_id and retry.exclusive
    assert list(again.registry.sessions.sessions) == [first.session_id]
    with pytest.raises(Aborted, match="exclusive session"):
        _attach(again, "k2")


def test_an_attach_key_with_another_exclusive_is_refused(
    loop: asyncio.AbstractEventLoop, tmp_path: Path
) -> None:
    node = Node(loop, tmp_path)
    node.call("CreatePool", pb.CreatePoolRequest(name="p", config=_pool_config()))
    _attach(node, "k1", exclusive=False)
    with pytest.raises(Aborted, match="attach_key 'k1' was used"):
        _attach(node, "k1", exclusive=True)
    assert _attach(node, "k2", exclusive=False).session_id  # keys are per Attach, not per client
    assert len(node.registry.sessions.sessions) == 2
