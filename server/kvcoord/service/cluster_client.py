"""The etcd client (aetcd) a replica talks to its cluster store with: how it is made
(:func:`store_client`: its channel's keepalive and limits) and closed
(:func:`close_client`: never opened again by a later call). :mod:`.cluster_store`
makes the calls."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["KEEPALIVE_SECONDS", "KEEPALIVE_TIMEOUT_SECONDS", "ClusterError", "close_client", "store_client"]

logger = logging.getLogger(__name__)


#: seconds without a byte from the store member in use before the channel pings it
#: (HTTP/2 PING, only while a call is open: the watch always is). etcd closes a
#: connection whose client pings more often than its --grpc-keepalive-min-time
#: (5 s by default; GOAWAY "too_many_pings"), and refuses pings on a connection with no
#: call open: 6 s, no pings without calls.
KEEPALIVE_SECONDS = 6.0
#: seconds a ping may go unanswered before the connection is closed and the channel
#: connects again (another member, with several endpoints): a dead connection (a
#: member frozen, a partition that drops packets, answers lost) is left within about
#: KEEPALIVE_SECONDS + this after the last byte it brought, inside the default lease
KEEPALIVE_TIMEOUT_SECONDS = 3.0


class ClusterError(Exception):
    """The cluster store cannot be reached or refuses this replica (at start)."""


def store_client(endpoint: str, timeout: float) -> Any:
    try:
        import aetcd  # type: ignore[import-untyped]  # the "cluster" extra: only a clustered replica needs it
    except ImportError:
        raise ClusterError(
            "[cluster] needs etcd's client: pip install 'kvcoord[cluster]' (the aetcd package)"
        ) from None

    host, _, port = endpoint.rpartition(":")
    # a pool's journal in the store is read whole when it is rebuilt: a large pool's
    # base alone passes gRPC's default 4 MiB limit of an answer
    options = {
        "grpc.max_receive_message_length": -1,
        # without keepalive nothing closed a connection to a member that stopped
        # answering: TCP never gives up while the peer's kernel acknowledges (a frozen
        # member), nor once lost answers broke the connection's HTTP/2 framing; every
        # store call timed out until then (tests/cluster/test_keepalive.py)
        "grpc.keepalive_time_ms": int(KEEPALIVE_SECONDS * 1000),
        "grpc.keepalive_timeout_ms": int(KEEPALIVE_TIMEOUT_SECONDS * 1000),
        # how long any ping waits for its answer (gRPC's default: 60 s)
        "grpc.http2.ping_timeout_ms": int(KEEPALIVE_TIMEOUT_SECONDS * 1000),
        # keep pinging while calls wait and nothing is sent (the default stops at 2)
        "grpc.http2.max_pings_without_data": 0,
        # a channel of its own connections: gRPC shares a connection among the
        # channels of one process with the same target and options, and a new client
        # (ClusterStore.reconnect) got the very connection it was made to leave
        "grpc.use_local_subchannel_pool": 1,
    }
    return aetcd.Client(host=host, port=int(port), timeout=timeout, options=options)


async def close_client(client: Any, timeout: float) -> None:
    """Close an etcd client, within ``timeout`` (logged past it: the process is
    stopping, or the client is replaced). Nothing of ours waits on the store in it: the
    watch is :func:`.cluster_watch.follow_changes`' (aetcd's watcher, never set up, has nothing queued).
    A call made on it later fails (ConnectionFailedError, a store failure its caller
    retries on the client in use): aetcd opened a new channel for it, to the endpoint
    left, never closed."""
    try:
        async with asyncio.timeout(timeout):
            await client.close()
    except Exception as exc:  # noqa: BLE001 - given up: the process stops, or the client is replaced
        logger.warning("closing the cluster store client failed: %r", exc)
    finally:
        client.connect = _closed  # (every call of aetcd's client connects first)


async def _closed() -> None:
    from aetcd import exceptions  # (the "cluster" extra: store_client made this client)

    raise exceptions.ConnectionFailedError("this cluster store client is closed: the call was not sent")
