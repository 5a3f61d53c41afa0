"""A sync that changes only a request's prompt length (vLLM 0.33's streaming input grows
``num_prompt_tokens``) leaves its position where the call before it left it: that earlier
call's answer must not commit the prompt the later, unanswered sync carries (old code:
committed whenever the earlier mark equalled the position, so a failed or unapplied
later call was rolled back to a prompt the server never got, and no sync carried it
again: the server kept the old prompt length for good)."""

from __future__ import annotations

from kvcoord.client.hashing import none_hash
from kvcoord.client.tracking import RequestTracker
from support import Req, wire_pool_config


def _registered() -> tuple[RequestTracker, Req]:
    tracker = RequestTracker(wire_pool_config(64), none_hash("sha256_cbor", "0"))
    r = Req("r", list(range(10)))
    r.num_prompt_tokens = 10  # type: ignore[attr-defined]
    tracker.sync(r)
    tracker.commit(["r"])
    return tracker, r


def test_an_earlier_calls_answer_does_not_commit_a_later_prompt_change() -> None:
    """Call 1 syncs r (its computed count moved); the prompt grows, tokens unchanged, and
    call 2's sync carries it (same position). Call 1 is answered, call 2 is not applied
    (rolled back): the next sync carries the prompt length again."""
    tracker, r = _registered()
    r.num_computed_tokens = 8
    tracker.sync(r)
    first = tracker.mark("r")
    r.num_prompt_tokens = 12  # type: ignore[attr-defined]
    carried = tracker.sync(r)
    assert carried.HasField("num_prompt_tokens") and carried.num_prompt_tokens == 12
    assert tracker.mark("r") == first  # (the position alone cannot tell the two calls apart)
    tracker.commit(["r"], {"r": first})  # call 1 applied
    tracker.rollback(["r"])  # call 2 failed, or was not applied after another one failed
    again = tracker.sync(r)
    assert again.HasField("num_prompt_tokens") and again.num_prompt_tokens == 12, (
        "the grown prompt is never sent again: the server keeps 10"
    )


def test_the_call_carrying_the_prompt_answered_settles_it() -> None:
    """The later call answered too: nothing is sent again (a prompt the server holds
    already may be sent again after a rollback: it changes nothing)."""
    tracker, r = _registered()
    r.num_prompt_tokens = 12  # type: ignore[attr-defined]
    assert tracker.sync(r).num_prompt_tokens == 12
    tracker.commit(["r"])  # (a whole Step answered)
    tracker.rollback(["r"])
    assert not tracker.sync(r).HasField("num_prompt_tokens")
