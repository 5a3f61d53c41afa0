"""HIT_BLOCK_TAKEN and UNCOUNTED_BLOCKS on a faulty network, from the managers a vLLM
worker runs: the waiting mode (``RemoteKVCacheManager``: every answer the server's)
and the predicted mode (``PredictingKVCacheManager``: its mirror answers, the server
is told afterwards).

One scheduler step holds a queued free, a decode of another request, the refused
first allocation (external tokens) and a free after it. The Step carrying them has its
answer lost (retried with its key), is sent twice, or an old copy of it arrives after
the next Step. Each time: the caller gets the typed refusal once, with its reason; the
waiting mode's Step applies what came before the refusal and nothing after it (the
free after it fails ABORTED, the caller frees again), the predicted mode sends nothing
of the refused call and everything else; what the manager believes held (its tables,
its free count) is the server's, which is the in-process engine's given the same calls;
CheckPool is clean; no request is lost; the session goes on, and once everything is
freed the pool has every block back.
"""

from __future__ import annotations

from typing import Any

import pytest
from kvcoord.client import (
    AbortedError,
    FailedPreconditionError,
    KVCoordClient,
    PredictingKVCacheManager,
    RemoteKVCacheManager,
)
from kvcoord.engine import EngineError, KVCachePool
from kvcoord.service.testing import InProcessServer
from kvcoord.wire.layouts import config_from_pb
from refusal_cases import DECODED, HIT_TAKEN, OTHER, UNCOUNTED_QUEUED, Case, FirstFaulted, certain
from test_waiting_manager import Req

CASES = {"uncounted": UNCOUNTED_QUEUED, "hit-taken": HIT_TAKEN}
FAULTS = ("drop", "duplicate", "reorder")


class Both:
    """A manager and an in-process engine pool given the same calls."""

    def __init__(self, m: Any, client: KVCoordClient, pool: str) -> None:
        self.m, self.client, self.pool = m, client, pool
        self.local = KVCachePool(config_from_pb(client.get_pool(pool).pool.config))
        self.reqs: dict[str, Req] = {}

    def alloc(self, rid: str, tokens: list[int], n: int) -> None:
        r = self.reqs[rid] = Req(rid, list(tokens))
        self.local.add_request(rid, r.all_token_ids, list(r.block_hashes))
        got = self.m.allocate_slots(r, n)
        want = self.local.allocate_slots(rid, n)
        assert got is not None and want is not None and got.block_ids == tuple(list(g) for g in want)
        r.num_computed_tokens = n

    def grow(self, rid: str) -> Req:
        """One token more for a running request (its decode's sync), on both."""
        r = self.reqs[rid]
        r.num_computed_tokens = len(r.all_token_ids)
        have = len(r.block_hashes)
        r.all_token_ids.append(DECODED)
        r.rehash()
        self.local.update_request(
            rid, num_computed_tokens=r.num_computed_tokens, append_token_ids=[DECODED],
            append_block_hashes=r.block_hashes[have:],
        )  # fmt: skip
        return r

    def free(self, rid: str) -> None:
        self.m.free(self.reqs.pop(rid))
        self.local.free(rid)

    def first(self, rid: str, prompt: list[int]) -> tuple[Req, tuple[Any, int], Any]:
        """A request with external tokens: added, looked up on both (the same hit)."""
        r = self.reqs.get(rid)
        if r is None:
            r = self.reqs[rid] = Req(rid, list(prompt))
        if rid not in self.local.requests:
            self.local.add_request(rid, r.all_token_ids, list(r.block_hashes))
        hit = self.m.get_computed_blocks(r)
        want = self.local.get_computed_blocks(rid)
        assert (hit[0].get_block_ids(), hit[1]) == (tuple(list(g) for g in want.block_ids), want.num_tokens)
        return r, hit, want

    def adopt(self, r: Req, hit: tuple[Any, int], want: Any) -> Any:
        """The first allocation: the prompt less the hit, 1 external token (the local
        engine's refusal raised, or its new blocks)."""
        n = len(r.all_token_ids) - hit[1] - 1
        return self.m.allocate_slots(r, n, hit[1], hit[0], num_external_computed_tokens=1), (
            lambda: self.local.allocate_slots(r.request_id, n, want.num_tokens, want, 0, 1)
        )

    def agree(self) -> None:
        """The server's free count and tables are the engine's and the manager's."""
        self.m.flush()
        s = self.client.inspect_pool(self.pool, all_requests=True)
        server = {r.request_id: [list(g.block_ids) for g in r.groups] for r in s.requests}
        local = {rid: [list(g) for g in self.local.get_block_ids(rid)] for rid in self.local.requests}
        assert server == local, (server, local)
        assert {rid: list(self.m.get_block_ids(rid)) for rid in server} == server
        assert s.num_free_blocks == self.local.num_free_blocks
        assert list(self.client.check_pool(self.pool).violations) == []
        assert self.m.lost_requests == 0


def _set_up(both: Both, case: Case) -> None:
    for call in case.setup:
        if call[0] == "alloc":
            both.alloc(*call[1:])
        else:
            both.free(call[1])
    both.m.flush()


def _goes_on(both: Both, case: Case, r: Req) -> None:
    """The pool changed so that the refused request fits (the free after the refusal
    did, for UNCOUNTED_BLOCKS: 7 blocks free); the same request's allocation is then the
    engine's; then everything is freed and every block is back."""
    if case is HIT_TAKEN:
        both.alloc("o", OTHER, 3)
    r2, hit, want = both.first(r.request_id, case.prompt)
    got, local = both.adopt(r2, hit, want)
    expected = local()
    assert got is not None and expected is not None and got.block_ids == tuple(list(g) for g in expected)
    both.agree()
    for rid in list(both.reqs):
        both.free(rid)
    both.agree()
    cfg = both.client.get_pool(both.pool).pool.config
    assert both.client.inspect_pool(both.pool).num_free_blocks == cfg.num_blocks - 1


def _arm(faults: FirstFaulted, fault: str) -> None:
    faults.p = certain(fault)
    faults.enabled = True


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_waiting_manager_tells_the_refusal_once_and_agrees_with_the_server(
    server: InProcessServer, name: str, fault: str, stream: bool
) -> None:
    """One explicit batch: [decode, the refused allocation, a free] after a queued free."""
    case = CASES[name]
    faults = FirstFaulted(0, methods=("Step",))
    faults.enabled = False
    with KVCoordClient(server.address, timeout=10, interceptors=[faults], step_stream=stream) as c:
        c.create_pool(name, case.config())
        m = RemoteKVCacheManager(c, name, hash_seed="0")
        both = Both(m, c, name)
        try:
            _set_up(both, case)
            r, hit, want = both.first(case.rid, case.prompt)
            both.free(case.queued)  # (queued: sent with the next Step)
            decoded = both.grow(case.decoded)
            _arm(faults, fault)
            with m.batch() as b:
                decode = b.allocate_slots(decoded, 1)
                n = len(r.all_token_ids) - hit[1] - 1
                refused = b.allocate_slots(r, n, hit[1], hit[0], num_external_computed_tokens=1)
                after = b.free(both.reqs[case.freed])
            if fault == "reorder":  # the old copy goes before the next Step
                m.get_block_ids(case.decoded)
                assert faults.counts["reordered"] == 1
            else:
                assert faults.counts["dropped" if fault == "drop" else "duplicated"] == 1
            faults.enabled = False
            with pytest.raises(FailedPreconditionError) as err:
                refused.result()
            assert err.value.reason == case.reason
            with pytest.raises(EngineError) as local_err:
                both.local.allocate_slots(r.request_id, n, want.num_tokens, want, 0, 1)
            assert local_err.value.reason == case.reason
            expected = both.local.allocate_slots(case.decoded, 1)
            assert expected is not None and decode.result().block_ids == tuple(list(g) for g in expected)
            decoded.num_computed_tokens += 1
            with pytest.raises(AbortedError):  # after the refusal: not applied in that Step
                after.result()
            # ... but sent again (the manager forgot the request when it was freed: a free
            # called again finds nothing to free): the server frees it as the engine does
            both.local.free(case.freed)
            both.reqs.pop(case.freed)
            both.agree()
            _goes_on(both, case, r)
        finally:
            m.close()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_waiting_managers_own_calls_tell_the_refusal_once(
    server: InProcessServer, name: str, fault: str, stream: bool
) -> None:
    """The calls one by one, as the vLLM plug-in makes them: the decode is a Step of its
    own, the queued free rides with the refused allocation (that Step's answer faulted),
    the free after it is queued for the next Step."""
    case = CASES[name]
    faults = FirstFaulted(0, methods=("Step",))
    faults.enabled = False
    with KVCoordClient(server.address, timeout=10, interceptors=[faults], step_stream=stream) as c:
        c.create_pool(name, case.config())
        m = RemoteKVCacheManager(c, name, hash_seed="0")
        both = Both(m, c, name)
        try:
            _set_up(both, case)
            r, hit, want = both.first(case.rid, case.prompt)
            decoded = both.grow(case.decoded)
            got = m.allocate_slots(decoded, 1)
            expected = both.local.allocate_slots(case.decoded, 1)
            assert got is not None and expected is not None
            assert got.block_ids == tuple(list(g) for g in expected)
            decoded.num_computed_tokens += 1
            both.free(case.queued)
            _arm(faults, fault)
            n = len(r.all_token_ids) - hit[1] - 1
            with pytest.raises(FailedPreconditionError) as err:
                m.allocate_slots(r, n, hit[1], hit[0], num_external_computed_tokens=1)
            assert err.value.reason == case.reason
            with pytest.raises(EngineError) as local_err:
                both.local.allocate_slots(r.request_id, n, want.num_tokens, want, 0, 1)
            assert local_err.value.reason == case.reason
            both.free(case.freed)
            if fault == "reorder":  # the old copy goes before the next Step
                m.get_block_ids(case.decoded)
                assert faults.counts["reordered"] == 1
            else:
                assert faults.counts["dropped" if fault == "drop" else "duplicated"] == 1
            faults.enabled = False
            both.agree()
            _goes_on(both, case, r)
        finally:
            m.close()


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_the_predicted_manager_sends_nothing_of_the_refusal_and_agrees_with_the_server(
    server: InProcessServer, name: str, fault: str, stream: bool
) -> None:
    """One scheduler step: a free, a decode, the refusal (the mirror's), a free; its Step
    faulted."""
    case = CASES[name]
    faults = FirstFaulted(0, methods=("Step",))
    faults.enabled = False
    with KVCoordClient(server.address, timeout=10, interceptors=[faults], step_stream=stream) as c:
        c.create_pool(name, case.config())
        m = PredictingKVCacheManager(c, name, hash_seed="0", renew=False)
        both = Both(m, c, name)
        try:
            _set_up(both, case)
            r, hit, want = both.first(case.rid, case.prompt)
            both.free(case.queued)
            decoded = both.grow(case.decoded)
            got = m.allocate_slots(decoded, 1)
            expected = both.local.allocate_slots(case.decoded, 1)
            assert (
                got is not None and expected is not None and got.block_ids == tuple(list(g) for g in expected)
            )
            decoded.num_computed_tokens += 1
            sent = m.steps_sent
            with pytest.raises(FailedPreconditionError) as err:
                both.adopt(r, hit, want)
            assert err.value.reason == case.reason
            with pytest.raises(EngineError) as local_err:
                n = len(r.all_token_ids) - hit[1] - 1
                both.local.allocate_slots(r.request_id, n, want.num_tokens, want, 0, 1)
            assert local_err.value.reason == case.reason
            assert m.steps_sent == sent
            both.free(case.freed)  # after the refusal, in the same scheduler step
            _arm(faults, fault)
            m.flush()  # the step's Step: the queued free, the decode, the free after
            if fault == "reorder":  # the old copy goes before the next Step
                both.alloc("w", [6000, 6001, 6002], 3)
                m.flush()
                assert faults.counts["reordered"] == 1
            else:
                assert faults.counts["dropped" if fault == "drop" else "duplicated"] == 1
            faults.enabled = False
            assert m.mirror.num_free_blocks == both.local.num_free_blocks
            both.agree()
            if case is UNCOUNTED_QUEUED and "w" in both.reqs:
                both.free("w")  # (its blocks would keep the refused request out)
            _goes_on(both, case, r)
        finally:
            m.close()
