"""The kept-answer rule of test_store_kept_answer_given_up.py for a Step applied in
slices: a Step too long for one turn goes on in a task of its own that holds the pool
(mutations.py, ``_sliced``) and journals it there. That task inherits the pool's mark
(``Recorder.answers_on``, set by the handler before the pool is taken), so when the
Step's record is given up by the store journal (r0 cut off from etcd until its lease
may have ended), both the Step and a copy of it sent under the same idempotency key
are told UNAVAILABLE, or else what they are told is what the pool's next owner holds.

The servers' turns are made 0 s long by a ``sitecustomize`` hook, so a Step of more
than one slice of operations is always sliced; the hook leaves a file behind when the
sliced path ran (the test checks it did)."""

from __future__ import annotations

import time
from pathlib import Path

import durable_server
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate
from test_store_kept_answer_given_up import sent_twice_while_cut, two_replicas_r0_behind_proxy

#: every turn ends after its first slice; the sliced path leaves ``flag`` behind
_SLICED = """
from kvcoord.service import mutations, turns

turns.SLICE_SECONDS = 0.0
_real = mutations.MutationRunner._sliced


def _sliced(self, *args, **kwargs):
    open({flag!r}, "w").close()
    return _real(self, *args, **kwargs)


mutations.MutationRunner._sliced = _sliced
"""

#: operations of the Step (SLICE_OPS is 16: several slices)
OPS = 40


def test_a_sliced_step_and_its_copy_whose_store_write_is_given_up_are_not_told_the_answer(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    flag = tmp_path / "sliced"
    with two_replicas_r0_behind_proxy(
        etcd, tmp_path, request.node.name[:40], "s",
        before_r0=lambda: durable_server.with_sitecustomize(tmp_path, _SLICED.format(flag=str(flag)), monkeypatch),
    ) as two:  # fmt: skip
        s, first = two.first_allocation()
        ops = [
            pb.Operation(allocate=allocate(f"b{n}", [1000 + n, 2000 + n, 3000 + n, 4000 + n], 4).allocate)
            for n in range(OPS)
        ]
        step = pb.StepRequest(
            pool=two.pool, session_id=s.session_id, fence=first.fence, idempotency_key="the-one-key",
            call_sequence=time.time_ns(), ops=ops,
        )  # fmt: skip
        flag.unlink(missing_ok=True)
        outcomes = sent_twice_while_cut(two.proxy, two.r0.address, "Step", step)
        assert flag.exists(), "the Step was not applied in slices (the test proves nothing)\n" + two.r0.log()
        held = two.held()
        assert held.get("a") == list(first.result.new_block_ids[0].block_ids), held
        for name, told in zip(("the Step", "its copy"), outcomes, strict=True):
            if isinstance(told, grpc.RpcError):
                assert told.code() == grpc.StatusCode.UNAVAILABLE, (name, told)
                continue
            for n, result in enumerate(told.results):
                blocks = list(result.allocate.new_block_ids[0].block_ids)
                assert held.get(f"b{n}") == blocks, (
                    f"{name} was told b{n} holds {blocks}, the pool's next owner holds {held.get(f'b{n}')}\n"
                    + two.r0.log()
                )
        assert isinstance(outcomes[0], grpc.RpcError), outcomes[0]
