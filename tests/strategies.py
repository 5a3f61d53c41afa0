"""Hypothesis strategies: valid KV cache layouts and scheduler-like workloads."""

from __future__ import annotations

import math

from hypothesis import strategies as st
from kvcoord.engine import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
)

H = 4

_caching_layouts = st.one_of(
    st.just((FullAttentionSpec(4),)),
    st.builds(lambda w: (SlidingWindowSpec(4, w),), st.sampled_from([4, 8, 13, 32])),
    st.just((MambaSpec(4, MambaCacheMode.ALL),)),
    st.builds(lambda c: (ChunkedLocalAttentionSpec(4, c),), st.sampled_from([8, 16])),
    st.builds(
        lambda bs, w: (FullAttentionSpec(4), SlidingWindowSpec(bs, w)),
        st.sampled_from([4, 8]),
        st.sampled_from([8, 16, 32]),
    ),
    st.builds(
        lambda w1, w2: (FullAttentionSpec(4), SlidingWindowSpec(4, w1), SlidingWindowSpec(4, w2)),
        st.sampled_from([8, 16]),
        st.sampled_from([8, 32]),
    ),
    st.builds(lambda bs: (FullAttentionSpec(4), MambaSpec(bs, MambaCacheMode.ALL)), st.sampled_from([4, 8])),
    st.builds(lambda c: (FullAttentionSpec(4), ChunkedLocalAttentionSpec(4, c)), st.sampled_from([8, 16])),
    st.just((SlidingWindowSpec(4, 8), MambaSpec(4, MambaCacheMode.ALL))),
    st.just((FullAttentionSpec(4), FullAttentionSpec(4, num_kv_heads=2), SlidingWindowSpec(8, 16))),
)

_nocache_layouts = st.sampled_from(
    [
        (FullAttentionSpec(4),),
        (FullAttentionSpec(4), SlidingWindowSpec(4, 8)),
        (FullAttentionSpec(4), CrossAttentionSpec(4)),
    ]
)


@st.composite
def configs(draw: st.DrawFn) -> KVCacheConfig:
    """A valid pool layout with 6 to 48 blocks."""
    caching = draw(st.integers(0, 4)) > 0
    groups = draw(_caching_layouts if caching else _nocache_layouts)
    lcm = math.lcm(*(g.block_size for g in groups))
    eagle_ok = caching and all(
        not isinstance(g, ChunkedLocalAttentionSpec)
        and (not isinstance(g, SlidingWindowSpec) or g.block_size == lcm)
        for g in groups
    )
    eagle = eagle_ok and draw(st.booleans())
    return KVCacheConfig(
        num_blocks=draw(st.integers(6, 48)),
        groups=groups,
        hash_block_size=H,
        enable_caching=caching,
        use_eagle=eagle,
        enable_kv_cache_events=draw(st.booleans()),
        max_model_len=96,
    )


PREFIXES = [list(range(100, 100 + n)) for n in (0, 4, 9, 16, 24)]
