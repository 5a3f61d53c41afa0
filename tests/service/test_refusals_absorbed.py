"""vLLM's adapter keeps a loss or an outage met inside ``update_from_output()`` for the
next ``schedule()`` (``absorbing``), but not a refusal about a request: REQUEST_UNKNOWN
never passes with time (see tests/with_vllm/test_request_refusals.py), and the value the
adapter answers for an absorbed call (an empty table, no events) would be a guess.
Before, ``RequestUnknownError``, a ``NotFoundError``, passed for an outage: absorbed,
logged as "handled at the next schedule", and the call answered as if the request held
no blocks."""

from __future__ import annotations

import grpc
import pytest
from kvcoord.client import (
    FencedError,
    LeaseExpiredError,
    NotFoundError,
    PoolBusyError,
    RequestsLostError,
    RequestUnknownError,
    SessionExpiredError,
    UnavailableError,
)
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.vllm import Settings, connect
from kvcoord.service.testing import InProcessServer
from service.test_vllm_adapter import Req, engine


def test_a_refusal_met_while_absorbing_reaches_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    """The waiting mode: the server drops a request that holds blocks behind the
    client's back (as a bug would); vLLM reads its table from update_from_output (a KV
    connector's finished request): the server's refusal is raised, not answered with an
    empty table (before: absorbed, and ``([], [])`` answered)."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    try:
        kv, cfg = engine()
        m = connect(Settings(target=server.address, pool="absorbed", predict=False), kv, cfg)
        hasher = BlockHasher("sha256", 4, none_hash("sha256", "0"))
        held = Req("h", list(range(20, 30)), block_hashes=hasher.extend(range(20, 30)))
        hit, n = m.get_computed_blocks(held)
        assert m.allocate_slots(held, 10, n, hit) is not None
        m.remote.flush()

        def drop() -> None:
            pool = server.running.servicer.registry.pools["absorbed"]  # type: ignore[union-attr]
            pool.engine.free("h")
            pool.owners.pop("h").owned.pop("h", None)

        server.call(drop)
        m.absorbing = True
        try:
            with pytest.raises(RequestUnknownError):
                m.get_block_ids("h")
        finally:
            m.absorbing = False
        assert m.absorbed == 0 and m.take_lost() == set(), m.absorbed
        m.close()
    finally:
        server.stop()


def test_what_is_an_outage() -> None:
    """Outages are waited out; a request's refusal is not one, though a NotFoundError; a
    loss it caused is a loss (its cause decides whether the scheduler waits)."""
    from kvcoord.client.vllm import is_outage

    def err(cls: type, reason: str = "") -> Exception:
        return cls(grpc.StatusCode.NOT_FOUND, "x", reason)

    unknown = err(RequestUnknownError, "REQUEST_UNKNOWN")
    outages = [
        err(UnavailableError), LeaseExpiredError("x"), err(FencedError), err(SessionExpiredError),
        err(NotFoundError), err(PoolBusyError),
    ]  # fmt: skip
    assert [is_outage(e) for e in outages] == [True] * len(outages)
    assert not is_outage(unknown)
    assert not is_outage(RequestsLostError(["r"], unknown))
