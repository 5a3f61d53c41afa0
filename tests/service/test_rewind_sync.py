"""RequestSync.rewind_num_tokens over real gRPC: vLLM 0.33's cut of a waiting
streaming-input session (its last sampled token discarded, the next chunk appended),
applied by the pool as vLLM applies it (tokens past the rewind point dropped, hashes
from its block on), and refused LOUDLY, nothing changed, when it could leave a block's
KV under another token's hash: below the computed tokens (their KV is written), or
dropping the hash of a block already cached for the request."""

from __future__ import annotations

import re
from collections.abc import Callable

import grpc
import pytest
from durable_server import DurableServer, leased_server, small_pool
from kvcoord.client import KVCoordClient
from kvcoord.client.errors import KVCoordError
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.helpers import allocate, attach, follow_up, hashes
from support import pool_toml

PROMPT = list(range(100, 110))  # 10 tokens: 2 full blocks of 4


def _score(c: KVCoordClient, tokens: list[int]) -> int:
    """The tokens a new request with ``tokens`` would hit (read only)."""
    prompt = pb.HashedPrompt(
        hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes(tokens)
    )
    return c.score_pools(len(tokens), [prompt]).scores[0].hit_tokens


def _rewinding(held: list[int], keep: int, append: list[int], computed: int | None = None) -> pb.RequestSync:
    """A sync of request "r" held at ``held``: rewound to ``keep`` tokens, ``append`` appended."""
    now = held[:keep] + append
    kept_hashes = min(len(held) // 4, keep // 4)
    sync = pb.RequestSync(
        request_id="r",
        base_num_tokens=len(held),
        base_num_hashes=len(held) // 4,
        rewind_num_tokens=keep,
        append_token_ids=append,
        append_block_hashes=hashes(now)[kept_hashes:],
    )
    if computed is not None:
        sync.num_computed_tokens = computed
    return sync


def _position(c: KVCoordClient, sid: str, fence: pb.Fence, held: list[int]) -> tuple[int, int]:
    """The server's position of "r", tokens and hashes (a sync naming a wrong one is
    refused saying it)."""
    probe = pb.AllocateOp(request=follow_up("r", held + [0] * 64), num_new_tokens=1)
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", probe, sid, fence)
    assert err.value.reason == "SYNC_MISMATCH", err.value
    found = re.search(r"the server holds (\d+) / (\d+)", err.value.message)
    assert found is not None, err.value.message
    return int(found[1]), int(found[2])


@pytest.fixture
def session(make_server: Callable[..., InProcessServer]):  # type: ignore[no-untyped-def]
    server = make_server(small_pool(32))
    with KVCoordClient(server.address, timeout=10) as c:
        sid, fence = attach(c)
        yield c, sid, fence


def _streamed(c: KVCoordClient, sid: str, fence: pb.Fence) -> list[int]:
    """Request "r": its 10-token prompt computed (2 blocks cached), one token sampled
    (position 10, not computed): held at 11 tokens, 10 computed."""
    assert not c.allocate("p", allocate("r", PROMPT, 10).allocate, sid, fence).result.refused
    held = PROMPT + [77]
    step = pb.AllocateOp(request=follow_up("r", PROMPT, [77], num_computed_tokens=10), num_new_tokens=1)
    assert not c.allocate("p", step, sid, fence).result.refused
    return held


def test_a_rewind_drops_the_discarded_token_and_its_blocks_hash(session) -> None:  # type: ignore[no-untyped-def]
    """The session's token 77 (position 10) is discarded and [50, 51] appended: the pool
    holds the new tokens, and once they are computed the block holding positions 8-11
    is cached under [108, 109, 50, 51]'s hash, never under one with 77."""
    c, sid, fence = session
    held = _streamed(c, sid, fence)
    step = pb.AllocateOp(request=_rewinding(held, 10, [50, 51], computed=10), num_new_tokens=2)
    assert not c.allocate("p", step, sid, fence).result.refused
    now = PROMPT + [50, 51]
    assert _position(c, sid, fence, held) == (12, 3)
    # computed: the next sync caches block 2 (vLLM's cache_blocks at allocation)
    step = pb.AllocateOp(request=follow_up("r", now, [60], num_computed_tokens=12), num_new_tokens=1)
    assert not c.allocate("p", step, sid, fence).result.refused
    assert _score(c, now + [1, 2, 3, 4]) == 12
    assert _score(c, PROMPT + [77, 51, 9, 9, 9]) == 8


@pytest.mark.parametrize("keep", [9, 4])
def test_a_rewind_below_the_computed_tokens_is_refused_with_nothing_changed(session, keep: int) -> None:  # type: ignore[no-untyped-def]
    c, sid, fence = session
    held = _streamed(c, sid, fence)
    step = pb.AllocateOp(request=_rewinding(held, keep, [50, 51]), num_new_tokens=1)
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", step, sid, fence)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "below its 10 computed" in err.value.message
    assert _position(c, sid, fence, held) == (11, 2)


def test_a_rewind_below_the_computed_tokens_this_sync_sets_is_refused(session) -> None:  # type: ignore[no-untyped-def]
    """Checked against the computed count once the sync's own is applied."""
    c, sid, fence = session
    held = _streamed(c, sid, fence)
    step = pb.AllocateOp(request=_rewinding(held, 10, [50, 51], computed=11), num_new_tokens=1)
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", step, sid, fence)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert _position(c, sid, fence, held) == (11, 2)


def test_a_rewind_dropping_a_cached_blocks_hash_is_refused_with_nothing_changed(session) -> None:  # type: ignore[no-untyped-def]
    """A request allocated its 12-token prompt (3 blocks cached as vLLM caches them at
    allocation, none computed yet): a rewind to 10 tokens would drop block 2's hash while
    the block stays cached under it."""
    c, sid, fence = session
    prompt = list(range(200, 212))
    assert not c.allocate("p", allocate("r", prompt, 12).allocate, sid, fence).result.refused
    assert _score(c, prompt + [1]) == 12
    step = pb.AllocateOp(request=_rewinding(prompt, 10, [50, 51]), num_new_tokens=1)
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", step, sid, fence)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert "cached for it" in err.value.message
    assert _position(c, sid, fence, prompt) == (12, 3)
    assert _score(c, prompt + [1]) == 12


def test_a_rewind_past_the_position_or_on_a_new_request_is_invalid(session) -> None:  # type: ignore[no-untyped-def]
    c, sid, fence = session
    held = _streamed(c, sid, fence)
    step = pb.AllocateOp(request=_rewinding(held, 12, []), num_new_tokens=1)
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", step, sid, fence)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert _position(c, sid, fence, held) == (11, 2)
    fresh = allocate("s", [1, 2, 3], 3).allocate
    fresh.request.rewind_num_tokens = 0
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", fresh, sid, fence)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value


def test_a_rewind_survives_a_sigkill_and_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real ``kvcoord serve`` on its journal: the rewind acknowledged, the server
    SIGKILLed and restarted, the pool holds the rewound request (its position, and the
    block cached under the chunk's hash, not the discarded token's)."""
    server = leased_server(tmp_path, 600.0, num_blocks=32)
    server.start()
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            a = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=600.0)
            held = _streamed(c, a.session_id, a.fence)
            step = pb.AllocateOp(request=_rewinding(held, 10, [50, 51], computed=10), num_new_tokens=2)
            assert not c.allocate("p", step, a.session_id, a.fence).result.refused
        server.kill()
        server.start()
        with KVCoordClient(server.address, timeout=10) as c:  # (the session and its fence stay valid)
            assert _position(c, a.session_id, a.fence, held) == (12, 3)
            assert _score(c, PROMPT + [50, 51, 1]) == 12
            assert _score(c, PROMPT + [77, 51, 1]) == 8
    finally:
        server.stop()


# -- a streaming session's grown prompt (RequestSync.num_prompt_tokens on a later sync) --
#: vllm-0.33 full attention beside a sliding window of 8 tokens (sparse retention, 0.33's
#: default): the window's tail is kept at the prompt's end (its replay boundary)
SPARSE_POOL = pool_toml(
    "p", 40, sliding_window=8, events=False, max_model_len=None, extra='profile = "vllm-0.33"\n'
)
CHUNK = list(range(300, 309))  # 9 tokens: the session's 10 + 9 = 19


def _score033(c: KVCoordClient, tokens: list[int]) -> int:
    prompt = pb.HashedPrompt(
        hash_algo="sha256_cbor",
        hash_block_size=4,
        hash_seed="0",
        block_hashes=hashes(tokens),
        profile="vllm-0.33",
    )
    return c.score_pools(len(tokens), [prompt]).scores[0].hit_tokens


def _grown_session(c: KVCoordClient, sid: str, fence: pb.Fence, prompt: int | None) -> list[int]:
    """Session "r" cut (token 77 discarded) with CHUNK appended, its new prompt length
    ``prompt`` sent with the rewind (``None``: not sent), then the chunk computed and a
    token sampled. Returns the session's tokens."""
    held = _streamed(c, sid, fence)
    rewinding = _rewinding(held, 10, CHUNK, computed=10)
    if prompt is not None:
        rewinding.num_prompt_tokens = prompt
    assert not c.allocate("p", pb.AllocateOp(request=rewinding, num_new_tokens=9), sid, fence).result.refused
    now = PROMPT + CHUNK
    step = pb.AllocateOp(request=follow_up("r", now, [77], num_computed_tokens=19), num_new_tokens=1)
    assert not c.allocate("p", step, sid, fence).result.refused
    return now


@pytest.mark.parametrize(("prompt", "hit"), [(19, 16), (None, 8)], ids=["grown", "first-prompt"])
def test_a_grown_prompt_moves_the_sparse_replay_boundary(
    make_server: Callable[..., InProcessServer], prompt: int | None, hit: int
) -> None:
    """vLLM's cut makes the whole session (19 tokens) the prompt: the window tail ending
    at 16 is kept and a request continuing the session hits 16 tokens, as under vLLM.
    At the first prompt's length (10) only 8: what the pool did before it was sent."""
    server = make_server(SPARSE_POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        sid, fence = attach(c, profile="vllm-0.33")
        now = _grown_session(c, sid, fence, prompt)
        assert _score033(c, now + [98] * 8) == hit


def test_a_prompt_length_that_cannot_be_the_sessions_is_refused_with_nothing_changed(
    make_server: Callable[..., InProcessServer],
) -> None:
    server = make_server(SPARSE_POOL)
    with KVCoordClient(server.address, timeout=10) as c:
        sid, fence = attach(c, profile="vllm-0.33")
        held = _streamed(c, sid, fence)  # 11 tokens, 10 computed, prompt 10
        cases = [
            (13, None, grpc.StatusCode.INVALID_ARGUMENT, "past its 12 tokens"),
            (9, None, grpc.StatusCode.FAILED_PRECONDITION, "below its prompt's 10"),
            (11, 12, grpc.StatusCode.FAILED_PRECONDITION, "below its 12 computed"),
        ]
        for prompt, computed, code, message in cases:
            sync = follow_up("r", held, [5], num_computed_tokens=computed)
            sync.num_prompt_tokens = prompt
            with pytest.raises(KVCoordError) as err:
                c.allocate("p", pb.AllocateOp(request=sync, num_new_tokens=1), sid, fence)
            assert err.value.code == code and message in err.value.message, err.value
            assert _position(c, sid, fence, held) == (11, 2)
        # refused inside a rewinding sync too: the rewind is undone with it
        rewinding = _rewinding(held, 10, [50], computed=10)
        rewinding.num_prompt_tokens = 12
        with pytest.raises(KVCoordError) as err:
            c.allocate("p", pb.AllocateOp(request=rewinding, num_new_tokens=1), sid, fence)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert _position(c, sid, fence, held) == (11, 2)


def test_a_moving_prompt_length_is_refused_by_a_016_pool(session) -> None:  # type: ignore[no-untyped-def]
    """vLLM 0.16 has no streaming sessions: the field means nothing there, loudly."""
    c, sid, fence = session
    held = _streamed(c, sid, fence)
    sync = follow_up("r", held, [5])
    sync.num_prompt_tokens = 12
    with pytest.raises(KVCoordError) as err:
        c.allocate("p", pb.AllocateOp(request=sync, num_new_tokens=1), sid, fence)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "vllm-0.33" in err.value.message
    assert _position(c, sid, fence, held) == (11, 2)


def test_a_grown_prompt_survives_a_sigkill_and_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A real ``kvcoord serve`` on its journal, SIGKILLed and restarted after the grown
    session computed its chunk: the replayed pool keeps the window tail at the grown
    prompt's end (a continuation hits 16, not 8)."""
    server = DurableServer(tmp_path, SPARSE_POOL)
    server.config.write_text(
        server.config.read_text().replace(
            "snapshot_every = 2000\n",
            "snapshot_every = 2000\nmax_session_lease_seconds = 600.0\nsession_lease_seconds = 600.0\n"
            "idempotency_window_seconds = 2400.0\n",
        )
    )
    server.start()
    try:
        with KVCoordClient(server.address, timeout=10) as c:
            a = c.attach("p", "sha256_cbor", 4, "0", "worker", lease_seconds=600.0, profile="vllm-0.33")
            now = _grown_session(c, a.session_id, a.fence, 19)
            assert _score033(c, now + [98] * 8) == 16
        server.kill()
        server.start()
        with KVCoordClient(server.address, timeout=10) as c:
            assert _score033(c, now + [98] * 8) == 16
            assert _position(c, a.session_id, a.fence, now) == (20, 5)
    finally:
        server.stop()
