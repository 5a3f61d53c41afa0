"""The engine's decode fast paths (``decode_token``, ``decode_step``,
``update_and_allocate``'s own, ``update_and_allocate(..., inside_checked=True)``,
``decode_run``, the allocation without a hit) answer and leave the pool exactly as the
general path (``update_request`` then ``allocate_slots``, every fused path off) does:
tests/fastpath_diff.py's four pools under one random workload per layout, compared
after every call (bench/fastpath_diff.py runs it longer). The divergences it found are
in test_fast_path_divergences.py, each reduced to its smallest case. Where
``allocation_changes_nothing`` (the service's check of an allocation a client answered
as changing nothing) says so, the entry changes no block.

Each layout makes more than 4,500 differential calls (one call compared across the
pools), the 23 layouts more than 100,000."""

from __future__ import annotations

import pytest
from fastpath_diff import LAYOUTS, Diff

#: differential calls per layout (the steps of a layout run until it has made them)
CALLS = 4500
#: layouts whose pools take the decode fast paths (the others compare general paths)
FAST = {name for name in LAYOUTS if Diff(name, 0).uaa.decode_fast_path}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_path_answers_as_the_general_path(layout: str) -> None:
    d = Diff(layout, seed=sum(map(ord, layout)))
    for _ in range(2000):  # (about 600 steps)
        d.step()
        if d.calls >= CALLS:
            break
    assert d.calls >= CALLS and len(LAYOUTS) * CALLS > 100_000, d.calls
    assert d.answered["refused"] > 20, d.answered  # (the pool fills)
    assert d.kinds["chunk"] > 20 and d.kinds["spec"] > 10, d.kinds
    if layout in FAST:
        assert d.answered["decode_token"] > 150 and d.answered["decode_run"] > 250, d.answered
        assert d.answered["changes_nothing"] > 300, d.answered
        if d.uaa._lone_manager is not None:
            assert d.answered["decode_step"] > 100, d.answered
    else:
        assert d.answered["decode_token"] == d.answered["decode_step"] == d.answered["decode_run"] == 0
