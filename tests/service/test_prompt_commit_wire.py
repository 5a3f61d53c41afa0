"""A streaming session's cut (vLLM 0.33: the last sampled token discarded, the next
input chunk appended, the whole session its prompt) that leaves the request's position
where an earlier call of the same Step left it (one token out, one in): that earlier
call's answer must not settle the cut's rewind and prompt length while the cut's own
call was not applied (HUNT4 lead 4; real server, real gRPC). Old code: settled, so the
scheduler's next try sent neither; the server kept the discarded token and the old
prompt length, the client believed the chunk's: the pools of a run with and without
the failed call differed (the block holding the cut's position hashed differently)."""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.client import KVCoordClient, RequestUnknownError
from kvcoord.client.errors import AbortedError
from kvcoord.engine.state import export_state
from kvcoord.service.testing import InProcessServer
from service.test_grown_prompt_lost_answer import PROMPT, _hash, _manager, prompt_computed_77_sampled
from service.test_predicted_mirror_state import comparable


def _session(m: Any, fail: bool) -> tuple[list[int], ...]:
    r = prompt_computed_77_sampled(m)
    with m.batch() as b:
        cached = b.cache_blocks(r, 10)  # syncs r at 11 tokens (77 appended)
        if fail:
            unknown = b.get_block_ids("nobody")  # fails: what follows is not applied
        # the cut: 77 discarded, a one-token chunk appended (11 tokens again), all prompt
        del r.all_token_ids._x[10:]
        r.all_token_ids._x.append(300)
        r.num_prompt_tokens = 11
        _hash(r)
        allocated = b.allocate_slots(r, 1)
    cached.result()
    if fail:
        with pytest.raises(RequestUnknownError):
            unknown.result()
        with pytest.raises(AbortedError):
            allocated.result()
        assert m.allocate_slots(r, 1) is not None  # the scheduler's next try
    else:
        assert allocated.result() is not None
    r.num_computed_tokens = 11
    r.all_token_ids._x.append(88)
    _hash(r)
    assert m.allocate_slots(r, 1) is not None
    m.flush()
    return m.get_block_ids("r")


def test_an_earlier_calls_answer_does_not_settle_a_cut_whose_call_failed(server: InProcessServer) -> None:
    """The waiting manager's batch: cache_blocks (r at 11 tokens), a call that fails,
    the cut and allocate_slots (r at 11 tokens again: not applied); the scheduler's
    next try, then a decode step. The server ends as a run without the failed call."""
    with KVCoordClient(server.address, timeout=10) as c:
        ref = _manager("waiting", c, "clean")
        m = _manager("waiting", c, "failed")
        assert _session(m, fail=True) == _session(ref, fail=False)
        pools = server.running.servicer.registry.pools  # type: ignore[union-attr]
        held = pools["failed"].engine.get_request("r")
        assert (list(held.all_token_ids), held.num_prompt_tokens) == ([*PROMPT, 300, 88], 11), (
            "the server holds the discarded token or the old prompt length"
        )
        assert comparable(export_state(pools["failed"].engine)) == comparable(
            export_state(pools["clean"].engine)
        ), "the server's pool differs from a run without the failed call"
        m.close()
        ref.close()
