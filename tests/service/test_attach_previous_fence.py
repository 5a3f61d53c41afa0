"""Both managers send the fence of the session they lost with the Attach that starts it
again (AttachRequest.previous_fence), over real gRPC against a journaled server: a
restored server can then be proven by a worker whose only call to it is that Attach
(tests/reliability/test_restore_reattach.py has the restore itself)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import small_pool
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager
from kvcoord.client.errors import RequestsLostError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import hashed_req


class _Attaches(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Keeps every AttachRequest sent."""

    def __init__(self) -> None:
        self.sent: list[pb.AttachRequest] = []

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if details.method.endswith("/Attach"):
            self.sent.append(request)
        return continuation(details, request)


@pytest.mark.parametrize("kind", ["waiting", "predicting"])
def test_a_manager_attaching_again_names_the_fence_it_held(
    make_server: Callable[..., InProcessServer], tmp_path: Path, kind: str
) -> None:
    """The first Attach names no previous fence; the manager's session is ended from
    outside (an operator's Detach: its requests lost); the next call reports the loss
    and attaches again, naming the fence it held (the highest position it was told,
    with its tag); that Attach is served as any (no restore here)."""
    server = make_server(small_pool(64), data_dir=str(tmp_path / "data"))
    seen = _Attaches()
    with KVCoordClient(server.address, timeout=10, interceptors=[seen]) as c, \
         KVCoordClient(server.address, timeout=10) as operator:  # fmt: skip
        if kind == "waiting":
            m: Any = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False)
        else:
            m = PredictingKVCacheManager(c, "p", hash_seed="0", renew=False)
        assert len(seen.sent) == 1 and not seen.sent[0].HasField("previous_fence")
        r = hashed_req("r1", list(range(16)))
        assert m.allocate_slots(r, 16) is not None
        m.flush()  # (the predicting manager's Step answered: its fence adopted)
        held = pb.Fence()
        held.CopyFrom(m.keeper.fence)
        assert held.position > 0 and held.position_tag
        operator.detach(m.keeper.session_id, held)
        r2 = hashed_req("r2", list(range(100, 116)))
        with pytest.raises(RequestsLostError):
            for _ in range(3):  # (the predicting manager hears of it at its Step's answer)
                m.allocate_slots(r2, 16)
                m.flush()
        assert len(seen.sent) == 2
        assert seen.sent[1].previous_fence == held
        assert m.keeper.session_id != "" and m.keeper.fence.instance_id == held.instance_id
        m.close()
