"""A streaming session's grown prompt (vLLM 0.33's cut: ``RequestSync.num_prompt_tokens``
on a registered request) whose Step's answer is lost, duplicated or delivered again
late, over real gRPC (a channel interceptor faults that very Step): the retry carries
the prompt length again under its key, applied once; the server's pool and the
client's (the predicting client's mirror, which ran ahead meanwhile) agree on the
request's blocks and on a continuation's hit, which is what a fault-free run gives
(the window tail kept at the grown prompt's end: a 16-token hit, not 8)."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, RequestsLostError
from kvcoord.client.errors import KVCoordError, LocalRpcError
from kvcoord.client.faults import FaultInjector
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.retry import RetryPolicy
from kvcoord.client.vllm033 import Predicting033KVCacheManager, Remote033KVCacheManager
from kvcoord.engine.state import export_state
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from service.test_predicted_mirror_state import comparable
from support import NONE, Req
from unit.test_client_fast_paths import _View  # vLLM's ConstantList

PROMPT = list(range(100, 110))  # 10 tokens
CHUNK = list(range(300, 309))  # the next input chunk: 9 tokens (the session then 19)


def _config() -> pb.PoolConfig:
    """vllm-0.33 full attention beside an 8-token sliding window (sparse retention: the
    window's tail is kept at the prompt's end, so the prompt length moves hits)."""
    return pb.PoolConfig(
        num_blocks=40, hash_block_size=4, enable_caching=True, hash_algo="sha256_cbor", hash_seed="0",
        max_model_len=256, profile="vllm-0.33",
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4)),
            pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8)),
        ],
    )  # fmt: skip


def _carries_prompt(msg: Any) -> bool:
    """Whether a message holds a RequestSync naming ``num_prompt_tokens``."""
    if msg.DESCRIPTOR.name == "RequestSync" and msg.HasField("num_prompt_tokens"):
        return True
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        for v in [value] if hasattr(value, "DESCRIPTOR") else value:
            if _carries_prompt(v):
                return True
    return False


class FaultPromptStep(FaultInjector):
    """Faults the Step carrying the grown prompt: "drop" (applied, its answer lost,
    ``times`` attempts in a row), "duplicate" (applied twice), "reorder" (answered, then
    delivered again late, before the next Step)."""

    def __init__(self, fault: str, times: int = 1) -> None:
        super().__init__(0, methods=("Step",))
        self.fault, self.times = fault, times
        self.seen: list[pb.StepRequest] = []

    def _cut(self, request: Any) -> bool:
        """A "cut" or "unsent" Step carrying the prompt never reaches the server
        (``times`` attempts): "unsent" as gRPC says when no connection could be made, so
        the client knows nothing was applied."""
        if self.fault not in ("cut", "unsent") or not _carries_prompt(request):
            return False
        if len(self.seen) >= self.times:
            return False  # (delivered: _draw records it)
        self.seen.append(request)
        self.counts["cut"] = self.counts.get("cut", 0) + 1
        return True

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        if self._cut(request):
            if self.fault == "unsent":
                raise LocalRpcError(
                    grpc.StatusCode.UNAVAILABLE, "failed to connect to all addresses (injected)"
                )
            raise LocalRpcError(grpc.StatusCode.UNAVAILABLE, "injected: network partition")
        return super().intercept_unary_unary(continuation, details, request)

    def draw_message(self, request: Any) -> tuple[str, Any]:
        if self._cut(request):
            return "cut", None
        return super().draw_message(request)

    def _draw(self, item: Any, held: list[Any]) -> tuple[str, Any]:
        request = item[1] if isinstance(item, tuple) else item
        self.counts["calls"] += 1
        if _carries_prompt(request):
            self.seen.append(request)
            if len(self.seen) <= self.times:
                if self.fault == "reorder":
                    held.append(item)
                    return "none", None
                return self.fault, None
            return "none", None
        if held:
            self.counts["reordered"] += 1
            return "none", held.pop(0)
        return "none", None


def _request(rid: str, tokens: list[int]) -> Any:
    r: Any = Req(rid, _View(list(tokens)))  # type: ignore[arg-type]
    r.block_hashes = []
    r.num_prompt_tokens = len(tokens)
    _hash(r)
    return r


def _hash(r: Any) -> None:
    every = BlockHasher("sha256_cbor", 4, NONE).extend(list(r.all_token_ids._x))
    r.block_hashes.extend(every[len(r.block_hashes) :])


def prompt_computed_77_sampled(m: Any) -> Any:
    """Request "r" of ``m``: PROMPT allocated (its prefix looked up first) and computed,
    then 77 sampled (appended and hashed, not yet sent)."""
    r = _request("r", PROMPT)
    hit, n = m.get_computed_blocks(r)
    assert m.allocate_slots(r, 10, n, hit) is not None
    r.num_computed_tokens = 10
    r.all_token_ids._x.append(77)
    _hash(r)
    return r


def _session(m: Any, again: bool = False) -> tuple[tuple[list[int], ...], int]:
    """Session "r": its prompt computed, 77 sampled; cut (77 discarded, CHUNK appended,
    the whole session its prompt), the chunk computed, 88 sampled and decoded. Returns
    the request's blocks (after one more decode step) and a continuation's hit (tokens)."""
    r = prompt_computed_77_sampled(m)
    m.take_events()
    # vLLM 0.33's Scheduler._update_request_as_session, in place
    keep = len(r.all_token_ids) - 1
    del r.all_token_ids._x[keep:]
    del r.block_hashes[keep // 4 :]
    r.all_token_ids._x.extend(CHUNK)
    r.num_prompt_tokens = len(r.all_token_ids)
    _hash(r)
    try:
        assert m.allocate_slots(r, 9) is not None  # the Step the faults meet
    except KVCoordError:
        if not again:
            raise
        assert m.allocate_slots(r, 9) is not None  # the scheduler's next try
    r.num_computed_tokens = 19
    r.all_token_ids._x.append(88)
    _hash(r)
    m.take_events()
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 20
    m.take_events()
    q = _request("q", [*PROMPT, *CHUNK, 88, *[98] * 7])
    _, hit_tokens = m.get_computed_blocks(q)
    m.take_events()
    m.flush()
    # one more decode step: a Step after the one the faults met (a late copy comes first)
    r.all_token_ids._x.append(89)
    _hash(r)
    assert m.allocate_slots(r, 1) is not None
    r.num_computed_tokens = 21
    m.take_events()
    m.flush()
    return m.get_block_ids("r"), hit_tokens


def _score(c: KVCoordClient) -> int:
    tokens = [*PROMPT, *CHUNK, 88, *[98] * 7]
    hashes = BlockHasher("sha256_cbor", 4, NONE).extend(tokens)
    prompt = pb.HashedPrompt(
        hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes, profile="vllm-0.33"
    )
    return c.score_pools(len(tokens), [prompt]).scores[0].hit_tokens


def _manager(mode: str, c: KVCoordClient, pool: str) -> Any:
    c.create_pool(pool, _config())
    if mode == "waiting":
        return Remote033KVCacheManager(c, pool, hash_seed="0", renew=False, exclusive=True)
    return Predicting033KVCacheManager(c, pool, hash_seed="0", renew=False)


@pytest.mark.parametrize("fault", ["drop", "duplicate", "reorder"])
@pytest.mark.parametrize("mode", ["predicted", "waiting"])
def test_a_grown_prompts_step_faulted_is_applied_once_and_mirror_and_server_agree(
    server: InProcessServer, mode: str, fault: str
) -> None:
    faults = FaultPromptStep(fault)
    with (
        KVCoordClient(server.address, timeout=10) as clean_client,
        KVCoordClient(server.address, timeout=10, interceptors=[faults]) as c,
    ):
        ref = _manager(mode, clean_client, "clean")
        want_blocks, want_hit = _session(ref)
        assert want_hit == 16, want_hit  # the window tail at the grown prompt's end
        m = _manager(mode, c, "faulted")
        blocks, hit = _session(m)
        assert faults.seen, "no Step carried the grown prompt"
        if fault == "drop":  # retried under its key, the prompt length in it again
            assert len(faults.seen) == 2 and faults.seen[0] == faults.seen[1], faults.seen
            assert faults.seen[0].idempotency_key
        kind = {"drop": "dropped", "duplicate": "duplicated", "reorder": "reordered"}[fault]
        assert faults.counts[kind] == 1, faults.counts
        assert (blocks, hit) == (want_blocks, want_hit)
        engine = server.running.servicer.registry.pools["faulted"].engine  # type: ignore[union-attr]
        clean = server.running.servicer.registry.pools["clean"].engine  # type: ignore[union-attr]
        assert comparable(export_state(engine)) == comparable(export_state(clean))
        if mode == "predicted":
            assert comparable(export_state(m.mirror.engine)) == comparable(export_state(engine))
        assert _score(c) == 16
        m.close()
        ref.close()


@pytest.mark.parametrize("mode", ["predicted", "waiting"])
def test_a_grown_prompts_step_that_never_arrives_is_a_loud_loss_and_mirror_and_server_agree(
    server: InProcessServer, mode: str
) -> None:
    """Every attempt of that Step cut off before the server: whether it was applied is
    unknown to the client, so the session reports the request lost (typed), never
    guesses the server's prompt length; the predicting client's mirror, reloaded, is
    the server's pool."""
    faults = FaultPromptStep("cut", times=100)
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, max_attempts=3)
    with KVCoordClient(server.address, timeout=10, interceptors=[faults], retry=retry) as c:
        m = _manager(mode, c, "faulted")
        with pytest.raises(RequestsLostError) as lost:
            _session(m)
        assert "r" in lost.value.request_ids, lost.value
        assert faults.counts["cut"] == 3 and len(faults.seen) == 3, faults.counts
        m.flush()
        if mode == "predicted":
            engine = server.running.servicer.registry.pools["faulted"].engine  # type: ignore[union-attr]
            assert comparable(export_state(m.mirror.engine)) == comparable(export_state(engine))
        m.close()


@pytest.mark.parametrize("mode", ["predicted", "waiting"])
def test_a_grown_prompts_step_never_sent_is_sent_again_with_the_prompt(
    server: InProcessServer, mode: str
) -> None:
    """Every attempt of that Step (unary Steps) fails before a connection is made:
    nothing applied, and the client knows it (the tracker's rollback path, over gRPC).
    The waiting manager's call fails, its request back where the server holds it
    (prompt length included), and the scheduler's next try sends the prompt length
    again: the pool ends as a fault-free run's (a rollback that kept the unsent length
    as sent would leave the server at 10: an 8-token hit). The predicting client ran
    ahead of that Step: its requests are reported lost (typed), its mirror reloaded
    equal to the server's pool."""
    faults = FaultPromptStep("unsent", times=3)
    retry = RetryPolicy(initial_backoff=0.01, max_backoff=0.02, max_attempts=3)
    with (
        KVCoordClient(server.address, timeout=10) as clean_client,
        KVCoordClient(server.address, timeout=10, interceptors=[faults], retry=retry, step_stream=False) as c,
    ):
        ref = _manager(mode, clean_client, "clean")
        want = _session(ref)
        m = _manager(mode, c, "faulted")
        if mode == "waiting":
            assert _session(m, again=True) == want
            # the next try is a new call, the prompt length in it again (seen: those carrying it)
            assert len(faults.seen) == 4 and faults.seen[3].idempotency_key != faults.seen[0].idempotency_key
            pools = server.running.servicer.registry.pools  # type: ignore[union-attr]
            assert comparable(export_state(pools["faulted"].engine)) == comparable(
                export_state(pools["clean"].engine)
            )
        else:
            with pytest.raises(RequestsLostError) as lost:
                _session(m, again=True)
            assert "r" in lost.value.request_ids, lost.value
            m.flush()
            engine = server.running.servicer.registry.pools["faulted"].engine  # type: ignore[union-attr]
            assert comparable(export_state(m.mirror.engine)) == comparable(export_state(engine))
        assert faults.counts["cut"] == 3, faults.counts
        m.close()
        ref.close()
