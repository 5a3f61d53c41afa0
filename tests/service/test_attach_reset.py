"""AttachRequest.reset_prefix_cache over real gRPC: the pool's prefix cache is reset as
the session starts (a new engine process's memory holds none of it; a lost session's
worker may have written blocks the server never heard of), with the events and the
journal of a ResetPrefixCache; refused, changing nothing, while another session is
attached or a block is held; a retried Attach does not reset again."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from durable_server import small_pool
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager
from kvcoord.client.errors import PoolBusyError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.predicting import PredictionUnavailableError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate

POOL = small_pool(64).replace("enable_caching = true", "enable_caching = true\nenable_kv_cache_events = true")
PROMPT = [7000 + i for i in range(41)]  # 10 full blocks of 4


def _prompt() -> list[pb.HashedPrompt]:
    hashes = BlockHasher("sha256_cbor", 4, none_hash("sha256_cbor", "0")).extend(PROMPT)
    return [pb.HashedPrompt(hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes)]


def _fill(c: KVCoordClient, tokens: list[int], rid: str, session: Any = None) -> None:
    """A request that allocates and is freed: its blocks stay in the prefix cache."""
    s = session or c.attach("p", "sha256_cbor", 4, "0")
    got = c.allocate("p", allocate(rid, tokens, len(tokens)).allocate, s.session_id, s.fence)
    assert not got.result.refused
    c.free("p", [rid], session_id=s.session_id, fence=s.fence)
    if session is None:
        c.detach(s.session_id, s.fence)


def _hit(c: KVCoordClient) -> int:
    return c.score_pools(len(PROMPT), _prompt()).scores[0].hit_tokens


def _cached(c: KVCoordClient) -> list[int]:
    return list(c.inspect_pool("p", include_cached_blocks=True).cached_block_ids)


def _events(c: KVCoordClient) -> list[str]:
    """The pool's kinds of events so far (WatchEvents from the start, until it waits)."""
    kinds = []
    try:
        for e in c.watch_events("p", timeout=1.0):
            kinds.append(e.event.WhichOneof("event"))
    except Exception:  # noqa: BLE001 - the stream's deadline ends the read
        pass
    return kinds


def test_an_attach_with_reset_prefix_cache_starts_from_an_empty_cache_journaled(
    make_server: Callable[..., InProcessServer], tmp_path: Path
) -> None:
    """A previous engine's prompt is cached (hit 40 tokens); an exclusive Attach with
    reset_prefix_cache (its first answer lost, so the client retries it with its
    attach_key) answers prefix_cache_reset, leaves no cached block and no hit, and KV
    event consumers hear one AllBlocksCleared (the retry did not reset again). What
    the new session caches afterwards stays; a restart on the journal rebuilds exactly
    that (the reset replayed before the session's own calls)."""
    data = str(tmp_path / "data")
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, PROMPT, "old")
        assert _hit(c) == 40 and _cached(c)
    lose = FaultInjector(0, drop=1.0, methods=("Attach",))
    lose.enabled = True
    with KVCoordClient(server.address, timeout=10, interceptors=[lose]) as c:

        def first_lost(*args: Any, **kw: Any) -> Any:
            try:
                return original(*args, **kw)
            finally:
                lose.enabled = False

        original, lose.intercept_unary_unary = lose.intercept_unary_unary, first_lost  # type: ignore[method-assign]
        s = c.attach("p", "sha256_cbor", 4, "0", exclusive=True, reset_prefix_cache=True)
        assert lose.counts["dropped"] == 1
        assert s.exclusive and s.prefix_cache_reset
        assert [x.session_id for x in c.list_sessions("p").sessions] == [s.session_id]
        assert _cached(c) == [] and _hit(c) == 0
        assert _events(c).count("all_blocks_cleared") == 1
        _fill(c, PROMPT[:20], "new", s)  # the new engine computes and caches 5 blocks
        kept = _cached(c)
        assert len(kept) == 5 and _hit(c) == 20
    server.stop()
    server = make_server(POOL, data_dir=data)
    with KVCoordClient(server.address, timeout=10) as c:
        assert _cached(c) == kept and _hit(c) == 20
        assert [x.session_id for x in c.list_sessions("p").sessions] == [s.session_id]


def test_an_attach_with_reset_prefix_cache_is_refused_while_another_session_is_attached(
    make_server: Callable[..., InProcessServer],
) -> None:
    """The cache is every attached session's: while another session is attached, an
    Attach with reset_prefix_cache (exclusive or not) is PoolBusyError (POOL_EXCLUSIVE),
    and nothing changed: the cache, the hit, the sessions, no event."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, PROMPT, "old")
        other = c.attach("p", "sha256_cbor", 4, "0")
        before = (_cached(c), _hit(c), _events(c))
        for exclusive in (False, True):
            with pytest.raises(PoolBusyError) as refused:
                c.attach("p", "sha256_cbor", 4, "0", exclusive=exclusive, reset_prefix_cache=True)
            assert refused.value.reason == "POOL_EXCLUSIVE"
            assert (_cached(c), _hit(c), _events(c)) == before
            assert [x.session_id for x in c.list_sessions("p").sessions] == [other.session_id]


def test_a_reset_with_the_attach_releases_routers_reservations(
    make_server: Callable[..., InProcessServer],
) -> None:
    """A router's reservation holds a prompt's cached blocks, whose KV the new engine's
    memory does not hold (the request adopting it would read it): the Attach with
    reset_prefix_cache releases it, as when its time runs out, then resets; the pool
    answers no hit for the prompt and the session gets a mirrorable state."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        _fill(c, PROMPT, "old")
        assert c.score_pools(len(PROMPT), _prompt(), reserve_seconds=30.0).reservation.hit_tokens == 40
        assert c.get_stats("p").reservations.live == 1
        s = c.attach(
            "p", "sha256_cbor", 4, "0", exclusive=True, want_pool_state=True, want_engine_state=True,
            reset_prefix_cache=True,
        )  # fmt: skip
        assert s.prefix_cache_reset and s.HasField("pool_state") and not s.pool_state_unavailable
        stats = c.get_stats("p")
        assert (stats.reservations.live, stats.reservations.expired) == (0, 1)
        assert stats.num_free_blocks == 63 and _cached(c) == [] and _hit(c) == 0


class OlderServer(grpc.UnaryUnaryClientInterceptor):  # type: ignore[misc]
    """Makes the server one before AttachRequest.reset_prefix_cache: the field is not
    sent (an older server drops a field it does not know), so no answer says
    prefix_cache_reset."""

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if isinstance(request, pb.AttachRequest) and request.reset_prefix_cache:
            request = _without_reset(request)
        return continuation(details, request)


def _without_reset(request: pb.AttachRequest) -> pb.AttachRequest:
    copy = pb.AttachRequest()
    copy.CopyFrom(request)
    copy.reset_prefix_cache = False
    return copy


def test_a_server_that_does_not_reset_at_attach_is_never_trusted_with_the_cache(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Against a server before reset_prefix_cache (no prefix_cache_reset in its answer):
    the waiting manager asked to reset sends ResetPrefixCache at once, before any call
    reads the cache (no hit left); the predicting one is refused a mirror
    (PredictionUnavailableError naming why: vLLM's adapter then waits for the server,
    whose session resets as above), its session ended."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10, interceptors=[OlderServer()]) as c:
        _fill(c, PROMPT, "old")
        with pytest.raises(PredictionUnavailableError, match="does not reset the prefix cache"):
            PredictingKVCacheManager(c, "p", hash_seed="0", renew=False, reset_at_attach=True)
        assert list(c.list_sessions("p").sessions) == [] and _hit(c) == 40
        m = RemoteKVCacheManager(c, "p", hash_seed="0", renew=False, exclusive=True, reset_at_attach=True)
        assert _cached(c) == [] and _hit(c) == 0
        assert _events(c).count("all_blocks_cleared") == 1
        m.close()


def test_a_reset_after_the_attach_refused_while_a_block_is_held_ends_the_session(
    make_server: Callable[..., InProcessServer],
) -> None:
    """Against a server before reset_prefix_cache, a shared waiting session asked to
    reset (a vllm-0.33 engine's own pool, not predicted) sends ResetPrefixCache after
    its Attach; while another session holds a block the pool refuses it: the manager is
    PoolBusyError (POOL_EXCLUSIVE, naming the pool), the session it attached ended, and
    nothing else changed (the cache, the other session)."""
    server = make_server(POOL)
    with KVCoordClient(server.address, timeout=10, interceptors=[OlderServer()]) as c:
        _fill(c, PROMPT, "old")
        other = c.attach("p", "sha256_cbor", 4, "0")
        held = c.allocate("p", allocate("held", PROMPT[:8], 8).allocate, other.session_id, other.fence)
        assert not held.result.refused
        before = _cached(c)
        with pytest.raises(PoolBusyError, match="pool 'p' holds blocks") as refused:
            RemoteKVCacheManager(c, "p", hash_seed="0", renew=False, exclusive=False, reset_at_attach=True)
        assert refused.value.reason == "POOL_EXCLUSIVE"
        assert [x.session_id for x in c.list_sessions("p").sessions] == [other.session_id]
        assert _cached(c) == before
