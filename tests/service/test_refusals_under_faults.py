"""HIT_BLOCK_TAKEN and UNCOUNTED_BLOCKS on a faulty network, from the plain client: the
refused allocation's answer lost (the call retried with its key), sent twice, or a copy
of it delivered late, after calls that would let it through. Each time the caller is
told the typed refusal once, with its reason, and the server applies nothing of it:
its free count and tables stay the in-process engine's given the same calls (a late
copy applied would hold blocks for a request its client was told was refused), and
the session goes on. A Step holding other operations around the refused one applies
those before it, none after it, as the engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import hashes
from kvcoord.client import AbortedError, FailedPreconditionError, KVCoordClient
from kvcoord.client.answers import op_error
from kvcoord.client.errors import KVCoordError
from kvcoord.client.faults import FaultInjector
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from refusal_cases import CASES, OTHER, UNCOUNTED, Case, FirstFaulted, Twin, certain

AFTER = {  # a change after which the refused allocation goes through
    "uncounted": ("free", "y"),
    "hit-taken": ("alloc", "o", OTHER, 3),  # (takes the head blocks: the hit's block 2 too)
}


def _change(twin: Twin, name: str) -> None:
    change = AFTER[name]
    if change[0] == "free":
        twin.free(change[1])
    else:
        twin.alloc(*change[1:])


def _refused_by_allocate(client: KVCoordClient, twin: Twin) -> FailedPreconditionError:
    op = twin.case.refused_op()
    with pytest.raises(FailedPreconditionError) as err:
        client.allocate(twin.pool, op.allocate, twin.sid, twin.fence)
    assert err.value.reason == twin.case.reason
    return err.value


def _goes_on(twin: Twin, name: str, changed: bool = False) -> None:
    """The session goes on: once the pool changed (here, unless ``changed``), the refused
    request is allocated (the blocks the engine gives), then freed with everything else."""
    if not changed:
        _change(twin, name)
    case = twin.case
    (r,) = twin.step([case.refused_op()])
    assert not r.status_code and not r.allocate.refused, r.status_message
    twin.local.add_request(case.rid, case.prompt, hashes(case.prompt))
    hit = twin.local.get_computed_blocks(case.rid)
    want = twin.local.allocate_slots(
        case.rid, len(case.prompt) - hit.num_tokens - 1, hit.num_tokens, hit, 0, 1
    )
    assert want is not None and [list(g.block_ids) for g in r.allocate.new_block_ids] == [
        list(g) for g in want
    ]
    twin.held[case.rid] = list(case.prompt)
    twin.agrees()
    for rid in list(twin.held):
        twin.free(rid)
    twin.agrees()
    assert twin.server_state()[0] == twin.client.get_pool(twin.pool).pool.config.num_blocks - 1


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fault", ["drop", "delay", "duplicate"])
def test_a_refused_allocate_lost_or_sent_twice_is_told_once(
    server: InProcessServer, name: str, fault: str
) -> None:
    """The Allocate RPC (keyed): its refusal's answer lost (UNAVAILABLE) or late
    (DEADLINE_EXCEEDED) after the server refused it, and retried with its key; or the
    call delivered twice. One typed refusal with its reason; nothing applied."""
    faults = FirstFaulted(0, methods=("Allocate",))
    faults.p = certain(fault)
    with KVCoordClient(server.address, timeout=10, interceptors=[faults]) as c:
        twin = Twin(c, name, CASES[name])
        before = twin.server_state()
        _refused_by_allocate(c, twin)
        assert faults.counts[{"drop": "dropped", "delay": "delayed"}.get(fault, "duplicated")] == 1
        assert twin.server_state() == before
        twin.agrees()
        _goes_on(twin, name)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_late_copy_of_a_refused_allocate_applies_nothing(server: InProcessServer, name: str) -> None:
    """A copy of the refused Allocate (same key) delivered after the pool changed so that
    the allocation would now go through: the client was told the refusal, so the copy
    must not allocate the request (before: it did, holding blocks for a request its
    client believes refused; the server kept no answer under a refused call's key and
    applied the copy as a new call)."""
    case = CASES[name]
    faults = FaultInjector(0, methods=("Allocate",))
    with KVCoordClient(server.address, timeout=10, interceptors=[faults]) as c:
        twin = Twin(c, name, case)
        faults.p = certain("reorder")  # the refused call's copy held back (it is sent too)
        _refused_by_allocate(c, twin)
        faults.enabled = False
        _change(twin, name)  # (a Step: the held copy stays held)
        faults.enabled = True
        # the next Allocate (a decode of another request) brings the old copy before it
        got = c.allocate(twin.pool, twin.decode_op(case.decoded).allocate, twin.sid, twin.fence)
        assert faults.counts["reordered"] == 1
        want = twin.local_decode(case.decoded)
        assert [list(g.block_ids) for g in got.result.new_block_ids] == [list(g) for g in want]
        assert case.rid not in twin.server_state()[1]
        twin.agrees()
        faults.enabled = False
        _goes_on(twin, name, changed=True)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("fault", ["drop", "duplicate", "reorder"])
@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
def test_a_step_around_a_refusal_applies_what_comes_before_it(
    server: InProcessServer, name: str, fault: str, stream: bool
) -> None:
    """A Step [decode of a running request, the refused allocation, a free]: the decode
    is applied, the allocation refused with its reason, the free not applied (ABORTED),
    as the engine given the same calls; with the Step's answer lost and the Step
    retried with its key, sent twice, or an old copy of it delivered after the next
    Step (whose own operations are applied once)."""
    case: Case = CASES[name]
    faults = FirstFaulted(0, methods=("Step",))
    with KVCoordClient(server.address, timeout=10, interceptors=[faults], step_stream=stream) as c:
        twin = Twin(c, name, case)
        faults.p = certain(fault)
        decode = twin.decode_op(case.decoded)
        results = twin.step([decode, case.refused_op(), pb.Operation(free=pb.FreeOp(request_id=case.freed))])
        assert not results[0].status_code and not results[0].allocate.refused
        refusal, aborted = op_error(results[1]), op_error(results[2])
        assert (type(refusal), refusal.reason) == (FailedPreconditionError, case.reason)
        assert isinstance(aborted, AbortedError)
        want = twin.local_decode(case.decoded)
        assert [list(g.block_ids) for g in results[0].allocate.new_block_ids] == [list(g) for g in want]
        twin.agrees()
        if fault == "reorder":  # the next Step brings the old copy before it
            twin.free(case.freed)
            assert faults.counts["reordered"] == 1
        else:
            assert faults.counts["dropped" if fault == "drop" else "duplicated"] == 1
            twin.free(case.freed)
        twin.agrees()
        faults.enabled = False
        if name == "uncounted":  # (its change frees "y": freed already)
            twin.alloc("y", [101], 1)
        _goes_on(twin, name)


@pytest.mark.parametrize("snapshot", [False, True], ids=["journal", "snapshot"])
def test_a_refused_allocate_is_never_applied_after_a_restart(
    make_server: Callable[..., InProcessServer], tmp_path: Path, snapshot: bool
) -> None:
    """The refusal kept under its key survives a restart: replayed from the journal it is
    told again (with its reason); from a snapshot the key is a tombstone (ABORTED,
    ANSWER_EVICTED: loud, still never applied). Either way a copy of the call arriving
    once the pool would let it through allocates nothing."""
    data = str(tmp_path / "data")
    server = make_server("", data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        twin = Twin(c, "r", UNCOUNTED)
        request = pb.AllocateRequest(
            pool="r", session_id=twin.sid, fence=twin.fence, op=UNCOUNTED.refused_op().allocate,
            idempotency_key="refused-once",
        )  # fmt: skip
        with pytest.raises(FailedPreconditionError) as first:
            c.unary(KVCoordClient.allocate, request)
        assert first.value.reason == "UNCOUNTED_BLOCKS"
    server.stop(snapshot=snapshot)
    again = make_server("", data_dir=data)
    with KVCoordClient(again.address, timeout=10) as c:
        twin.client = c
        twin.free("y")  # the allocation would go through now
        with pytest.raises(KVCoordError) as retried:
            c.unary(KVCoordClient.allocate, request)
        if snapshot:
            assert isinstance(retried.value, AbortedError) and retried.value.reason == "ANSWER_EVICTED"
        else:
            assert (type(retried.value), retried.value.reason) == (
                FailedPreconditionError,
                "UNCOUNTED_BLOCKS",
            )
            assert retried.value.message == first.value.message
        assert UNCOUNTED.rid not in twin.server_state()[1]
        twin.agrees()
