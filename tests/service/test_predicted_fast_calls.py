"""vLLM's predicted manager's per-call fast paths against their general forms (issue 21
item 6): ``free`` with ``absorbing``'s rule written out, and a lookup reading the
engine's hit in place (``PredictingKVCacheManager.lookup_ids``)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RequestsLostError
from kvcoord.client.errors import KVCoordError, UnavailableError
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.vllm_manager import KVCoordKVCacheManager, absorbing
from support import NONE, Req, wire_pool_config


class _Req(Req):
    """What vLLM's Request gives the manager (a fixed prompt: its hashes taken once)."""

    block_hashes: list[bytes]

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


def _request(rid: str, tokens: list[int]) -> _Req:
    r = _Req(rid, list(tokens))
    r.block_hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
    return r


def _manager(client: KVCoordClient, name: str) -> KVCoordKVCacheManager:
    client.create_pool(name, wire_pool_config(32, events=True))
    return KVCoordKVCacheManager(PredictingKVCacheManager(client, name, hash_seed="0", renew=False))


#: ``free`` as the decorator made it (the general form of the rule)
_GENERAL_FREE = absorbing(lambda *_: None)(lambda self, request: self.remote.free(request))


@pytest.mark.parametrize("error", ["lost", "outage", "other", "none"])
@pytest.mark.parametrize("absorbing_now", [False, True])
def test_free_absorbs_as_the_decorator_does(client: KVCoordClient, error: str, absorbing_now: bool) -> None:
    """Raised, absorbed (lost requests kept for the scheduler) or passed on: the same as
    ``absorbing``'s rule, for every kind of error, absorbing or not."""
    outcomes = []
    for name, free in (("fast", KVCoordKVCacheManager.free), ("general", _GENERAL_FREE)):
        m = _manager(client, name)
        r = _request("r", list(range(9)))
        hit, n = m.get_computed_blocks(r)
        assert m.allocate_slots(r, 9 - n, n, hit) is not None
        raised = {
            "lost": RequestsLostError(
                ["r", "s"], KVCoordError(grpc.StatusCode.NOT_FOUND, "gone", "SESSION_LOST")
            ),
            "outage": UnavailableError(grpc.StatusCode.UNAVAILABLE, "down"),
            "other": KVCoordError(grpc.StatusCode.INVALID_ARGUMENT, "bad"),
            "none": None,
        }[error]
        remote = m.remote
        assert isinstance(remote, PredictingKVCacheManager)
        if raised is not None:

            def fail(request: Any, err: KVCoordError = raised) -> None:
                raise err

            remote.free = fail  # type: ignore[method-assign]
        m.absorbing = absorbing_now
        try:
            got: object = ("ok", free(m, r))
        except KVCoordError as err:
            got = ("raised", type(err).__name__)
        outcomes.append((got, sorted(m.lost), m.absorbed, "r" in m._held, remote.tracker.__contains__("r")))
        m.absorbing = False
        if raised is not None:
            del remote.free  # type: ignore[attr-defined]
        m.close()
    # (the fast side's own pops happen before the remote call, the general's after its
    # wrapper: only the remote's outcome and the adapter's records are compared)
    assert [o[:3] for o in outcomes] == [outcomes[1][:3]] * 2
    assert outcomes[0][3] is False  # the adapter's record is gone whatever the remote said


def test_a_lookups_hit_is_the_engines_and_is_answered_as_lists(client: KVCoordClient) -> None:
    """The adapter's lookup reads the engine's hit in place (tuples, never changed)
    and answers what the general path (``get_computed_blocks``'s lists) answers."""
    fast, general = _manager(client, "fast"), _manager(client, "general")
    general._allocate_running = None  # (its lookups then take the general path)
    prompt = list(range(13))
    for m in (fast, general):
        r = _request("a", prompt)
        hit, n = m.get_computed_blocks(r)
        assert m.allocate_slots(r, 13 - n, n, hit) is not None
        r.num_computed_tokens = 13
    answers = []
    for m in (fast, general):
        b = _request("b", prompt + [99])
        hit, n = m.get_computed_blocks(b)
        answers.append(
            ([[(x.block_id, x.block_hash) for x in g] for g in hit.blocks], n, hit.get_block_ids())
        )
        assert type(hit.get_block_ids()[0]) is list
    assert answers[0] == answers[1] and answers[0][1] == 12
    remote = fast.remote
    assert isinstance(remote, PredictingKVCacheManager)
    ids, n = remote.lookup_ids(_request("c", prompt + [5]))
    assert type(ids) is tuple and all(type(g) is tuple for g in ids) and n == 12
    for m in (fast, general):
        m.remote.flush()  # the server confirmed both sessions' lookups
        m.close()
