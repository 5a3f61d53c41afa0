"""A predicted session whose pool can no longer be predicted mid-run: its lost session,
attached again, finds a server restarted with another engine (a rolling upgrade to
another kvcoord release, or a patched engine) or one with no state to give. vLLM's
adapter goes on in the waiting mode (every answer the server's), as connect does when
the pool cannot be predicted from the start, instead of raising out of the scheduler
(which stopped the engine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RemoteKVCacheManager, RequestsLostError
from kvcoord.client.errors import FailedPreconditionError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.client.predicting import PredictionUnavailableError
from kvcoord.client.tracking import LostRequestInUseError
from kvcoord.client.vllm import Settings, connect
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from ports import free_port
from test_vllm_adapter import Req, engine

HASHER = ("sha256", 4, none_hash("sha256", "0"))


def _req(rid: str, tokens: list[int]) -> Req:
    return Req(rid, list(tokens), block_hashes=BlockHasher(*HASHER).extend(tokens))


def _grow(r: Req, token: int) -> None:
    r.all_token_ids.append(token)
    r.block_hashes = BlockHasher(*HASHER).extend(r.all_token_ids)


def _admit(m: Any, r: Req) -> None:
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, len(r.all_token_ids) - n, n, hit) is not None
    r.num_computed_tokens = len(r.all_token_ids)


def _decode(m: Any, reqs: list[Req], token: int) -> None:
    """One scheduler step: each request computes one more token."""
    for r in reqs:
        _grow(r, token)
        assert m.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
    m.take_events()


def _server_tables(address: str, pool: str) -> dict[str, tuple[list[int], ...]]:
    with KVCoordClient(address, timeout=10) as c:
        return {
            s.request_id: tuple(list(g.block_ids) for g in s.groups)
            for s in c.inspect_pool(pool, all_requests=True).requests
        }


def _check_equal(m: Any, address: str, pool: str, reqs: list[Req]) -> None:
    """Every table the adapter answers is the server's."""
    if isinstance(m.remote, PredictingKVCacheManager):
        m.remote.flush()  # every Step answered and compared
    assert {r.request_id: m.get_block_ids(r.request_id) for r in reqs} == _server_tables(address, pool)


def _end_session(address: str, m: Any) -> None:
    """The server ends the engine's session (as a lease that ran out during a long
    restart would): the next Step fails and the session is attached again."""
    with KVCoordClient(address, timeout=10) as other:
        other.detach(m.remote.session_id)


def test_a_rolling_upgrade_to_another_engine_goes_on_in_the_waiting_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The server is stopped and started again on its journal with another engine (its
    rules fingerprint differs: here the server's fingerprint function is replaced, as
    another release's would differ) while the predicted session is live. The session
    survives the restart; once it is lost, the re-attach finds an engine the client
    cannot mirror: the requests are reported lost (RequestsLostError, which vLLM's
    scheduler preempts), a warning names why, and the adapter goes on in the waiting
    mode, every answer the server's. (Before, FailedPreconditionError left the call:
    out of vLLM's schedule(), the engine stopped.)"""
    import kvcoord.service.pool_service as pool_service

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    data = str(tmp_path / "data")
    server = InProcessServer(data_dir=data, port=free_port()).start()  # (restarted on it: tests/ports.py)
    address = server.address
    pool = "upgrade"
    try:
        kv, cfg = engine(64)
        m = connect(Settings(target=address, pool=pool), kv, cfg)
        predicted = m.remote
        assert type(predicted) is PredictingKVCacheManager
        a, b = _req("a", list(range(10))), _req("b", list(range(100, 113)))
        _admit(m, a)
        _admit(m, b)
        m.take_events()
        for t in range(5):
            _decode(m, [a, b], 1000 + t)
        _check_equal(m, address, pool, [a, b])

        # the rolling upgrade: a clean stop, the journal kept, another engine on the same port
        server.stop()
        monkeypatch.setattr(pool_service, "rules_fingerprint", lambda: "state9-another-release")
        server = InProcessServer(data_dir=data, port=int(address.rsplit(":", 1)[1])).start()
        assert server.address == address
        for t in range(3):  # the session survived the restart: still predicted, answers compared
            _decode(m, [a, b], 2000 + t)
        _check_equal(m, address, pool, [a, b])
        assert m.remote is predicted and predicted.lost_requests == 0

        _end_session(address, m)
        _decode(m, [a, b], 3000)  # answered by the mirror: its Step fails on the server
        predicted.sender.settle()
        assert predicted.sender.failure is not None
        c = _req("c", list(range(200, 209)))
        with caplog.at_level("WARNING", logger="kvcoord.client"):
            with pytest.raises(RequestsLostError) as lost:
                m.get_computed_blocks(c)
        assert sorted(lost.value.request_ids) == ["a", "b"]
        assert "can no longer be predicted" in caplog.text and "running the waiting mode" not in caplog.text
        assert "the server's engine rules are 'state9-another-release'" in caplog.text
        assert "waiting mode from now on" in caplog.text
        assert m.unpredicted is not None and "state9-another-release" in m.unpredicted
        waiting = m.remote
        assert type(waiting) is RemoteKVCacheManager and not waiting.exclusive
        assert predicted.ended is not None and predicted.lost_requests == 2
        assert waiting.lost_requests == 2  # the engine's count goes on
        with pytest.raises(PredictionUnavailableError):  # the predicted manager is done
            predicted.get_computed_blocks(c)

        # a lost request used again before the scheduler preempted it is refused, never
        # registered afresh beside its lost table
        with pytest.raises(LostRequestInUseError):
            _decode(m, [a], 3500)
        # the scheduler preempts the lost requests (freed) and recomputes them
        for r in (a, b):
            m.free(r)
            r.num_computed_tokens = 0
        _admit(m, a)
        _admit(m, b)
        _admit(m, c)
        m.take_events()
        for t in range(6):
            before = waiting.round_trips
            _decode(m, [a, b, c], 4000 + t)
            assert waiting.round_trips > before  # every allocation waits for the server
        _check_equal(m, address, pool, [a, b, c])
        # a shared pool's semantics, as at connect: the waiting session holds no exclusive claim
        assert [s.exclusive for s in waiting.client.list_sessions(pool).sessions] == [False]
        m.close()
        assert _server_tables(address, pool) == {}
    finally:
        server.stop()


def _reserve(address: str, pool: str, tokens: list[int]) -> None:
    """A router's live reservation on the pool (a prompt whose blocks are cached)."""
    prompt = pb.HashedPrompt(hash_algo="sha256", hash_block_size=4, hash_seed="0",
                             block_hashes=BlockHasher(*HASHER).extend(tokens))  # fmt: skip
    with KVCoordClient(address, timeout=10) as c:
        reserved = c.score_pools(len(tokens), [prompt], candidate_pools=[pool], reserve_seconds=30.0)
        assert reserved.reservation.pool == pool, reserved


def test_a_reattach_releases_reservations_and_a_bare_manager_given_no_state_is_refused(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The lost session attaches again while a router's reservation is live on the
    lost session's cached blocks. vLLM's adapter resets the pool's prefix cache with
    its re-attach (its worker may have overwritten those blocks), which releases the
    reservation (its hit was KV the engine's memory may not hold): the server gives a
    state and the engine stays predicted, the lost request recomputed. A bare
    PredictingKVCacheManager (no reset asked, no adapter to take over) is given no
    state (pool_state_unavailable): PredictionUnavailableError naming why, loudly.
    (Before the reset, the adapter went on in the waiting mode here, and a request of
    the reserved prompt would have adopted blocks whose KV the worker had overwritten.)"""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer().start()
    address = server.address
    try:
        kv, cfg = engine(64)
        m = connect(Settings(target=address, pool="reserved"), kv, cfg)
        a = _req("a", list(range(40)))
        _admit(m, a)
        m.take_events()
        _check_equal(m, address, "reserved", [a])
        w = _req("w", list(range(500, 541)))
        _admit(m, w)
        m.free(w)  # computed and finished: its blocks stay cached
        m.take_events()  # (the step ends: its Step is sent)
        m.remote.sender.settle()
        # a's blocks are freed as abandoned (no hit on them any more); w's stay cached
        _end_session(address, m)
        _decode(m, [a], 77)  # answered by the mirror: its Step fails on the server
        m.remote.sender.settle()
        _reserve(address, "reserved", list(range(500, 540)))
        b = _req("b", list(range(300, 309)))
        with caplog.at_level("WARNING", logger="kvcoord.client"):
            with pytest.raises(RequestsLostError) as lost:
                _admit(m, b)
        assert lost.value.request_ids == ["a"]
        assert "can no longer be predicted" not in caplog.text
        assert type(m.remote) is PredictingKVCacheManager
        with KVCoordClient(address, timeout=10) as c:
            assert c.get_stats("reserved").reservations.live == 0
        m.free(a)
        a.num_computed_tokens = 0
        _admit(m, a)
        _admit(m, b)
        m.take_events()
        _check_equal(m, address, "reserved", [a, b])
        m.close()

        # a bare predicted manager: its re-attach after a loss resets too (whatever its
        # reset_at_attach says), which releases the reservation: the loss is reported,
        # the manager stays predicted (before: no reset, no state, PredictionUnavailableError)
        connect(Settings(target=address, pool="bare"), kv, cfg).close()  # (creates the pool)
        with KVCoordClient(address, timeout=10) as client:
            bare = PredictingKVCacheManager(client, "bare", hash_seed="0", renew=False)
            assert bare.on_unpredictable is None
            w = _req("w", list(range(500, 540)))
            _admit(bare, w)
            bare.free(w)  # computed and finished: its blocks stay cached
            r = _req("r", list(range(600, 640)))
            _admit(bare, r)
            bare.take_events()
            bare.flush()
            client.detach(bare.session_id)  # r's blocks are freed as abandoned
            _grow(r, 7)
            bare.allocate_slots(r, 1)
            bare.take_events()
            bare.sender.settle()
            _reserve(address, "bare", list(range(500, 540)))
            with pytest.raises(RequestsLostError) as lost:
                bare.get_computed_blocks(_req("s", list(range(9))))
            assert lost.value.request_ids == ["r"]
            assert client.get_stats("bare").reservations.live == 0
            w2 = _req("w2", list(range(500, 540)))
            assert bare.get_computed_blocks(w2)[1] == 0  # the cache was reset with the re-attach
            _admit(bare, w2)
            bare.free(w2)  # cached again, for the reservation below
            bare.take_events()
            bare.flush()
            bare.close()

            # a first Attach that asks no reset while a reservation is live is given no
            # state: nothing takes over, the error is typed and names why
            _reserve(address, "bare", list(range(500, 540)))
            with pytest.raises(PredictionUnavailableError, match="routers' reservations") as refused:
                PredictingKVCacheManager(client, "bare", hash_seed="0", renew=False)
            assert isinstance(refused.value, FailedPreconditionError)
    finally:
        server.stop()


def test_a_reattach_whose_state_outgrew_an_answer_goes_on_in_the_waiting_mode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The pool's state fitted in the first Attach's answer (a new pool: no block built
    yet), not in the re-attach's (ResourceExhaustedError, ANSWER_TOO_LARGE, under the
    server's max_message_bytes): the run built hundreds of blocks, whose free-queue
    order the state lists (the re-attach resets the prefix cache, not that). The
    adapter goes on in the waiting mode, naming why, as connect does when the state is
    too large from the start. (Before the reset with the re-attach, the cached hashes
    made it too large under 64 KiB.)"""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    server = InProcessServer(max_message_bytes=4 << 10, data_dir=str(tmp_path / "data")).start()
    address = server.address
    try:
        kv, cfg = engine(4000)
        m = connect(Settings(target=address, pool="grown"), kv, cfg)
        assert type(m.remote) is PredictingKVCacheManager
        reqs = [_req(f"r{i}", list(range(1000 * i, 1000 * i + 200))) for i in range(12)]
        for r in reqs:
            _admit(m, r)
            m.take_events()
            m.remote.flush()
        _check_equal(m, address, "grown", reqs)
        _end_session(address, m)  # 600 blocks built: the state is now larger than an answer
        _decode(m, reqs[:1], 5)
        m.remote.sender.settle()
        with pytest.raises(RequestsLostError) as lost:
            m.get_computed_blocks(_req("x", list(range(9))))
        assert sorted(lost.value.request_ids) == sorted(r.request_id for r in reqs)
        assert type(m.remote) is RemoteKVCacheManager
        assert m.unpredicted is not None and "max_message_bytes" in m.unpredicted
        assert "can no longer be predicted" in caplog.text
        for r in reqs[:2]:
            m.free(r)
            r.num_computed_tokens = 0
            _admit(m, r)
        m.take_events()
        _check_equal(m, address, "grown", reqs[:2])
        m.close()
    finally:
        server.stop()
