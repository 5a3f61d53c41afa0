"""An AdoptPool that reaches a replica which already serves the pool: a late copy of an
earlier handover's call (sent again by a network in between, or run once its caller
had given up on it), naming a claim revision long gone.

The replica loaded the state it carried in place of the pool it served (``adopt_pool``
replaces a copy held here), journaled that, then found the claim not that revision and
removed the pool: with ``journal = "local"`` the pool's only state, with every
allocation it acknowledged since the handover, was gone from its journal, and its calls
were answered NOT_FOUND under its claim. Now a replica holding the pool's claim refuses
such a call before it touches anything (FAILED_PRECONDITION: the sender's claim is not
the pool's).

Real etcd, two real ``kvcoord serve`` replicas. A server hook
(durable_server.with_sitecustomize) keeps a copy of the state the old owner sends, and
the test sends it again once the handover is done."""

from __future__ import annotations

from pathlib import Path

import durable_server
import grpc
import pytest
from etcd_process import Etcd
from kvcoord.client import KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from service.helpers import allocate
from test_handover_late_swap import _config, _created_with_one_request, _served, _until
from test_replicas import placed

HOOK = """
import os

keep = os.environ.get("KVCOORD_TEST_KEEP_SENT_STATE")
if keep:  # the state of each pool this replica hands over is also written to the file
    import cbor2
    import kvcoord.service.server_cluster as sc

    dump = sc.dump_pool

    def _dump(registry, name, *args, **kwargs):
        value = dump(registry, name, *args, **kwargs)
        if kwargs.get("leases"):  # a handover's (not a base of the pool's journal in the store)
            with open(keep + ".part", "wb") as f:
                f.write(cbor2.dumps(value))
            os.replace(keep + ".part", keep)
        return value

    sc.dump_pool = _dump
"""


def _held_at(address: str, pool: str) -> dict[str, list[int]] | None:
    """The requests ``address`` itself serves of ``pool``: None when it does not serve
    it. One InspectPool on a bare channel: a client follows a NOT_OWNER redirect (retry
    policy or not), so the old owner answered for ``address`` (was: the wait for b ended
    while a still held the pool, and the late copy reached b during the handover's own
    adopt: ABORTED, "being adopted already")."""
    request = pb.InspectPoolRequest(pool=pool, all_requests=True)
    try:
        with grpc.insecure_channel(address) as channel:
            view = pb_grpc.AllocatorStub(channel).InspectPool(request, timeout=5)  # type: ignore[no-untyped-call]
    except grpc.RpcError:
        return None
    return {r.request_id: list(r.groups[0].block_ids) for r in view.requests}


@pytest.mark.parametrize("journal", ["local", "store"])
def test_a_late_adopt_pool_at_the_pools_owner_changes_nothing(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, journal: str
) -> None:
    cluster = request.node.name.replace("[", "-").rstrip("]")
    pool = placed("lateadopt", "b", ["a", "b"])  # placement moves it to b once b joins
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    sent = tmp_path / "sent-state"
    a = start_server(
        _config(etcd.endpoint, "a", tmp_path / "a", cluster, journal),
        env={**durable_server.env(), "KVCOORD_TEST_KEEP_SENT_STATE": str(sent)},
    )
    b: ServerProcess | None = None
    try:
        s, acknowledged = _created_with_one_request(a.address, pool)
        b = start_server(
            _config(etcd.endpoint, "b", tmp_path / "b", cluster, journal), env=durable_server.env()
        )
        # b itself (a client following redirects is answered by a until the handover)
        assert _until(lambda: _held_at(b.address, pool), 30, "b serves the pool") == acknowledged  # type: ignore[union-attr]
        with KVCoordClient([a.address, b.address], timeout=5.0) as c:
            r2 = c.allocate(pool, allocate("r2", list(range(100, 108)), 8).allocate, s.session_id, s.fence)
        acknowledged["r2"] = list(r2.result.new_block_ids[0].block_ids)

        late = pb.AdoptPoolRequest(
            pool=pool, state=sent.read_bytes(), from_replica="a", claim_revision=s.fence.term
        )
        with grpc.insecure_channel(b.address) as channel, pytest.raises(grpc.RpcError) as refused:
            pb_grpc.ReplicasStub(channel).AdoptPool(late, timeout=10)  # type: ignore[no-untyped-call]
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value

        assert _held_at(b.address, pool) == acknowledged  # still served by b, at once
        b.stop()
        b = start_server(
            _config(etcd.endpoint, "b", tmp_path / "b", cluster, journal), env=durable_server.env()
        )
        assert _until(lambda: _served([a.address, b.address], pool), 40, "the pool is served") == acknowledged
    finally:
        for p in (a, b):
            if p is not None:
                p.stop()
