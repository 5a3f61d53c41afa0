"""A pool whose stream begins again at a new term (the replica claimed it again: its
lease ended and it registered again, an adoption) while records of the old term are
still queued: one batch of the store journal then holds both terms' records of the
pool. The old term's writes fail (the claim moved on: deposed), as they must.

They took the new term's records down with them: the new stream's base was given up
with the old term's records, and the pool was not given up here (the failure was
taken for the old term's), so it was served on, its later records written after a
base that never was. A rebuild (the next owner) takes the highest term whose stream
has a base: the old one, without any answer told since. Now the new term's records are
written on their own; a failure of the new term's gives the pool up.

Real etcd: the claim is written again (a new term) between the two terms' records."""

from __future__ import annotations

import asyncio
import contextvars

import cbor2
import pytest
from etcd_process import Etcd, old_term_call, old_term_deposed, pool_streams, put_claim
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.store_rebuild import stream_rows


def test_a_new_terms_records_in_a_batch_with_the_old_terms_are_written(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            old, new, lost = await old_term_deposed(c, streams)

            async def new_call(n: int) -> None:
                streams.append("p", cbor2.dumps([n, ["call", 0.0, n]]))
                await streams.flush()

            # each call in a context of its own, as each gRPC call's handler runs; the old
            # term's record queued, then the stream opened at the new term: one batch
            first = asyncio.create_task(old_term_call(streams), context=contextvars.Context())
            await asyncio.sleep(0)  # (its record queued)
            streams.open("p", new, cbor2.dumps([0, ["base", 0.0, b"new"]]))
            second = asyncio.create_task(new_call(2), context=contextvars.Context())
            with pytest.raises(ServiceError) as err:
                await first
            assert err.value.status == Status.UNAVAILABLE
            told_second = await asyncio.gather(second, return_exceptions=True)
            # a later call of the new term, told its record is in the store
            await asyncio.create_task(new_call(3), context=contextvars.Context())
            rows = await c.get_prefix(streams.pool_prefix("p"))
            got = stream_rows(rows, streams.pool_prefix("p"))
            highest = max(t for t, records in got.items() if any(r[1][0] == "base" for r in records.values()))
            assert highest == new, (
                f"the new term's stream has no base: a rebuild takes term {highest} ({got})"
            )
            assert sorted(got[new]) == [0, 1, 2], got[new]
            # (UNAVAILABLE is allowed: it marked the pool before the old term's record failed)
            assert told_second == [None] or (
                isinstance(told_second[0], ServiceError) and told_second[0].status == Status.UNAVAILABLE
            ), told_second
            assert lost == [] and streams.is_open("p")

    asyncio.run(run())


def test_a_new_terms_records_failing_in_a_batch_with_the_old_terms_give_the_pool_up(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """Both terms' records fail (the claim moved on past the new term too): the pool is
    given up here (was: the failure taken for the old term's, the pool served on at a
    term whose base is nowhere)."""

    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            old, new, lost = await old_term_deposed(c, streams)
            await put_claim(c, streams.owner_key("p"))  # and another replica's since: both deposed

            async def call() -> None:
                streams.append("p", cbor2.dumps([1, ["call", 0.0, "old"]]))
                streams.open("p", new, cbor2.dumps([0, ["base", 0.0, b"new"]]))  # one batch
                await streams.flush()

            with pytest.raises(ServiceError) as err:
                await asyncio.create_task(call(), context=contextvars.Context())
            assert err.value.status == Status.UNAVAILABLE
            assert lost == ["p"] and not streams.is_open("p")

    asyncio.run(run())
