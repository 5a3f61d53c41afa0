"""ScoreEncoder's bytes are protobuf's own encoding of the same ScorePoolsResponse
(the message path, score_wire.scores_to_pb, serialized), for any scores and unscored
pools, with its per-pool parts kept, dropped and made again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kvcoord.engine.results import CacheHit
from kvcoord.service.pool_service import Fence, PoolScore, UnscoredPool, new_score
from kvcoord.service.score_wire import ScoreEncoder, scores_to_pb
from kvcoord.v1 import allocator_pb2 as pb

U32 = st.integers(0, 2**32 - 1)

scores = st.builds(
    lambda pool, hit, free, usage, total, iid, inc: new_score(pool, CacheHit(None, hit), free, usage, total, Fence(iid, inc)),  # type: ignore[arg-type]
    st.text(min_size=1, max_size=40),
    st.one_of(st.just(0), U32),
    st.one_of(st.just(0), U32),
    st.one_of(st.just(0.0), st.just(1.0), st.floats(0.0, 1.0)),
    st.one_of(st.just(0), U32),
    st.text(alphabet="0123456789abcdef", min_size=1, max_size=32),
    st.integers(1, 2**64 - 1),
)  # fmt: skip
unscored = st.builds(
    UnscoredPool, st.text(max_size=20), st.sampled_from(["NO_PROMPT", "TOO_LONG"]), st.text(max_size=60)
)


def reference(s: list[PoolScore], u: list[UnscoredPool]) -> bytes:
    return scores_to_pb(s, u, include_block_ids=False).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(st.lists(scores, max_size=70), st.lists(unscored, max_size=4), st.integers(1, 8))
def test_bytes_equal_protobufs_encoding(s: list[PoolScore], u: list[UnscoredPool], max_pools: int) -> None:
    encoder = ScoreEncoder(max_pools)
    expected = reference(s, u)
    assert encoder.encode(s, u) == expected
    assert encoder.encode(s, u) == expected  # again, from the kept parts (or past the bound)
    assert len(encoder._fixed) <= max_pools
    assert pb.ScorePoolsResponse.FromString(expected) == scores_to_pb(s, u, include_block_ids=False)


def test_a_pool_created_again_gets_its_new_fence() -> None:
    """The kept parts are per (pool, total, fence): a new incarnation is encoded anew."""
    encoder = ScoreEncoder()
    old = new_score("p", CacheHit(None, 32), 10, 0.5, 99, Fence("i", 1))  # type: ignore[arg-type]
    new = new_score("p", CacheHit(None, 16), 12, 0.25, 99, Fence("i", 2))  # type: ignore[arg-type]
    assert encoder.encode([old], []) == reference([old], [])
    assert encoder.encode([new], []) == reference([new], [])
    assert pb.ScorePoolsResponse.FromString(encoder.encode([new], [])).scores[0].fence.incarnation == 2
