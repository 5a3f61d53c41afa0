"""The client's request tracker: positioned syncs, written in place or returned."""

from __future__ import annotations

import pytest
from kvcoord.client.errors import InvalidArgumentError
from kvcoord.client.hashing import none_hash
from kvcoord.client.tracking import RequestTracker
from kvcoord.engine import HandedTokenIds
from kvcoord.v1 import allocator_pb2 as pb
from support import Req, wire_pool_config


def _config() -> pb.PoolConfig:
    return wire_pool_config(64)


def test_a_sync_written_into_an_operation_equals_the_returned_one() -> None:
    """``sync(request, into)`` writes into the operation's own field exactly what
    ``sync(request)`` returns, registration and later appends alike, and moves the
    position the same way (so the next sync starts where it should)."""
    returned = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    written = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    a, b = Req("r", list(range(10))), Req("r", list(range(10)))
    for step in range(3):
        op = pb.Operation()
        into = op.lookup.request
        assert written.sync(b, into) is into
        assert into == returned.sync(a)
        assert op.lookup.request.request_id == "r"
        assert written.mark("r") == returned.mark("r")
        for r in (a, b):
            r.all_token_ids.extend([100 + step, 200 + step, 300 + step])
            r.num_computed_tokens = len(r.all_token_ids) - 1
    op = pb.Operation()
    written.sync(b, op.allocate.request)
    expected = returned.sync(a)
    assert op.allocate.request == expected
    assert not expected.new_request and expected.base_num_tokens == 16
    assert list(expected.append_token_ids) == [102, 202, 302]
    assert expected.base_num_hashes == 4 and not expected.append_block_hashes  # 19 tokens: 4 full blocks


def test_a_rolled_back_sync_takes_the_hasher_back_with_it() -> None:
    """A registration never acknowledged is forgotten with its hasher when rolled back;
    a registered request's hasher goes back to the acknowledged tokens, so the next
    sync hashes the request's own tokens from there."""
    tracker = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    tracker.sync(Req("r", list(range(9))))
    tracker.rollback(["r"])
    assert "r" not in tracker
    fresh = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    again = tracker.sync(Req("r", list(range(100, 113))))
    assert again == fresh.sync(Req("r", list(range(100, 113))))
    tracker.commit(["r"])
    tracker.sync(Req("r", [*range(100, 113), 1, 2, 3]))  # never acknowledged
    tracker.rollback()
    later = tracker.sync(Req("r", [*range(100, 113), 7, 8, 9]))
    fresh.commit(["r"])
    assert later == fresh.sync(Req("r", [*range(100, 113), 7, 8, 9]))


def test_another_request_under_a_tracked_id_is_refused() -> None:
    """A request with fewer tokens, or another last sent token, than what was sent
    under its id is refused before anything is synced."""
    tracker = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    tracker.sync(Req("r", list(range(9))))
    for other in (list(range(5)), [*range(8), 42, 43]):
        with pytest.raises(InvalidArgumentError):
            tracker.sync(Req("r", other))
    assert tracker.mark("r") == (9, 2, 0, True)


def test_a_request_registered_again_after_a_preemption_names_its_prompt_length() -> None:
    """vLLM keeps a preempted request's prompt length; registered again with its output
    tokens, the first sync says how many are the prompt (vllm-0.33 pools place replay
    boundaries at its end); a request registered with its prompt alone does not."""
    tracker = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
    resumed = Req("r", list(range(25)), num_preemptions=1)
    resumed.num_prompt_tokens = 20  # type: ignore[attr-defined]
    first = tracker.sync(resumed)
    assert first.new_request and first.HasField("num_prompt_tokens") and first.num_prompt_tokens == 20
    tracker.commit(["r"])
    resumed.all_token_ids.append(7)
    assert not tracker.sync(resumed).HasField("num_prompt_tokens")
    fresh = Req("s", list(range(20)))
    fresh.num_prompt_tokens = 20  # type: ignore[attr-defined]
    assert not tracker.sync(fresh).HasField("num_prompt_tokens")


def test_a_registration_sends_its_own_tokens_while_the_engine_appends_to_them() -> None:
    """A registration's tokens are the list the mirror's engine keeps (HandedTokenIds)
    and appends the request's next tokens to on the scheduler's thread, while the
    Step that carries the registration may be written on the sender's thread. Whatever
    is appended while the sync is written is not this sync's: the server would hold one
    token too many, and the request's next positioned sync would be refused (every
    request reported lost). The other thread's append is made to fall right after the
    writer's first, second or third look at the list's length."""

    class AppendedMeanwhile(HandedTokenIds):
        looks = 0
        after = 0

        def __len__(self) -> int:
            n = super().__len__()
            self.looks += 1
            if self.looks == self.after:
                self.append(999)  # the next decode token, appended by the other thread
            return n

    for after in (1, 2, 3):
        tracker = RequestTracker(_config(), none_hash("sha256_cbor", "0"))
        values = tracker.sync_values(Req("r", list(range(20))))
        assert type(values.tokens) is HandedTokenIds and values.num_tokens == 20
        tokens = values.tokens = AppendedMeanwhile(values.tokens)
        tokens.after = after
        written = values.write(pb.RequestSync())
        assert written.new_request and list(written.append_token_ids) == list(range(20)), after
