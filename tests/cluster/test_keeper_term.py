"""A session's fence never goes back to an older term: a late answer of a deposed
owner (its pool taken over by another replica) does not replace the new owner's fence."""

from __future__ import annotations

from kvcoord.client.session import SessionKeeper
from kvcoord.v1 import allocator_pb2 as pb


class _NoClient:
    retry_horizon = 0.0


def test_a_deposed_owners_late_fence_is_not_adopted() -> None:
    attached = pb.AttachResponse(
        session_id="s", lease_seconds=60, fence=pb.Fence(instance_id="a", incarnation=7, position=3, term=10)
    )
    keeper = SessionKeeper(_NoClient(), lambda _previous: attached, renew=False)
    new_owner = pb.Fence(instance_id="b", incarnation=7, position=1, term=20)
    keeper.adopt(new_owner)
    assert keeper.fence == new_owner
    keeper.adopt(pb.Fence(instance_id="a", incarnation=7, position=9, term=10))  # the deposed owner, late
    assert keeper.fence == new_owner
    later = pb.Fence(instance_id="b", incarnation=7, position=5, term=20)
    keeper.adopt(later)
    assert keeper.fence == later
