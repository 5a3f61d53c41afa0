"""Over 4,096 given-up records piled up in the store journal (store_journal.py): the
list of given-up records is pruned, and a flush that needed a record pruned away must
fail (UNAVAILABLE), never be told its records are in the store.

Two ways a flush needed one: its own record was given up in the very batch whose
failures made the list long (its waiter was woken, then the list pruned before the
flush read it), and a call that marked its pool and waited elsewhere (its local commit,
a slow disk) while the failures piled up, flushing only after the prune.

Real etcd: the pools' claims are written again (a new term) before their records are,
so every write of theirs is refused as a deposed owner's."""

from __future__ import annotations

import asyncio
import contextvars

import cbor2
import pytest
from etcd_process import Etcd, flush_outcome, pool_streams, put_claim
from kvcoord.service.store_journal import PoolStreams

#: records given up at once: past the pruning's 4,096
PILE = 4200


async def _deposed(c: object, streams: PoolStreams, pool: str) -> None:
    """Open ``pool``'s stream at a term, then move the claim on: its writes fail."""
    term = await put_claim(c, streams.owner_key(pool))  # type: ignore[arg-type]
    streams.open(pool, term, cbor2.dumps([0, ["base", 0.0, b"base"]]))
    await streams.flush()
    await put_claim(c, streams.owner_key(pool))  # type: ignore[arg-type]


def test_a_flush_whose_record_failed_with_a_pile_of_others_is_told_unavailable(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            await _deposed(c, streams, "pile")
            await _deposed(c, streams, "v")

            async def pile() -> None:
                for n in range(PILE):
                    streams.append("pile", cbor2.dumps([n + 1, ["call", 0.0, n]]))
                await streams.flush()

            async def victim() -> None:
                streams.append("v", cbor2.dumps([1, ["call", 0.0, 1]]))
                await streams.flush()

            # each call in a context of its own, as each gRPC call's handler runs; one batch
            calls = [asyncio.create_task(f(), context=contextvars.Context()) for f in (pile, victim)]
            told = [await flush_outcome(t) for t in calls]
            assert told == ["UNAVAILABLE", "UNAVAILABLE"], told

    asyncio.run(run())


def test_a_call_that_marked_its_pool_before_a_pile_of_failures_is_told_unavailable(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    async def run() -> None:
        async with pool_streams(etcd, request) as (c, streams):
            await _deposed(c, streams, "v")
            local_commit = asyncio.Event()
            failed = asyncio.Event()
            streams.on_lost = lambda pool: failed.set() if pool == "v" else None

            async def victim() -> None:
                streams.append("v", cbor2.dumps([1, ["call", 0.0, 1]]))
                await local_commit.wait()  # (JournalRecorder.durable: the local journal first)
                await streams.flush()

            call = asyncio.create_task(victim(), context=contextvars.Context())
            await failed.wait()  # its record given up while it waits for its local commit
            await _deposed(c, streams, "pile")

            async def pile() -> None:
                for n in range(PILE):
                    streams.append("pile", cbor2.dumps([n + 1, ["call", 0.0, n]]))
                await streams.flush()

            assert (
                await flush_outcome(asyncio.create_task(pile(), context=contextvars.Context()))
                == "UNAVAILABLE"
            )
            local_commit.set()
            told = await flush_outcome(call)
            assert told == "UNAVAILABLE", told

    asyncio.run(run())
