"""A request's rewind (vLLM 0.33's cut of a waiting streaming-input session): the
engine's rule (``KVCachePool.rewind_request`` / ``unrewind_request``), shared by the
server's sync and the predicting client's mirror, and the client tracker's detection
(``kvcoord.client.rewinds``): constant-time, never a column-run entry, loud when the
change reaches a computed position."""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.client.errors import InvalidArgumentError as ClientInvalidArgument
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.tracking import RequestTracker
from kvcoord.engine import (
    FailedPreconditionError,
    FullAttentionSpec,
    HandedTokenIds,
    InvalidArgumentError,
    SlidingWindowSpec,
)
from kvcoord.v1 import allocator_pb2 as pb
from support import ALGO, NONE, Driver, Req
from unit.test_client_fast_paths import _View  # vLLM's ConstantList


def _hashes(tokens: list[int]) -> list[bytes]:
    return BlockHasher(ALGO, 4, NONE).extend(tokens)


def _computed_session(d: Driver) -> list[int]:
    """Request "r": a 10-token prompt computed (2 blocks cached), token 77 sampled."""
    prompt = list(range(100, 110))
    d.add("r", prompt)
    assert d.pool.allocate_slots("r", 10) is not None
    d.pool.update_request("r", num_computed_tokens=10, append_token_ids=[77])
    return prompt + [77]


def test_rewind_drops_tokens_past_it_and_hashes_from_its_block_and_undoes() -> None:
    d = Driver(num_blocks=16)
    held = _computed_session(d)
    req = d.pool.get_request("r")
    hashes_before = list(req.block_hashes)
    rewind = d.pool.rewind_request("r", 10)
    assert req.all_token_ids == held[:10] and req.block_hashes == hashes_before[:2]  # 10 // 4 = 2 kept
    assert rewind.dropped_token_ids == (77,) and rewind.dropped_block_hashes == ()
    d.pool.update_request(
        "r", append_token_ids=[50, 51], append_block_hashes=_hashes(held[:10] + [50, 51])[2:]
    )
    assert req.all_token_ids == held[:10] + [50, 51] and req.block_hashes == _hashes(held[:10] + [50, 51])
    d.pool.unrewind_request("r", rewind)
    assert req.all_token_ids == held and req.block_hashes == hashes_before
    assert d.pool.get_block_ids("r") and req.num_computed_tokens == 10  # blocks and count kept


def test_rewind_drops_the_hash_of_the_block_holding_its_point() -> None:
    """vLLM's ``del block_hashes[keep // hash_block_size:]``: a rewind to 9 of 12
    tokens keeps 2 hashes (9 // 4), dropping the full block 2's."""
    d = Driver(num_blocks=16)
    tokens = list(range(12))
    d.add("r", tokens)
    rewind = d.pool.rewind_request("r", 9)
    assert len(d.pool.get_request("r").block_hashes) == 2 and rewind.dropped_block_hashes == (
        _hashes(tokens)[2],
    )
    assert rewind.dropped_token_ids == (9, 10, 11)


def test_rewind_takes_a_new_token_list_never_cutting_a_handed_one() -> None:
    """A registration's handed list (a client writes its first tokens into its message
    later) is never cut: the record gets a list of its own."""
    d = Driver(num_blocks=16)
    handed = HandedTokenIds(range(8))
    d.pool.add_request("r", handed, _hashes(list(range(8))))
    d.pool.rewind_request("r", 5)
    assert handed == list(range(8)) and d.pool.get_request("r").all_token_ids == list(range(5))


def test_rewind_refusals_change_nothing() -> None:
    d = Driver(num_blocks=16)
    held = _computed_session(d)
    req = d.pool.get_request("r")
    before = (list(req.all_token_ids), list(req.block_hashes), req.num_computed_tokens)
    with pytest.raises(FailedPreconditionError, match="below its 10 computed"):
        d.pool.rewind_request("r", 9)
    with pytest.raises(FailedPreconditionError, match="below its 11 computed"):
        d.pool.rewind_request("r", 10, num_computed_tokens=11)  # (the count the caller sets)
    with pytest.raises(InvalidArgumentError):
        d.pool.rewind_request("r", len(held) + 1)
    with pytest.raises(InvalidArgumentError):
        d.pool.rewind_request("r", -1)
    assert (list(req.all_token_ids), list(req.block_hashes), req.num_computed_tokens) == before
    # blocks cached past the computed tokens (vLLM caches at allocation): their hashes stay
    d.add("s", list(range(300, 312)))
    assert d.pool.allocate_slots("s", 12) is not None  # 3 blocks cached, 0 computed
    with pytest.raises(FailedPreconditionError, match="cached for it"):
        d.pool.rewind_request("s", 10)
    assert len(d.pool.get_request("s").all_token_ids) == 12
    assert d.pool.rewind_request("s", 12).dropped_token_ids == ()


# -- the client tracker ---------------------------------------------------------------
def _config() -> pb.PoolConfig:
    return pb.PoolConfig(enable_caching=True, hash_algo=ALGO, hash_block_size=4)


def _vllm_request(tokens: list[int]) -> Any:
    r: Any = Req("r", _View(list(tokens)))  # type: ignore[arg-type]
    r.block_hashes = _hashes(tokens)
    return r


def _cut(r: Any, append: list[int]) -> None:
    """vLLM 0.33's _update_request_as_session, in place."""
    keep = len(r.all_token_ids) - 1
    del r.all_token_ids._x[keep:]
    del r.block_hashes[keep // 4 :]
    r.all_token_ids._x.extend(append)
    r.block_hashes.extend(_hashes(list(r.all_token_ids._x))[len(r.block_hashes) :])


def _committed_session() -> tuple[RequestTracker, Any]:
    """A tracker and its request "r" (11 tokens, 10 computed), synced and committed."""
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    r.num_computed_tokens = 10
    t.sync(r)
    t.commit(["r"])
    return t, r


def test_the_tracker_rewinds_a_cut_request_to_its_computed_tokens() -> None:
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))  # 11 tokens, 2 hashes
    r.num_computed_tokens = 10
    t.sync(r)
    _cut(r, [50, 51])  # 11 -> 10 + 2 = 12 tokens: one more than sent (a decode step's shape)
    assert t.next_token(r) is None and t.sync_run(r) is None  # never a run entry
    sync = t.sync(r)
    assert sync.HasField("rewind_num_tokens") and sync.rewind_num_tokens == 10
    assert (sync.base_num_tokens, sync.base_num_hashes) == (11, 2)
    assert list(sync.append_token_ids) == [50, 51]
    assert list(sync.append_block_hashes) == _hashes(list(range(100, 110)) + [50, 51])[2:]
    # then the request decodes on as usual
    r.all_token_ids._x.append(60)
    r.num_computed_tokens = 12
    step = t.next_token(r)
    assert step is not None and step[:3] == (12, 3, 60)


def test_the_tracker_sends_no_rewind_for_a_cut_that_changed_nothing() -> None:
    """The chunk begins with the discarded token itself: the same tokens and hashes."""
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    r.num_computed_tokens = 10
    t.sync(r)
    _cut(r, [110, 51])
    sync = t.sync(r)
    assert not sync.HasField("rewind_num_tokens") and list(sync.append_token_ids) == [51]


def test_a_change_below_the_computed_tokens_is_refused_loudly() -> None:
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    r.num_computed_tokens = 11  # the last token sent is computed: it cannot change
    t.sync(r)
    r.all_token_ids._x[10] = 5
    with pytest.raises(ClientInvalidArgument, match="changed below what the pool may drop"):
        t.sync(r)
    r.all_token_ids._x[10] = 110  # back as sent: nothing to send, and no rewind
    assert not t.sync(r).HasField("rewind_num_tokens")


def test_a_request_with_nothing_computed_and_fewer_tokens_is_refused_as_before() -> None:
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    t.sync(r)
    with pytest.raises(ClientInvalidArgument):
        t.sync(_vllm_request(list(range(100, 105))))


@pytest.mark.parametrize("chunk", [[50, 51], [50]], ids=["longer", "same-length"])
def test_a_rewind_rolled_back_is_sent_again(chunk: list[int]) -> None:
    """The call carrying the rewind failed (the server still holds the discarded token):
    the position goes back to the committed one, and the next sync rewinds again, even
    where the request's length is the one sent before (its last token then says nothing
    of what the server holds)."""
    t, r = _committed_session()
    _cut(r, chunk)
    first = t.sync(r)
    assert first.rewind_num_tokens == 10 and first.base_num_tokens == 11
    t.rollback(["r"])
    again = t.sync(r)
    assert again.HasField("rewind_num_tokens") and again.rewind_num_tokens == 10
    assert (again.base_num_tokens, list(again.append_token_ids)) == (11, chunk)
    t.commit(["r"])
    r.all_token_ids._x.append(60)
    assert not t.sync(r).HasField("rewind_num_tokens")  # committed: decoding on as usual


def test_a_decode_step_after_a_rewind_rolled_back_is_no_run_entry() -> None:
    """A rewind's call failed and the request then decodes one token: it rewinds again
    (sync_values), never a run entry (next_token / sync_run give it up)."""
    t, r = _committed_session()
    _cut(r, [50])
    assert t.sync(r).rewind_num_tokens == 10
    t.rollback(["r"])
    r.all_token_ids._x.append(60)  # 12 tokens: one more than the position (11)
    assert t.next_token(r) is None and t.sync_run(r) is None
    again = t.sync(r)
    assert again.rewind_num_tokens == 10 and list(again.append_token_ids) == [50, 60]


def _decode(t: RequestTracker, r: Any, token: int) -> None:
    """One decode step of ``r`` through the tracker's decode path (its next token)."""
    r.all_token_ids._x.append(token)
    r.num_computed_tokens = len(r.all_token_ids) - 1
    r.block_hashes.extend(_hashes(list(r.all_token_ids._x))[len(r.block_hashes) :])
    assert t.next_token(r) is not None


def test_a_cut_at_a_position_restored_to_is_seen_behind_later_notes() -> None:
    """The notes are a ring of the last positions sent, written over in place: after
    forty committed decode steps (the ring wrapped) and five more whose Steps failed,
    the position is restored to one five notes behind the newest, and a change of its
    last token is found there and rewound, never sent as if the request were unchanged."""
    t, r = _committed_session()
    for i in range(40):
        _decode(t, r, 200 + i)
        t.commit(["r"])
    for i in range(5):
        _decode(t, r, 300 + i)
    t.rollback(["r"])
    assert t.mark("r") == (51, 12, 50, True)
    r.all_token_ids._x[50] = 5  # the last token the server holds, changed
    r.num_computed_tokens = 50
    sync = t.sync(r)
    assert sync.HasField("rewind_num_tokens") and sync.rewind_num_tokens == 50
    assert (sync.base_num_tokens, list(sync.append_token_ids)) == (51, [5, 300, 301, 302, 303, 304])


def test_a_cut_after_many_failed_steps_without_a_commit_is_still_seen() -> None:
    """Steps failing one after the other, none answered (a server away, a backlog of
    eight decode steps sent and lost each time): each round writes its notes past the
    committed position and is rolled back to it. After five such rounds the ring's
    thirty-two notes were all written since the committed position's own note, which
    was written over: a cut at that position then found no note, read as "not a
    position this tracker sent", and the request was synced as if unchanged (the
    server kept the discarded token and its hash: a later prefix hit on KV of another
    prompt). The position restored to keeps its note."""
    t, r = _committed_session()
    for _ in range(5):
        for i in range(8):  # (synced as a decode step: sync_run, or next_token's fast path)
            r.all_token_ids._x.append(300 + i)
            r.num_computed_tokens = len(r.all_token_ids) - 1
            r.block_hashes.extend(_hashes(list(r.all_token_ids._x))[len(r.block_hashes) :])
            assert list(t.sync(r).append_token_ids) == [300 + i]
        t.rollback(["r"])
        del r.all_token_ids._x[11:]  # (vLLM's request as the restore left the tracker: 11 tokens)
        del r.block_hashes[2:]
        r.num_computed_tokens = 10
    assert t.mark("r") == (11, 2, 10, True)
    _cut(r, [50, 51])  # the discarded token (110) is the last the server holds
    sync = t.sync(r)
    assert sync.HasField("rewind_num_tokens") and sync.rewind_num_tokens == 10
    assert (sync.base_num_tokens, list(sync.append_token_ids)) == (11, [50, 51])


# -- the session's prompt length (vLLM 0.33: num_prompt_tokens grows at the cut) -------
def _sparse_session(grow: bool) -> tuple[Driver, list[int], Any]:
    """vllm-0.33 full + sliding window (8 tokens, sparse retention): session "s", its
    10-token prompt computed and token 77 sampled, then cut (77 discarded) and its
    9-token chunk appended by the rewinding update, with the prompt length vLLM's cut
    sets (19: every token) when ``grow``. Returns the pool, the session's tokens and
    the update's undo."""
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=40, profile="vllm-0.33")
    prompt, chunk = list(range(100, 110)), list(range(300, 309))
    d.pool.add_request("s", prompt, _hashes(prompt))
    assert d.pool.allocate_slots("s", 10) is not None
    d.pool.update_request("s", num_computed_tokens=10, append_token_ids=[77])
    now = prompt + chunk
    grown = {"num_prompt_tokens": len(now)} if grow else {}
    undo = d.pool.update_rewound("s", 10, None, chunk, _hashes(now)[2:], **grown)
    return d, now, undo


def _continuation_hit(d: Driver, now: list[int]) -> int:
    """The session's chunk computed (a token sampled) and the session freed: the hit of a
    later request continuing the whole session."""
    assert d.pool.allocate_slots("s", 9) is not None
    d.pool.update_request(
        "s", num_computed_tokens=len(now), append_token_ids=[77], append_block_hashes=_hashes(now + [77])[4:]
    )
    d.pool.free("s")
    later = now + [98] * 8
    d.pool.add_request("q", later, _hashes(later))
    return d.pool.get_computed_blocks("q").num_tokens


def test_a_grown_prompt_moves_the_sparse_replay_boundary_and_is_undone() -> None:
    """Sparse retention keeps the window's tail at the prompt's end (its replay
    boundary): with the session's prompt grown to 19 tokens, a request continuing the
    session hits 16 tokens (the tail ending at 16 kept), as vLLM; at the first prompt's
    length (10) only 8."""
    d, now, undo = _sparse_session(grow=True)
    assert d.pool.get_request("s").num_prompt_tokens == 19
    undo()
    req = d.pool.get_request("s")
    assert (req.num_prompt_tokens, req.num_tokens, req.all_token_ids[-1]) == (10, 11, 77)
    d, now, _ = _sparse_session(grow=True)
    assert _continuation_hit(d, now) == 16
    d, now, _ = _sparse_session(grow=False)
    assert _continuation_hit(d, now) == 8


def test_a_prompt_length_that_cannot_be_the_sessions_is_refused_with_nothing_changed() -> None:
    d = Driver((FullAttentionSpec(4), SlidingWindowSpec(4, 8)), num_blocks=40, profile="vllm-0.33")
    prompt = list(range(100, 110))
    d.pool.add_request("s", prompt, _hashes(prompt))
    assert d.pool.allocate_slots("s", 10) is not None
    d.pool.update_request("s", num_computed_tokens=10, append_token_ids=[77], num_prompt_tokens=11)
    req = d.pool.get_request("s")
    before = (list(req.all_token_ids), list(req.block_hashes), req.num_computed_tokens, req.num_prompt_tokens)
    assert before[3] == 11
    with pytest.raises(InvalidArgumentError, match="past its 12 tokens"):
        d.pool.update_request("s", append_token_ids=[5], num_prompt_tokens=13)
    with pytest.raises(FailedPreconditionError, match="below its prompt's 11"):
        d.pool.update_request("s", append_token_ids=[5], num_prompt_tokens=10)
    with pytest.raises(FailedPreconditionError, match="below its 13 computed"):
        d.pool.update_request("s", num_computed_tokens=13, append_token_ids=[5], num_prompt_tokens=12)
    with pytest.raises(InvalidArgumentError):
        d.pool.update_request("s", num_prompt_tokens=-1)
    with pytest.raises(InvalidArgumentError, match="past its 11 tokens"):  # (rewound to 10, [5] appended)
        d.pool.update_rewound("s", 10, None, [5], [], num_prompt_tokens=12)
    assert (
        list(req.all_token_ids),
        list(req.block_hashes),
        req.num_computed_tokens,
        req.num_prompt_tokens,
    ) == before
    d.pool.update_request("s", num_computed_tokens=12, num_prompt_tokens=11)  # unchanged: no check, no change
    # vLLM 0.16 has no streaming sessions: a moving prompt length is refused there
    old = Driver(num_blocks=16)
    old.add("r", prompt)
    with pytest.raises(FailedPreconditionError, match="vllm-0.33 call"):
        old.pool.update_request("r", append_token_ids=[77], num_prompt_tokens=11)
    assert old.pool.get_request("r").num_tokens == 10
    old.pool.update_request("r", append_token_ids=[77], num_prompt_tokens=10)  # (unchanged)


def _session_cut(r: Any, append: list[int]) -> None:
    """:func:`_cut` and vLLM's prompt length after it: every token the session holds."""
    _cut(r, append)
    r.num_prompt_tokens = len(r.all_token_ids)


def test_the_tracker_sends_the_grown_prompt_length_even_when_the_cut_changed_nothing_sent() -> None:
    """The sampled token was never sent (the session stopped after it): the cut leaves
    every token and hash sent as it was, so no rewind, but the prompt grew: the next sync
    carries it (never a run entry), and only that one."""
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    r.num_prompt_tokens, r.num_computed_tokens = 11, 11
    assert not t.sync(r).HasField("num_prompt_tokens")  # (every token registered: the prompt)
    t.commit(["r"])
    r.all_token_ids._x.append(77)  # sampled, never sent
    _session_cut(r, [50, 51, 52])
    assert t.next_token(r) is None and t.sync_run(r) is None
    sync = t.sync(r)
    assert not sync.HasField("rewind_num_tokens") and sync.num_prompt_tokens == 14
    assert (sync.base_num_tokens, list(sync.append_token_ids)) == (11, [50, 51, 52])
    t.commit(["r"])
    r.all_token_ids._x.append(60)
    r.num_computed_tokens = 14
    assert not t.sync(r).HasField("num_prompt_tokens")


def test_the_grown_prompt_length_rides_the_rewind_and_is_sent_again_after_a_rollback() -> None:
    t = RequestTracker(_config(), NONE)
    r = _vllm_request(list(range(100, 111)))
    r.num_prompt_tokens, r.num_computed_tokens = 10, 10
    first = t.sync(r)
    assert first.num_prompt_tokens == 10  # registered: 10 of its 11 tokens are the prompt
    t.commit(["r"])
    _session_cut(r, [50, 51])
    sync = t.sync(r)
    assert (sync.rewind_num_tokens, sync.num_prompt_tokens) == (10, 12)
    t.rollback(["r"])  # the call failed: the server holds the old prompt length
    again = t.sync(r)
    assert (again.rewind_num_tokens, again.num_prompt_tokens) == (10, 12)
    t.commit(["r"])
    r.all_token_ids._x.append(60)
    r.num_computed_tokens = 12
    assert t.next_token(r) is not None  # committed: decoding on as usual
