"""The watch a replica keeps on its cluster's keys in the store (etcd): one gRPC stream
of its own, ended at once when cancelled (:func:`follow_changes`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .cluster_store import ClusterError, prefix_range

__all__ = ["follow_changes"]


async def follow_changes(client: Any, prefix: bytes, changed: Callable[[], None], timeout: float) -> None:
    """Watch every key under ``prefix`` (it ends in "/"): ``changed()`` once the
    watch is made (what changed before it is read then) and at every change after.
    Returns never: raises when the watch is not made within ``timeout`` or the stream
    fails or ends; cancelled, it ends the stream at once.

    One gRPC stream of its own, not aetcd's watch: aetcd queues watch requests (10)
    behind a lock that its cancel and its client's close take too; with the store's
    answers lost (a member frozen, its replies dropped) the client's writes stall, the
    queue fills, and watch_prefix, the watch's cancel and the client's close each
    waited forever (a replica's stop hung past every lease; tests/cluster/test_waits.py).
    Here nothing is queued or locked, and nothing is left behind that fires later.
    """
    from aetcd import rpc  # type: ignore[import-untyped]  # the "cluster" extra (store_client says so when it is missing)

    if getattr(client, "channel", None) is None:
        raise ClusterError("not connected to the cluster store")
    call = rpc.WatchStub(client.channel).Watch(metadata=client.metadata)
    answers = aiter(call)
    try:
        create = rpc.WatchCreateRequest(key=prefix, range_end=prefix_range(prefix)[1])
        async with asyncio.timeout(timeout):
            await call.write(rpc.WatchRequest(create_request=create))
            made = await anext(answers, None)
        if made is None or not made.created or made.canceled:
            raise ClusterError(f"the cluster store did not make the watch: {made}")
        changed()
        async for answer in answers:
            if answer.canceled or answer.compact_revision:
                raise ClusterError(f"the cluster store cancelled the watch: {answer.cancel_reason!r}")
            if answer.events:
                changed()
        raise ClusterError("the cluster store ended the watch")
    finally:
        call.cancel()
