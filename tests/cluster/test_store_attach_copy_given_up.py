"""An Attach sent again under its ``attach_key`` while the first one's ``attach`` record
is still on its way to the cluster store (``journal = "store"``): the retry finds the
session the first Attach made and answers with it. When that record is given up (the
store cannot be reached until the owner's lease may have ended: the pool is given up
here, its next owner rebuilds it from the store without the session), the retry must be
told UNAVAILABLE as the first Attach is, never the session: its client would go on with
a session the pool's next owner never heard of (its Steps refused there, or worse,
a fresh Attach elsewhere with the same key believed to be the same session).

The owner reaches etcd through a TCP proxy the test cuts; the two Attaches are the same
request bytes sent on a raw gRPC stub (as a client's retry after a lost answer is)."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import SessionExpiredError
from kvcoord.v1 import allocator_pb2 as pb
from test_store_kept_answer_given_up import sent_twice_while_cut, two_replicas_r0_behind_proxy


def test_a_retried_attach_whose_session_record_is_given_up_is_not_told_the_session(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    with two_replicas_r0_behind_proxy(etcd, tmp_path, request.node.name[:40], "k") as two:
        two.first_allocation()  # the pool's stream is written
        attach = pb.AttachRequest(
            pool=two.pool, hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", client_name="w",
            lease_seconds=120, attach_key="the-one-attach-key",
        )  # fmt: skip
        outcomes = sent_twice_while_cut(two.proxy, two.r0.address, "Attach", attach)
        assert isinstance(outcomes[0], grpc.RpcError), outcomes[0]
        assert outcomes[0].code() == grpc.StatusCode.UNAVAILABLE, outcomes[0]
        told = outcomes[1]
        if isinstance(told, grpc.RpcError):
            assert told.code() == grpc.StatusCode.UNAVAILABLE, told
            return
        # told the session: whoever serves the pool next must know it
        with KVCoordClient(two.targets, timeout=10.0) as c:
            deadline = time.monotonic() + 60
            while True:
                try:
                    c.heartbeat(told.session_id, pool=two.pool)
                    break
                except SessionExpiredError as exc:
                    raise AssertionError(
                        f"the retried Attach was told session {told.session_id}, the pool's next owner "
                        f"does not know it: {exc!r}\n{two.r0.log()}"
                    ) from None
                except Exception as exc:  # noqa: BLE001 - the pool changing owner: asked again
                    assert time.monotonic() < deadline, f"{exc!r}\n{two.logs()}"
                    time.sleep(0.2)
