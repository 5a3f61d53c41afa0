"""A pool's stream in a real etcd (store_journal.py): records larger than etcd's
request limit are cut into parts and read back whole; a record some of whose parts
are missing is left out; a base deletes what it covers; and once the claim changes
(a new term) the former owner's writes fail, so it acknowledges nothing more."""

from __future__ import annotations

import asyncio
import contextvars
import os
from pathlib import Path

import aetcd
import aetcd.exceptions
import cbor2
import pytest
from etcd_process import Etcd, pool_streams, put_claim
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.store_journal import PART_BYTES
from kvcoord.service.store_rebuild import stream_rows


def test_big_records_round_trip_and_a_deposed_owner_cannot_write(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    async def run() -> None:
        async with pool_streams(etcd, request, 3) as (c, streams):
            term = await put_claim(c, streams.owner_key("p"))
            big = os.urandom(3 * PART_BYTES + 17)  # four parts, over etcd's 1.5 MiB request limit
            streams.open("p", term, cbor2.dumps([0, ["base", 0.0, big]]))
            due = [streams.append("p", cbor2.dumps([n, ["call", 0.0, n]])) for n in (1, 2, 3)]
            assert due == [False, False, True]
            streams.append("p", cbor2.dumps([4, ["base", 0.0, b"small"]]), base=True)
            streams.append("p", cbor2.dumps([5, ["call", 0.0, 5]]))
            await streams.flush()
            rows = await c.get_prefix(streams.pool_prefix("p"))
            got = stream_rows(rows, streams.pool_prefix("p"))
            # the second base deleted the first and the records before it
            assert sorted(got) == [term] and sorted(got[term]) == [4, 5]
            assert got[term][4] == [4, ["base", 0.0, b"small"]]

            # the big record alone: every part read back, in order
            streams.open("p", term, cbor2.dumps([0, ["base", 0.0, big]]))
            await streams.flush()
            rows = await c.get_prefix(streams.pool_prefix("p"))
            assert stream_rows(rows, streams.pool_prefix("p"))[term][0] == [0, ["base", 0.0, big]]
            # a record missing a part is not there
            first = sorted(kv.key for kv in rows)[0]
            await c.delete(first)
            rows = await c.get_prefix(streams.pool_prefix("p"))
            assert 0 not in stream_rows(rows, streams.pool_prefix("p")).get(term, {})

            # another replica takes the claim: this owner's next write fails, and the
            # caller waiting for it is told UNAVAILABLE, never that it is durable
            # (a call of another pool, committed in the same batch, is not failed by it)
            lost: list[str] = []
            streams.on_lost = lost.append
            streams.open(
                "q", await put_claim(c, streams.owner_key("q")), cbor2.dumps([0, ["base", 0.0, b"q"]])
            )
            await streams.flush()
            await put_claim(c, streams.owner_key("p"))

            async def call(pool: str, n: int) -> None:
                streams.append(pool, cbor2.dumps([n, ["call", 0.0, n]]))
                await streams.flush()

            # each call in a context of its own, as each gRPC call's handler runs
            deposed = asyncio.create_task(call("p", 6), context=contextvars.Context())
            other = asyncio.create_task(call("q", 1), context=contextvars.Context())
            await other
            with pytest.raises(ServiceError) as err:
                await deposed
            assert err.value.status == Status.UNAVAILABLE
            assert lost == ["p"] and not streams.is_open("p")
            rows = await c.get_prefix(streams.pool_prefix("p"))
            assert 6 not in stream_rows(rows, streams.pool_prefix("p")).get(term, {})

    asyncio.run(run())


def test_a_write_the_store_refuses_gives_the_pool_up_at_once(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """etcd out of space (past its quota: the NOSPACE alarm) refuses every write while
    its lease keep-alives still pass, so the owner's lease stays valid. A refused write
    used to be retried as if its outcome were unknown, for as long as the lease was
    valid: the call waiting for it hung (flush never returned). A refusal is final:
    the pool is given up here at once, and the caller told UNAVAILABLE."""
    etcd = Etcd(tmp_path, ("--quota-backend-bytes", str(1 << 20)))

    async def run() -> None:
        async with pool_streams(etcd, request, 40) as (c, streams):
            term = await put_claim(c, streams.owner_key("p"))
            for n in range(100):  # bounded: 100 KB a put, the quota is 1 MiB
                try:
                    await c.put(streams.prefix + b"fill/%d" % n, os.urandom(100_000))
                except aetcd.exceptions.ClientError as exc:
                    assert "space exceeded" in str(exc), exc
                    break
            else:
                pytest.fail("etcd never ran out of space")
            lost: list[str] = []
            streams.on_lost = lost.append

            async def call() -> None:
                streams.open("p", term, cbor2.dumps([0, ["base", 0.0, b"p"]]))
                await streams.flush()

            task = asyncio.create_task(call(), context=contextvars.Context())
            try:
                await asyncio.wait([task], timeout=15)  # a bound, not a measurement
                assert task.done(), "a write the store refused is retried while the lease is valid"
                with pytest.raises(ServiceError) as err:
                    task.result()
                assert err.value.status == Status.UNAVAILABLE and lost == ["p"]
            finally:
                task.cancel()

    try:
        asyncio.run(run())
    finally:
        etcd.stop()
