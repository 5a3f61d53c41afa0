"""A DecodeOp with packed columns over real gRPC (unary Steps and the StepStream): the
same answers as its repeated form, and a malformed packed column, or both forms in
one message, refused with INVALID_ARGUMENT and nothing applied."""

from __future__ import annotations

from collections.abc import Callable

import grpc
import pytest
from helpers import allocate, attach
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.client.hashing import BlockHasher
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.columns import pack_uint32
from support import NONE, pool_toml

BS = 4


def decode_step(rids: list[str], held: int, token: int) -> pb.DecodeOp:
    """Each request's next token (held tokens of 0, 1, 2 ... 3, 100 + i ...), repeated form."""
    d = pb.DecodeOp()
    for i, rid in enumerate(rids):
        tokens = [*range(i * 10, i * 10 + held), token]
        hashes = BlockHasher("sha256_cbor", BS, NONE).extend(tokens)
        d.request_ids.append(rid)
        d.base_num_tokens.append(held)
        d.base_num_hashes.append(held // BS)
        d.num_computed_tokens.append(held)
        d.num_new_tokens.append(1)
        d.num_lookahead_tokens.append(0)
        d.num_append_tokens.append(1)
        d.append_token_ids.append(token)
        d.num_append_hashes.append(len(hashes) - held // BS)
        d.append_block_hashes.extend(hashes[held // BS :])
    return d


def packed(d: pb.DecodeOp) -> pb.DecodeOp:
    hashes = list(d.append_block_hashes)
    out = pb.DecodeOp(
        request_ids=d.request_ids,
        packed_base_num_tokens=pack_uint32(d.base_num_tokens),
        packed_base_num_hashes=pack_uint32(d.base_num_hashes),
        packed_num_computed_tokens=pack_uint32(d.num_computed_tokens),
        packed_num_new_tokens=pack_uint32(d.num_new_tokens),
        packed_num_lookahead_tokens=pack_uint32(d.num_lookahead_tokens),
        packed_num_append_tokens=pack_uint32(d.num_append_tokens),
        packed_append_token_ids=pack_uint32(d.append_token_ids),
        packed_num_append_hashes=pack_uint32(d.num_append_hashes),
        packed_append_block_hashes=b"".join(hashes),
        packed_hash_length=len(hashes[0]) if hashes else 0,
        must_succeed=d.must_succeed,
    )
    return out


def tables(
    client: KVCoordClient, sid: str, fence: pb.Fence, rids: list[str], pool: str = "p"
) -> list[list[int]]:
    ops = [pb.Operation(get_block_ids=pb.GetBlockIdsOp(request_id=r)) for r in rids]
    resp = client.step(pool, ops, sid, fence)
    return [[b for g in r.get_block_ids.groups for b in g.block_ids] for r in resp.results]


@pytest.mark.parametrize("stream", [False, True])
def test_packed_and_repeated_decode_ops_answer_alike(
    make_server: Callable[..., InProcessServer], stream: bool
) -> None:
    """Two pools, the same requests: decode steps sent repeated to one and packed to the
    other, over gRPC: the same answers and tables."""
    rids = [f"r{i}" for i in range(5)]
    server = make_server(pool_toml("p", 64, sliding_window=8) + pool_toml("q", 64, sliding_window=8))
    with KVCoordClient(server.address, timeout=10, step_stream=stream) as c:
        sessions = {pool: attach(c, pool) for pool in ("p", "q")}
        for pool, (sid, fence) in sessions.items():
            ops = [allocate(rid, list(range(i * 10, i * 10 + 3)), 3) for i, rid in enumerate(rids)]
            assert not any(r.status_code for r in c.step(pool, ops, sid, fence).results)
        for held in range(3, 12):
            d = decode_step(rids, held, 100 + held)
            answers = []
            for pool, form in (("p", d), ("q", packed(d))):
                sid, fence = sessions[pool]
                (r,) = c.step(pool, [pb.Operation(decode=form)], sid, fence).results
                assert r.status_code == 0, r.status_message
                answers.append(r.decode)
            assert answers[0] == answers[1] and answers[0].num_applied == len(rids)
        # (the pools' block ids are numbered alike: the same tables)
        assert tables(c, *sessions["p"], rids) == tables(c, *sessions["q"], rids, "q")


def _bad(form: pb.DecodeOp, what: str) -> pb.DecodeOp:
    if what == "width":
        form.packed_num_new_tokens += b"\x01"
    elif what == "hash_width":
        form.packed_append_block_hashes = b"\x00" * 33
        form.packed_hash_length = 32
    elif what == "both":
        form.num_computed_tokens.append(3)
    elif what == "entries":
        form.packed_base_num_tokens += pack_uint32([3])
    return form


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("what", ["width", "hash_width", "both", "entries"])
def test_a_malformed_packed_decode_op_is_invalid_argument(
    server: InProcessServer, stream: bool, what: str
) -> None:
    """A packed column not a whole number of values (or of hashes), a message in both
    forms, packed columns without one value per entry: INVALID_ARGUMENT over gRPC,
    nothing applied (the requests' tables unchanged; the same Step well formed then applies)."""
    rids = ["a", "b"]
    with KVCoordClient(server.address, timeout=10, step_stream=stream) as c:
        sid, fence = attach(c)
        ops = [allocate(rid, list(range(i * 10, i * 10 + 4)), 4) for i, rid in enumerate(rids)]
        c.step("p", ops, sid, fence)
        before = tables(c, sid, fence, rids)
        d = decode_step(rids, 4, 7)  # each takes a new block
        bad = pb.Operation(decode=_bad(packed(d), what))
        if what == "entries":  # as the repeated form: the operation's own result, nothing of it applied
            (r,) = c.step("p", [bad], sid, fence).results
            assert r.status_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            message = r.status_message
        else:  # not readable: the whole Step refused, nothing of it applied
            with pytest.raises(KVCoordError) as err:
                c.step("p", [allocate("c", [1, 2], 2), bad], sid, fence)
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            message = err.value.message
        assert {
            "width": "packed_num_new_tokens is 9 bytes, not a whole number of uint32 values",
            "hash_width": "not a whole number of hashes of packed_hash_length (32)",
            "both": "not both",
            "entries": "one value per entry",
        }[what] in message
        assert tables(c, sid, fence, rids) == before
        assert tables(c, sid, fence, ["c"]) == [[]]  # (the Step's first operation was not applied)
        (r,) = c.step("p", [pb.Operation(decode=packed(d))], sid, fence).results
        assert r.status_code == 0 and r.decode.num_applied == 2 and r.decode.new_block_ids
        assert tables(c, sid, fence, rids) != before


def test_the_predicting_client_sends_its_decode_ops_packed(
    client: KVCoordClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The predicting client's decode steps go as packed DecodeOps (fields 2-10 empty),
    every answer equal to the mirror's (the client compares them) and the server holding
    the tables told."""
    from kvcoord.client import PredictingKVCacheManager
    from kvcoord.client.sender import StepSender
    from support import admit_prompt as _admit
    from support import hashed_req as _req
    from support import wire_pool_config
    from test_predicting import _grow, _tables

    client.create_pool("pred", wire_pool_config(32, events=True))
    sent: list[pb.DecodeOp] = []
    send = StepSender._send

    def recording(self: StepSender, request: pb.StepRequest, *args: object, **kw: object) -> object:
        sent.extend(o.decode for o in request.ops if o.HasField("decode"))
        return send(self, request, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(StepSender, "_send", recording)
    m = PredictingKVCacheManager(client, "pred", hash_seed="0", renew=False)
    reqs = [_req(f"r{i}", list(range(10 * i, 10 * i + 6))) for i in range(3)]
    told = {r.request_id: _admit(m, r) for r in reqs}
    for step in range(9):
        for r in reqs:
            _grow(r, [900 + step])
            assert m.allocate_slots(r, 1) is not None
            r.num_computed_tokens += 1
            told[r.request_id] = list(m.get_block_ids(r.request_id)[0])
        m.take_events()
    m.flush()
    assert m.lost_requests == 0
    assert _tables(client, "pred") == told
    assert sent and all(d.packed_num_new_tokens and not d.num_new_tokens for d in sent)
    assert any(d.packed_hash_length == 32 and d.packed_append_block_hashes for d in sent)
    m.close()
