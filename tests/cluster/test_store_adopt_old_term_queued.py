"""AdoptPool reaching a replica whose records of that pool from an earlier term (its
own claim, since taken by another replica) are still on their way to the store.

Replica r0 created pool p (term T1). A call's record of p is written to the store and
held there unanswered; meanwhile another replica took p over (term T2: r0's writes of
T1 now fail, deposed) and hands it back to r0 (AdoptPool, placement names r0). The
held write is let go while the adoption waits for its own records to be durable.

What must hold: the call whose record was deposed is never told it is durable (it was
not in the store when r0 lost the pool); the adopted pool is served at a new term whose
stream in the store starts with a base of the adopted state (never on the old term's
given-up base), without the deposed call's session; a call made on it afterwards is
told durable and is in that stream. (Checked by reading before: the adoption's flush
holds no mark of the old term, and the new stream opens at the claim swap, after it.)

A real replica in the test's process (real gRPC, the asyncio client) and a real etcd;
the other replica's claim written to etcd as a replica writes it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import cbor2
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, AsyncKVCoordClient, KVCoordError, UnavailableError
from kvcoord.service.cluster_store import prefix_range
from kvcoord.service.ownership import encode_claim
from kvcoord.service.registry_state import dump_pool
from kvcoord.service.store_rebuild import stream_rows
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from replica_here import TRIES, replica_here
from test_replicas import POOL_CONFIG, in_process_store_replica

#: no lease of r0 ends while the test holds a write
LEASE = 30


async def _attach(c: AsyncKVCoordClient, name: str) -> Any:
    return await c.attach("p", "sha256_cbor", 4, "0", name, lease_seconds=20.0)


@pytest.mark.parametrize("copy", ["removed first", "still here"])
def test_an_adopt_while_the_old_terms_records_are_queued_serves_only_the_adopted_state(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, copy: str
) -> None:
    """``copy``: r0's watch removed its copy of p on seeing the other replica's claim
    before the AdoptPool came, or not yet (the AdoptPool first: adopt_pool replaces it)."""
    name = f"adopt-old-term-{copy.replace(' ', '-')}"  # (a cluster of its own per case)
    address, cfg = in_process_store_replica(etcd.endpoint, name, tmp_path, LEASE)

    async def run() -> None:
        async with replica_here(cfg) as (running, cluster):
            registry = running.servicer.registry
            assert cluster.streams is not None
            prefix = cluster.streams.pool_prefix("p")
            owners = cluster.key("owners", "p")
            plain = cluster.client.transaction
            held, go = asyncio.Event(), asyncio.Event()

            async def tx(**kw: Any) -> Any:
                write = {c.key for c in kw.get("compare", [])} == {owners} and any(
                    getattr(op, "key", b"").startswith(prefix) for op in kw.get("success", [])
                )
                if write and not held.is_set():
                    held.set()  # a write of p's journal: on its way, answered once let go
                    await go.wait()
                return await plain(**kw)

            async with AsyncKVCoordClient(address, timeout=30.0) as c:
                await c.create_pool("p", POOL_CONFIG)
                t1 = cluster.view.term("p")
                kept = await _attach(c, "kept")  # in the state handed back
                state = cbor2.dumps(dump_pool(registry, "p", leases=True))
                cluster.client.transaction = tx
                once = AsyncKVCoordClient(
                    address, timeout=30.0, retry=NO_RETRY
                )  # (a retry would be a new call)
                deposed_call = asyncio.create_task(_attach(once, "deposed"))
                await asyncio.wait_for(held.wait(), 30)
                # another replica took p over (a new term: r0's writes of T1 fail) and
                # hands it back to r0 (a member missing from the view: placement names r0)
                removing = cluster.handed_over
                if copy == "still here":
                    cluster.handed_over = None  # (the watch's pass that removes it comes later)
                await cluster.client.put(owners, encode_claim("gone", "127.0.0.1:9"))
                await cluster.refresh()
                for _ in range(TRIES * 10):  # bounded: the watch's pass removes the copy (or may not)
                    if copy == "still here" or "p" not in registry.pools:
                        break
                    await asyncio.sleep(0.05)
                assert ("p" in registry.pools) == (copy == "still here")
                t2 = cluster.view.term("p")
                assert cluster.view.claims["p"].replica_id == "gone" and t2 > t1
                adopt = pb.AdoptPoolRequest(pool="p", state=state, from_replica="gone", claim_revision=t2)
                async with grpc.aio.insecure_channel(address) as channel:
                    adopting = asyncio.ensure_future(
                        pb_grpc.ReplicasStub(channel).AdoptPool(adopt, timeout=60)
                    )
                    for _ in range(TRIES * 10):  # bounded: the adoption waits for its records
                        if "p" in cluster.adopting or adopting.done():
                            break
                        await asyncio.sleep(0.05)
                    assert "p" in cluster.adopting and not adopting.done(), "the adoption did not wait"
                    go.set()  # the old term's write goes on: deposed
                    answer = await adopting
                cluster.handed_over = removing
                # the call whose record was deposed is never told durable
                with pytest.raises(KVCoordError) as told:
                    await deposed_call
                assert isinstance(told.value, UnavailableError), told.value
                await once.close()
                t3 = answer.term
                assert t3 > t2 and cluster.view.holds("p") and cluster.view.term("p") == t3
                # served at the new term, with the adopted state only
                service = registry.pools["p"]
                assert service.fence.term == t3
                names = {s.client_name for s in registry.sessions.of_pool("p")}
                assert names == {"kept"}, names
                await c.heartbeat(kept.session_id, kept.fence)  # the adopted session goes on
                later = await _attach(c, "later")  # told durable
                rows = await cluster.client.get_range(*prefix_range(prefix))
            got = stream_rows(rows, prefix)
            based = [t for t, records in got.items() if any(r[1][0] == "base" for r in records.values())]
            assert max(based) == t3, f"a rebuild would take term {max(based)}, not the adopted pool's {t3}"
            base = got[t3][0][1]  # ["base", wall, the pool's value, ...]
            assert base[0] == "base"
            assert {row[2] for row in base[2]["sessions"]} == {"kept"}, base[2]["sessions"]
            attached = [r[1] for seq, r in sorted(got[t3].items()) if seq > 0 and r[1][0] == "attach"]
            assert any(later.session_id in repr(rec) for rec in attached), got[t3]
            assert not any("deposed" in repr(rec) for records in got.values() for rec in records.values())

    asyncio.run(run())
