"""A flush of the store journal is failed by the given-up records of the terms its
answer may rest on, not by an older term's (store_failures.py).

Found live (test_store_two_terms_one_batch_processes.py): a replica cut off from etcd
until its lease ended registered again and rebuilt its pool at a new term while the
old term's records were still queued. Those failed (deposed), as they must; but a
task's mark was per pool, so they failed the rebuild's own flush too (``load`` in
server_cluster.py, after the pool was loaded and claimed): ``recover`` raised, an ERROR
said the pool could not be claimed while it was served, and the failover was not
counted. The new term's stream starts with a base of the whole state: what is answered
at the new term rests on that stream only.

Never the other way: a flush whose mark was made at the old term (its record queued
then, or a kept answer's mark taken before the pool's lock) still fails for the old
term's records and for the new term's, even once they are pruned away.

Real etcd: the claim is written again (a new term) between the two terms' records."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import cbor2
import pytest
from etcd_process import Etcd, flush_outcome, old_term_call, old_term_deposed, pool_streams, put_claim
from kvcoord.service.store_failures import KEEP

#: old-term records given up at once: past the pruning's list
PILE = KEEP + 104


def _task(coro: Any) -> asyncio.Task[None]:
    """Each call in a context of its own, as each gRPC call's handler (or the watch) runs."""
    return asyncio.create_task(coro, context=contextvars.Context())


def test_a_rebuilds_flush_is_not_failed_by_the_old_terms_given_up_records(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            old, new, lost = await old_term_deposed(c, streams)

            async def rebuild() -> None:  # (server_cluster.py's load: open at the claim's term, durable)
                streams.open("p", new, cbor2.dumps([0, ["base", 0.0, b"new"]]))
                await streams.flush()

            async def new_call() -> None:
                streams.append("p", cbor2.dumps([1, ["call", 0.0, "new"]]))
                await streams.flush()

            first = _task(old_term_call(streams))
            await asyncio.sleep(0)  # (its record queued: the old term's, still unwritten)
            told = {"old": first, "rebuild": _task(rebuild())}
            await asyncio.sleep(0)
            told["new"] = _task(new_call())
            outcomes = {name: await flush_outcome(t) for name, t in told.items()}
            assert outcomes == {"old": "UNAVAILABLE", "rebuild": "told durable", "new": "told durable"}, (
                outcomes
            )
            assert lost == [] and streams.is_open("p")

    asyncio.run(run())


def test_a_rebuilds_flush_is_not_failed_by_the_old_terms_records_pruned_away(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """The old term's given-up records pile past the list's bound and are pruned while the
    rebuild waits elsewhere (its local journal's commit); what is remembered of them is
    per term too. A call of the old term waiting so is still told UNAVAILABLE."""

    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            old, new, lost = await old_term_deposed(c, streams)
            local_commit = asyncio.Event()

            async def old_waiting() -> None:
                streams.append("p", cbor2.dumps([1, ["call", 0.0, "old"]]))
                await local_commit.wait()
                await streams.flush()

            async def pile() -> None:
                for n in range(PILE):
                    streams.append("p", cbor2.dumps([n + 2, ["call", 0.0, n]]))
                await streams.flush()

            async def rebuild() -> None:
                streams.open("p", new, cbor2.dumps([0, ["base", 0.0, b"new"]]))
                await local_commit.wait()
                await streams.flush()

            waiting = _task(old_waiting())
            piled = _task(pile())
            await asyncio.sleep(0)  # (both queued at the old term, unwritten)
            rebuilt = _task(rebuild())
            assert await flush_outcome(piled) == "UNAVAILABLE"
            local_commit.set()
            outcomes = {
                "old": await flush_outcome(waiting),
                "rebuild": await flush_outcome(rebuilt),
            }
            assert outcomes == {"old": "UNAVAILABLE", "rebuild": "told durable"}, outcomes
            assert lost == [] and streams.is_open("p")

    asyncio.run(run())


def test_a_mark_made_at_the_old_term_fails_with_the_new_terms_base(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    """A kept answer's mark is taken before the pool's lock (mutations.py): at the old
    term, while the answer is read at the new one. The new term's base given up (the
    claim moved on past it too) fails that flush, though no record of the old term failed."""

    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            old, new, lost = await old_term_deposed(c, streams)
            await put_claim(c, streams.owner_key("p"))  # and another replica's since: the new term deposed
            locked = asyncio.Event()

            async def kept_answer() -> None:
                streams.answers_on("p")  # (mutations.py: before the pool's lock)
                await locked.wait()  # the pool rebuilt meanwhile; its kept answer read at the new term
                await streams.flush()

            call = _task(kept_answer())
            await asyncio.sleep(0)

            async def rebuild() -> None:
                streams.open("p", new, cbor2.dumps([0, ["base", 0.0, b"new"]]))
                await streams.flush()

            assert await flush_outcome(_task(rebuild())) == "UNAVAILABLE"
            assert lost == ["p"]
            locked.set()
            assert await flush_outcome(call) == "UNAVAILABLE"

    asyncio.run(run())
