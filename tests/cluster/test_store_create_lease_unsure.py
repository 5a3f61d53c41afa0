"""A pool created (``journal = "store"``) while the replica's own estimate of its
lease lapses for a moment: the claim is made, its answer arrives when the replica is no
longer sure its lease is alive (a keep-alive answer late on a loaded host), and the
pool is made right then.

The pool was made with no term (``placement.term`` read the claim only while the lease
was sure), so no stream of its journal was opened in the store, and every call of the
pool was told UNAVAILABLE ("not journaled in the cluster store here yet") until the
watch's next pass opened one, up to a lease (10 s by default) later: longer than a
client's retry budget. (Safe: nothing was acknowledged without the store.)

Now the pool is made under its claim's term whatever the estimate says at that
moment: the stream opens with it, its calls are answered at once, and each only once
its record is in the store: with the store not answering, a call is told UNAVAILABLE,
never OK."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, AsyncKVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.service.config import parse_config
from ports import free_port
from replica_here import replica_here
from service.helpers import allocate
from test_replicas import POOL_CONFIG

#: no lease of the replica ends during the test (only its estimate lapses, once)
LEASE = 30
#: how long a journal write the store does not answer is retried before its call fails
STALL = 2.0


def test_a_pool_made_while_the_lease_is_unsure_answers_only_what_the_store_holds(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    name = request.node.name[:40]
    address = f"127.0.0.1:{free_port()}"
    cfg = parse_config(
        f'[server]\nlisten = ["{address}"]\ndata_dir = "{tmp_path}"\nsynchronous = "NORMAL"\n'
        f"journal_stall_seconds = {STALL}\n"
        f'[cluster]\nendpoints = ["{etcd.endpoint}"]\nname = "{name}"\nreplica_id = "r0"\n'
        f'lease_seconds = {LEASE}\nstore_timeout_seconds = 2.0\njournal = "store"\n'
    )

    async def run() -> None:
        async with replica_here(cfg) as (_, cluster):
            assert cluster.streams is not None
            view, plain_claim = cluster.view, cluster.claim
            lapsed: list[str] = []

            async def claim(pool: str, own_copy: bool = False) -> Any:
                made = await plain_claim(pool, own_copy)
                if pool == "w" and made is not None and not lapsed:
                    # the answer came when the replica's estimate of its lease lapsed
                    # (restored a moment later, as the next keep-alive answer does)
                    until = view.valid_until
                    view.valid_until = 0.0
                    lapsed.append(pool)
                    loop = asyncio.get_running_loop()
                    loop.call_later(0.3, lambda: setattr(view, "valid_until", max(until, view.valid_until)))
                return made

            cluster.claim = claim  # type: ignore[method-assign]
            async with AsyncKVCoordClient(address, timeout=20.0, retry=NO_RETRY) as c:
                await c.create_pool("w", POOL_CONFIG)
                assert lapsed == ["w"]
                for _ in range(50):  # bounded: the estimate is back 0.3 s after the claim
                    if view.holds("w"):
                        break
                    await asyncio.sleep(0.1)
                assert view.holds("w")
                s = await c.attach("w", "sha256_cbor", 4, "0")
                await c.allocate("w", allocate("a", list(range(8)), 8).allocate, s.session_id, s.fence)
                assert cluster.streams.is_open("w"), "the pool's journal has no stream in the store"

                # the store stops answering the journal's writes (its sockets open: a stall)
                plain = cluster.client.transaction
                journal = cluster.streams.pool_prefix("w")

                async def stalled(**kw: Any) -> Any:
                    if any(getattr(op, "key", b"").startswith(journal) for op in kw.get("success", [])):
                        await asyncio.sleep(60)
                    return await plain(**kw)

                cluster.client.transaction = stalled
                with pytest.raises(KVCoordError) as failed:
                    await c.allocate(
                        "w", allocate("b", list(range(100, 108)), 8).allocate, s.session_id, s.fence
                    )
                assert failed.value.code == grpc.StatusCode.UNAVAILABLE, failed.value
                cluster.client.transaction = plain

    asyncio.run(run())
