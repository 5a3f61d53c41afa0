"""A predicted session's mirror sums the engine's prefix-cache statistics twice: per
Step (what the server's answer must say) and per ``make_prefix_cache_stats`` (what the
scheduler reads). The mirror moves the engine's statistics into both sums only when
the engine recorded any; a reset with no lookup is one (its ``reset`` flag)."""

from __future__ import annotations

from kvcoord.client import KVCoordClient
from kvcoord.client.items import NO_STATS
from kvcoord.client.tracking import SyncValues
from kvcoord.engine import PrefixCacheStats
from service.test_mirror_errors import _mirror


def test_the_mirrors_statistics_add_up_per_step_and_per_scheduler_call(client: KVCoordClient) -> None:
    mirror, _ = _mirror(client, "p")
    empty = PrefixCacheStats()
    assert mirror.take_stats() == empty and mirror.take_step()[2] == empty
    for rid in ("a", "b"):
        mirror.apply(SyncValues(rid, True, 0, 0, tokens=[1] * 9, hashes=[b"\x01" * 32, b"\x02" * 32]))
        mirror.lookup(rid)
    two = PrefixCacheStats(requests=2, queries=18)
    assert mirror.peek_stats() == two
    assert mirror.take_stats() == two
    assert mirror.take_stats() == empty  # (nothing since)
    assert mirror.take_step()[2] == two  # the Step's sum is its own
    assert mirror.take_step()[2] == empty
    mirror.apply(SyncValues("c", True, 0, 0, tokens=[2] * 5, hashes=[b"\x03" * 32]))
    mirror.lookup("c")
    one = PrefixCacheStats(requests=1, queries=5)
    assert mirror.take_step()[2] == one and mirror.take_stats() == one


def test_a_reset_without_a_lookup_is_reported_to_both(client: KVCoordClient) -> None:
    mirror, _ = _mirror(client, "p")
    assert mirror.take_stats() == PrefixCacheStats()
    assert mirror.call("reset_prefix_cache") is True
    reset = PrefixCacheStats(reset=True)
    assert mirror.peek_stats() == reset
    assert mirror.take_stats() == reset and mirror.take_step()[2] == reset
    assert mirror.take_stats() == PrefixCacheStats() and mirror.take_step()[2] == PrefixCacheStats()


def test_sums_with_nothing_recorded_make_no_object_and_are_never_shared_out(client: KVCoordClient) -> None:
    """Most scheduler steps look nothing up: their sums are told without a new object
    (``take_changed_stats`` is None, a Step's are the shared all-zero ``NO_STATS``),
    while every sum given out to a caller is still its own object, and a sum with
    something recorded is the full one, once."""
    mirror, _ = _mirror(client, "p")
    assert mirror.take_changed_stats() is None
    assert mirror.take_step()[2] is NO_STATS and NO_STATS == PrefixCacheStats()
    first, second = mirror.take_stats(), mirror.take_stats()
    assert first == second == PrefixCacheStats() and first is not second
    mirror.apply(SyncValues("a", True, 0, 0, tokens=[1] * 9, hashes=[b"\x01" * 32, b"\x02" * 32]))
    mirror.lookup("a")
    one = PrefixCacheStats(requests=1, queries=9)
    assert mirror.take_changed_stats() == one and mirror.take_changed_stats() is None
    step = mirror.take_step()[2]
    assert step == one and step is not NO_STATS
    assert mirror.take_step()[2] is NO_STATS and NO_STATS == PrefixCacheStats()  # (never changed)
