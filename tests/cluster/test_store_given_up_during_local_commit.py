"""A call's record given up by the store journal (``journal = "store"``: the store
unreachable until the owner's lease may have ended, the pool given up here, its next
owner rebuilding it without the record) while the call still waits for its local
journal commit (a slow disk). The call must be told UNAVAILABLE: its record is not in
the store, so its answer (blocks the next owner does not hold) must never leave.

The store journal told a flush of failures only in the window between the records
committed when the flush began and its target: a record given up (and so counted as
settled) while the call waited for the local commit first was before that window,
and the call was answered as if its record were in the store.

Real processes: the owner reaches etcd through a TCP proxy the test cuts, and its
local journal's next write is held 3 s by a ``sitecustomize`` hook (a slow disk)."""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from test_store_kept_answer_given_up import two_replicas_r0_behind_proxy

#: once FLAG exists, the next local journal write takes 3 s (longer than the owner's
#: 2 s lease, within which its store write is retried and then given up)
_SLOW_WRITE = """
import os
import time

from kvcoord.service import journal

_real = journal.JournalStore.write


def _write(self, records, chunk=None):
    if os.path.exists({flag!r}):
        os.unlink({flag!r})
        time.sleep(3.0)
    return _real(self, records, chunk)


journal.JournalStore.write = _write
"""


def test_a_call_whose_store_record_is_given_up_during_its_local_commit_is_told_unavailable(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "slow"
    with two_replicas_r0_behind_proxy(
        etcd, tmp_path, request.node.name[:40], "g", r0_lease=2,
        before_r0=lambda: durable_server.with_sitecustomize(tmp_path, _SLOW_WRITE.format(flag=str(flag)), monkeypatch),
    ) as two:  # fmt: skip
        s, first = two.first_allocation()
        step = pb.StepRequest(
            pool=two.pool, session_id=s.session_id, fence=first.fence, idempotency_key="b-key",
            call_sequence=time.time_ns(), ops=[pb.Operation(allocate=allocate("b", list(range(100, 108)), 8).allocate)],
        )  # fmt: skip
        with grpc.insecure_channel(two.r0.address) as channel:
            flag.touch()  # the Step's local commit takes 3 s
            two.proxy.cut()  # its store write is retried until r0's lease may have ended, then given up
            try:
                told: object = pb_grpc.AllocatorStub(channel).Step(step, timeout=60)
            except grpc.RpcError as exc:
                told = exc
            finally:
                two.proxy.heal()
        assert not flag.exists(), "the local commit was not slowed"
        log = two.r0.log()
        assert f"the journal of pool {two.pool} could not be written to the store" in log, log
        held = two.held()
        assert held.get("a") == list(first.result.new_block_ids[0].block_ids), held
        if isinstance(told, pb.StepResponse):
            blocks = list(told.results[0].allocate.new_block_ids[0].block_ids)
            assert held.get("b") == blocks, (
                f"the Step was told b holds {blocks}, the pool's next owner holds {held}"
            )
        else:
            assert isinstance(told, grpc.RpcError) and told.code() == grpc.StatusCode.UNAVAILABLE, told
