"""vLLM's predicted manager (``KVCoordKVCacheManager`` over a
:class:`PredictingKVCacheManager`) on its fast paths against its general ones (issue 21
item 6): a running request's ``allocate_slots`` taken straight to the engine
(``allocate_running``) and events converted to vLLM's types as each call makes them
give, call for call, what the general paths give (the full sync and allocation;
events converted one by one at take time), and the server confirms both."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.predicting import NOT_TAKEN
from kvcoord.client.vllm_manager import KVCoordKVCacheManager
from kvcoord.client.vllm_types import _convert_event, _event_types, _int_hashes
from kvcoord.v1 import allocator_pb2 as pb
from support import NONE, Req


@dataclasses.dataclass
class _Req(Req):
    """What vLLM's Request gives the manager (its block hashes kept as it extends)."""

    hasher: BlockHasher = dataclasses.field(default_factory=lambda: BlockHasher("sha256_cbor", 4, NONE))

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def block_hashes(self) -> list[bytes]:
        return self.hasher.block_hashes

    def append(self, token: int) -> None:
        self.all_token_ids.append(token)
        self.hasher.extend([token])


def _request(rid: str, tokens: list[int]) -> _Req:
    r = _Req(rid, list(tokens))
    r.hasher.extend(tokens)
    return r


_GROUPS = {
    "full": [pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    "full-sliding": [
        pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4)),
        pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8)),
    ],
}


def _side(client: KVCoordClient, name: str, layout: str, fast: bool) -> KVCoordKVCacheManager:
    client.create_pool(
        name,
        pb.PoolConfig(num_blocks=48, hash_block_size=4, enable_caching=True, hash_algo="sha256_cbor",
                      hash_seed="0", enable_kv_cache_events=True, groups=_GROUPS[layout]),
    )  # fmt: skip
    remote = PredictingKVCacheManager(client, name, hash_seed="0", renew=False)
    m = KVCoordKVCacheManager(remote)
    if not fast:  # the general paths: every allocation synced and allocated in full, events as the engine's
        m._allocate_running = None
        remote.allocate_running = lambda *_: NOT_TAKEN  # type: ignore[method-assign]
        remote.event_converter = remote.mirror.convert = None
    return m


def _blocks(blocks: Any) -> Any:
    if blocks is None:
        return None
    return [[(b.block_id, b.block_hash) for b in group] for group in blocks.blocks]


def _events(m: KVCoordKVCacheManager) -> list[Any]:
    remote = m.remote
    assert isinstance(remote, PredictingKVCacheManager)
    if remote.event_converter is None:  # each event by the general conversion
        return [_convert_event(e, *_event_types(), _int_hashes(), False) for e in remote.take_engine_events()]
    return m.take_events()


@pytest.mark.parametrize("layout", sorted(_GROUPS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fast_paths_answer_as_the_general_paths(client: KVCoordClient, layout: str, seed: int) -> None:
    """A random scheduler workload (shared prefixes, hits, decodes with and without
    look-ahead slots, chunks, refusals and preemptions, frees) on two pools: every
    answer (block ids and hashes, tables, usage, events, statistics) is the same, and
    the server confirms every Step of both."""
    fast, general = _side(client, "fast", layout, True), _side(client, "general", layout, False)
    assert fast.remote.event_converter is not None
    taken = []
    running_call = fast._allocate_running
    assert running_call is not None

    def counted(*args: Any) -> Any:
        out = running_call(*args)
        taken.append(out is not NOT_TAKEN)
        return out

    fast._allocate_running = counted
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((4, 8, 12)))] for _ in range(3)]
    running: dict[str, tuple[_Req, _Req]] = {}
    waiting: list[str] = []
    prompts: dict[str, list[int]] = {}
    nid = 0

    def both(call: str, pair: tuple[_Req, _Req], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        return getattr(fast, call)(pair[0], *args, **kwargs), getattr(general, call)(pair[1], *args, **kwargs)

    for _step in range(60):
        while len(running) + len(waiting) < 8:
            rid = f"r{nid}"
            nid += 1
            prompts[rid] = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randint(1, 14))]
            waiting.append(rid)
        for rid, (a, b) in list(running.items()):
            if rng.random() < 0.1:  # finished
                both("free", (a, b))
                del running[rid]
                continue
            n = 1 if rng.random() < 0.8 else rng.randint(2, 5)
            look = rng.choice((0, 0, 2))
            got_a, got_b = both("allocate_slots", (a, b), n, num_lookahead_tokens=look)
            assert _blocks(got_a) == _blocks(got_b), rid
            if got_a is None:  # preempted, as vLLM's scheduler does
                both("free", (a, b))
                del running[rid]
                waiting.append(rid)
                continue
            for r in (a, b):
                r.num_computed_tokens += n
            token = rng.randrange(1000)
            for r in (a, b):
                while r.num_tokens < r.num_computed_tokens + 1:
                    r.append(token)
        for rid in list(waiting[:3]):
            a, b = _request(rid, prompts[rid]), _request(rid, prompts[rid])
            (hit_a, n_a), (hit_b, n_b) = both("get_computed_blocks", (a, b))
            assert (_blocks(hit_a), n_a) == (_blocks(hit_b), n_b)
            new_a = fast.allocate_slots(a, a.num_tokens - n_a, n_a, hit_a)
            new_b = general.allocate_slots(b, b.num_tokens - n_b, n_b, hit_b)
            assert _blocks(new_a) == _blocks(new_b), rid
            if new_a is None:
                continue
            waiting.remove(rid)
            for r in (a, b):
                r.num_computed_tokens = r.num_tokens
                r.append(7)
            running[rid] = (a, b)
        for rid in running:
            assert _blocks(fast.get_blocks(rid)) == _blocks(general.get_blocks(rid))
        assert fast.usage == general.usage
        assert _events(fast) == _events(general)
        assert fast.make_prefix_cache_stats() == general.make_prefix_cache_stats()
    assert sum(taken) > 100  # (the fast path was taken)
    for m in (fast, general):
        m.remote.flush()  # the server confirmed every Step (a difference raises)
        m.close()
