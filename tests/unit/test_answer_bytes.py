"""A keyed call's answer is serialized once: an answer of at least
mutations.BYTES_ANSWER_MIN bytes is answered with the bytes kept for its key and its
journal record (gRPC sends them as they are), the same bytes a message answer would
have been serialized to, its fence's journal position included; a retry gets them too."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from kvcoord.client import _requests as rq
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.service import mutations
from kvcoord.service.idempotency import IdempotencyStore
from kvcoord.service.recovery import open_journal
from kvcoord.service.registry import Limits, PoolRegistry
from kvcoord.service.servicer import AllocatorServicer
from kvcoord.service.sessions import SessionTable
from kvcoord.service.testing import ManualClock
from kvcoord.v1 import allocator_pb2 as pb
from support import wire_pool_config


def _sync(rid: str, tokens: list[int]) -> pb.RequestSync:
    hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(tokens)
    return pb.RequestSync(
        request_id=rid, append_token_ids=tokens, new_request=True, append_block_hashes=hashes
    )


class Ctx:
    async def abort(self, code: Any, message: str, trailers: Any = ()) -> None:
        raise AssertionError(f"{code}: {message}")


def _answers(tmp_path: Path) -> list[Any]:
    """A Step, the same Step again (a retry), an Allocate and a Free on a fresh
    journaled server: their answers as the servicer returns them."""

    async def calls() -> list[Any]:
        clock = ManualClock()
        tables = SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20)
        registry = PoolRegistry(Limits(), *tables)
        recovery = open_journal(registry, str(tmp_path), "OFF", 10_000, time.time)
        servicer = AllocatorServicer(registry)
        await servicer.CreatePool(pb.CreatePoolRequest(name="p", config=wire_pool_config(50)), Ctx())
        a = await servicer.Attach(rq.attach("p", "sha256_cbor", 4, "0", "w", 0), Ctx())
        sync = _sync("r1", list(range(32)))
        step = rq.step(
            "p",
            [pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=32))],
            a.session_id,
            a.fence,
        )
        sync2 = _sync("r2", [7] * 8)
        allocate = rq.allocate("p", pb.AllocateOp(request=sync2, num_new_tokens=8), a.session_id, a.fence)
        free = rq.free("p", ["r1"], False, a.session_id, a.fence)
        out = [
            await servicer.Step(step, Ctx()),
            await servicer.Step(step, Ctx()),
            await servicer.Allocate(allocate, Ctx()),
            await servicer.Free(free, Ctx()),
        ]
        await recovery.recorder.journal.close()
        return out

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(calls())
    finally:
        loop.close()


def test_a_large_answer_is_its_kept_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    messages = _answers(tmp_path / "messages")
    assert not any(isinstance(m, bytes) for m in messages)
    monkeypatch.setattr(mutations, "BYTES_ANSWER_MIN", 1, raising=False)  # every answer is "large"
    answers = _answers(tmp_path / "bytes")
    assert all(isinstance(b, bytes) for b in answers)
    step = pb.StepResponse.FromString(answers[0])
    assert step.fence.position and step.results[0].allocate.new_block_ids[0].block_ids
    assert answers[1] == answers[0]  # the retry
    # what a message answer is serialized to, the same journal positions (the fences
    # name each server's own instance otherwise)
    for b, m in zip(answers, messages, strict=True):
        got = type(m).FromString(b)
        assert got.fence.position == m.fence.position > 0
        for fence in (got.fence, m.fence):
            fence.ClearField("instance_id")
            fence.ClearField("incarnation")
        assert got.SerializeToString() == m.SerializeToString()
