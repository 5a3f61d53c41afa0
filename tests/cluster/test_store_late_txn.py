"""A write of a pool's journal to etcd (``journal = "store"``) that the owner gave up
(not answered within ``journal_stall_seconds``: cancelled, its caller told UNAVAILABLE,
the pool given up here) but that etcd carries out later, as a transaction delayed on
the network would be. Its term check decides:

- the claim changed meanwhile (a new owner, a new term): the transaction fails its
  compare and writes nothing, so the new owner's stream is all there is;
- the claim did not change yet: its records land whole, once, right after the ones
  acknowledged (the stream stays a contiguous prefix: store_rebuild.rebuild reads them
  as an outcome-unknown call, which its keyed retry is told again), and landing twice
  (the retry of an unknown outcome, then the late original) changes nothing;
- landing after a later base deleted what it covers (a retry succeeded first): the
  record is back only below the latest base, which the rebuild never replays.

So no acknowledged record is lost and none is doubled. The late transaction is held
by a wrapper of the real client and sent to a real etcd when the test says."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import aetcd
import cbor2
import pytest
from etcd_process import Etcd, put_claim, store_client
from kvcoord.service.errors import ServiceError, Status
from kvcoord.service.store_journal import PoolStreams
from kvcoord.service.store_rebuild import stream_rows


class LateClient:
    """The real client, except that the transaction sent while :attr:`hold` is set is
    kept back (its caller never hears) until :meth:`land` sends it."""

    def __init__(self, real: aetcd.Client) -> None:
        self.real = real
        self.hold = False
        self.held: list[dict[str, Any]] = []

    @property
    def transactions(self) -> Any:
        return self.real.transactions

    async def transaction(self, **kw: Any) -> Any:
        if self.hold:
            self.hold = False
            self.held.append(kw)
            await asyncio.Event().wait()  # no answer: the stall bound cancels the caller
        return await self.real.transaction(**kw)

    async def land(self) -> bool:
        ok, _ = await self.real.transaction(**self.held.pop(0))
        return bool(ok)


def _call(n: int) -> bytes:
    return cbor2.dumps([n, ["call", 0.0, n]])


async def _given_up(streams: PoolStreams, pool: str, body: bytes) -> None:
    """Append ``body`` in a call's own context and check its flush is told UNAVAILABLE."""

    async def call() -> None:
        streams.append(pool, body)
        await streams.flush()

    with pytest.raises(ServiceError) as err:
        await asyncio.create_task(call(), context=contextvars.Context())
    assert err.value.status == Status.UNAVAILABLE


def test_a_late_transaction_is_refused_by_its_term_or_lands_whole_and_once(
    etcd: Etcd, request: pytest.FixtureRequest
) -> None:
    prefix = f"/kvcoord/{request.node.name[:40]}/".encode()

    async def run() -> None:
        async with store_client(etcd) as real:
            late = LateClient(real)
            streams = PoolStreams(lambda: late, prefix, lambda: True, snapshot_every=100)
            streams.stall_seconds = 0.3
            lost: list[str] = []
            streams.on_lost = lost.append

            async def rows(pool: str) -> dict[int, dict[int, list[Any]]]:
                return stream_rows(
                    await real.get_prefix(streams.pool_prefix(pool)), streams.pool_prefix(pool)
                )

            # 1. deposed before it lands: nothing of it is written
            term = await put_claim(real, streams.owner_key("p"))
            streams.open("p", term, cbor2.dumps([0, ["base", 0.0, b"p"]]))
            streams.append("p", _call(1))
            await streams.flush()  # acknowledged: base 0, call 1
            late.hold = True
            await _given_up(streams, "p", _call(2))
            assert lost == ["p"] and late.held
            new_term = await put_claim(real, streams.owner_key("p"))  # the next owner's claim
            assert await late.land() is False  # its compare names the old term
            got = await rows("p")
            assert sorted(got) == [term] and sorted(got[term]) == [0, 1], got  # nothing of call 2
            assert new_term > term

            # 2. lands while the claim is unchanged: whole, after what was acknowledged, once
            term = await put_claim(real, streams.owner_key("q"))
            streams.open("q", term, cbor2.dumps([0, ["base", 0.0, b"q"]]))
            await streams.flush()
            late.hold = True
            await _given_up(streams, "q", _call(1))
            assert lost == ["p", "q"]
            kw = late.held[0]
            assert await late.land() is True
            got = await rows("q")
            assert sorted(got[term]) == [0, 1] and got[term][1] == [1, ["call", 0.0, 1]], got
            ok, _ = await real.transaction(**kw)  # landing again (a retry's copy): the same keys
            assert ok and await rows("q") == got

            # 3. an unknown outcome retried, its original landing after a later base
            # deleted what that base covers: below the latest base, never replayed
            term = await put_claim(real, streams.owner_key("r"))
            streams.open("r", term, cbor2.dumps([0, ["base", 0.0, b"r0"]]))
            await streams.flush()
            sent: list[dict[str, Any]] = []
            original = late.transaction

            async def unknown_once(**kw: Any) -> Any:  # the first attempt: sent, then "no answer"
                late.transaction = original  # type: ignore[method-assign]
                sent.append(kw)
                raise ConnectionError("no answer (outcome unknown)")

            late.transaction = unknown_once  # type: ignore[method-assign]
            streams.append("r", _call(1))
            await streams.flush()  # retried: acknowledged
            streams.append("r", cbor2.dumps([2, ["base", 0.0, b"r2"]]), base=True)
            streams.append("r", _call(3))
            await streams.flush()
            assert sorted((await rows("r"))[term]) == [2, 3]  # the base deleted 0 and 1
            ok, _ = await real.transaction(**sent[0])  # the first attempt lands now
            assert ok
            got = (await rows("r"))[term]
            assert sorted(got) == [1, 2, 3] and got[1] == [1, ["call", 0.0, 1]], got
            # the rebuild starts at the latest base (2) and replays 3 only
            bases = [seq for seq, (_, rec) in got.items() if rec[0] == "base"]
            assert max(bases) == 2

    asyncio.run(run())
