"""An Attach sent to a replica that swallows it (a stopped owner's address whose packets
go nowhere: the call ends DEADLINE_EXCEEDED) goes to the next replica at once, as a read
or a keyed call does: sent again under its attach_key, it gets the session a lost
answer named, so another replica routing it is as safe as a keyed call's retry. It used
to wait a backoff of the retry policy first (and with no retry left, failed).

A real server (real gRPC, the asyncio client); the unreachable replica is a TCP socket
the kernel accepts connections on and nothing ever answers. No retry is allowed, so
only the routes can send a call again."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

from durable_server import free_port
from kvcoord.client import NO_RETRY, AsyncKVCoordClient
from kvcoord.service.config import parse_config
from kvcoord.service.server import start_server
from test_replicas import POOL_CONFIG

#: each call's deadline at the swallowing address (a bound, not a measurement)
CALL = 1.0


def test_an_attach_swallowed_by_one_replica_goes_to_the_next_at_once(tmp_path: Path) -> None:
    hole = socket.create_server(("127.0.0.1", 0))  # connections queue in the kernel: no answer, ever
    swallowing = f"127.0.0.1:{hole.getsockname()[1]}"
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(f'[server]\nlisten = ["{address}"]\ndata_dir = "{tmp_path}"\nsynchronous = "NORMAL"\n')

    async def run() -> None:
        running = await start_server(cfg)
        try:
            async with AsyncKVCoordClient(address) as admin:
                await admin.create_pool("p", POOL_CONFIG)
            async with AsyncKVCoordClient([swallowing, address], timeout=CALL, retry=NO_RETRY) as c:
                assert c.routes.route("p") == swallowing
                assert (await c.get_pool("p")).pool.name == "p"  # a read: the next replica at once
            async with AsyncKVCoordClient([swallowing, address], timeout=CALL, retry=NO_RETRY) as c:
                assert c.routes.route("p") == swallowing
                # (was: UnavailableError DEADLINE_EXCEEDED, no retry left for the backoff)
                session = await c.attach("p", "sha256_cbor", 4, "0", lease_seconds=60)
                assert session.session_id
                assert c.routes.route("p") == address and swallowing in c.routes.down
                await c.detach(session.session_id, session.fence)
        finally:
            await running.stop(grace=0)
            hole.close()

    asyncio.run(run())
