"""A keyed call's answer is serialized once: Step, Allocate and Free are answered with
the bytes kept for their key and their journal record (gRPC sends them as they are),
their fence's journal position stamped; a retry gets the same bytes, also after a
restart (replay rebuilds them byte for byte)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from kvcoord.client import _requests as rq
from kvcoord.client.hashing import BlockHasher, none_hash
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


def _servicer(data_dir: Path | None) -> tuple[AllocatorServicer, Any]:
    clock = ManualClock()
    registry = PoolRegistry(
        Limits(), SessionTable(clock, 30.0, 60.0), IdempotencyStore(clock, 300.0, 1 << 20)
    )
    recovery = None if data_dir is None else open_journal(registry, str(data_dir), "OFF", 10_000, time.time)
    return AllocatorServicer(registry), recovery


def _answers(data_dir: Path | None) -> tuple[list[Any], bytes | None]:
    """A Step, the same Step again (a retry), an Allocate and a Free on a fresh server
    (journaled in ``data_dir``, else memory only): their answers as the servicer returns
    them; and, journaled, the Step's retry after a restart."""

    async def calls() -> tuple[list[Any], bytes | None]:
        servicer, recovery = _servicer(data_dir)
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
        if recovery is None:
            return out, None
        await recovery.recorder.journal.close()
        servicer, recovery = _servicer(data_dir)  # restarted: the calls replayed
        again = await servicer.Step(step, Ctx())
        await recovery.recorder.journal.close()
        return out, again

    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(calls())
    finally:
        loop.close()


def test_every_keyed_answer_is_its_kept_bytes(tmp_path: Path) -> None:
    answers, after_restart = _answers(tmp_path)
    assert all(type(b) is bytes for b in answers)
    types = (pb.StepResponse, pb.StepResponse, pb.AllocateResponse, pb.FreeResponse)
    messages = [t.FromString(b) for t, b in zip(types, answers, strict=True)]
    step = messages[0]
    assert step.results[0].allocate.new_block_ids[0].block_ids
    assert answers[1] == answers[0]  # the retry
    assert after_restart == answers[0]  # replay rebuilt the same bytes
    # each fence names its own call's record (the retry's is the call's)
    positions = [m.fence.position for m in messages]
    assert positions[0] == positions[1] > 0 and positions[0] < positions[2] < positions[3]
    for b, m in zip(answers, messages, strict=True):
        assert m.SerializeToString() == b  # what a message answer is serialized to


def test_a_memory_only_server_answers_bytes_too() -> None:
    answers, _ = _answers(None)
    assert all(type(b) is bytes for b in answers)
    step = pb.StepResponse.FromString(answers[0])
    assert step.results[0].allocate.new_block_ids[0].block_ids and not step.fence.position
    assert answers[1] == answers[0]


def test_answers_journaled_before_tags_are_replayed_as_they_were_told(tmp_path: Path) -> None:
    """A journal written by a kvcoord that did not tag positions (its answers' digests
    are of untagged answers) still replays: each answer is rebuilt as its client was
    told it, without a tag, and a retry gets those bytes; answers given after the
    restart carry their tag (positions.py)."""

    async def calls() -> tuple[bytes, bytes, bytes]:
        servicer, recovery = _servicer(tmp_path)
        servicer.registry.positions.key = None  # as a kvcoord before tags answered
        await servicer.CreatePool(pb.CreatePoolRequest(name="p", config=wire_pool_config(50)), Ctx())
        a = await servicer.Attach(rq.attach("p", "sha256_cbor", 4, "0", "w", 0), Ctx())
        op = pb.Operation(allocate=pb.AllocateOp(request=_sync("r1", list(range(32))), num_new_tokens=32))
        step = rq.step("p", [op], a.session_id, a.fence)
        first = await servicer.Step(step, Ctx())
        await recovery.recorder.journal.close()
        servicer, recovery = _servicer(tmp_path)  # restarted: the journal's key applies now
        again = await servicer.Step(step, Ctx())
        op2 = pb.Operation(allocate=pb.AllocateOp(request=_sync("r2", [7] * 8), num_new_tokens=8))
        later = await servicer.Step(rq.step("p", [op2], a.session_id, a.fence), Ctx())
        await recovery.recorder.journal.close()
        return first, again, later

    loop = asyncio.new_event_loop()
    try:
        first, again, later = loop.run_until_complete(calls())
    finally:
        loop.close()
    told = pb.StepResponse.FromString(first)
    assert told.fence.position and not told.fence.position_tag
    assert again == first
    assert len(pb.StepResponse.FromString(later).fence.position_tag) == 16
