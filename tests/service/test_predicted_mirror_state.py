"""A predicted session's mirror holds exactly the server's pool, whatever is lost on
the way, and no prefix hit it answers names a block whose KV the worker did not write.

A small scheduler drives :class:`PredictingKVCacheManager` (admissions with prefix
hits, chunked prefills, speculative decode steps with rejected drafts, preemptions,
whole schedule() calls undone with ``uncomputed_from``, evictions, prefix-cache resets,
vLLM 0.33's copy-on-write copies) while one Step in twelve is lost, half of them after
the server applied them. Every loss is one of those (no answer differs from the
mirror's), and after every flush the mirror's whole engine state (free queue
order, reference counts, cached hashes, request records, managers' per-request state,
counters) equals the server's, and a simulated KV memory (what the worker wrote into
each block slot, following the tables the mirror handed out, the run-ahead steps of a
lost session included) holds each hit's own prefix at every position the hit covers."""

from __future__ import annotations

import random
from typing import Any

import grpc
import pytest
from kvcoord.client import KVCoordClient, PredictingKVCacheManager, RequestsLostError
from kvcoord.client.errors import OutcomeUnknownError
from kvcoord.client.hashing import BlockHasher
from kvcoord.client.sender import StepSender
from kvcoord.client.vllm033 import Predicting033KVCacheManager
from kvcoord.engine.state import export_state
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from support import NONE, Req
from unit.test_client_fast_paths import _View  # vLLM's ConstantList

NUM_BLOCKS = 48

_LAYOUTS = {
    "full": [pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
    "full+swa": [
        pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4)),
        pb.KVCacheGroupSpec(sliding_window=pb.SlidingWindowSpec(block_size=4, sliding_window=8)),
    ],
    "full+mamba-align": [
        pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=8)),
        pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=8, mamba_cache_mode="align")),
    ],
}


def _config(layout: str, profile: str, events: bool) -> pb.PoolConfig:
    return pb.PoolConfig(
        num_blocks=NUM_BLOCKS, groups=_LAYOUTS[layout], hash_block_size=4, enable_caching=True,
        hash_algo="sha256_cbor", hash_seed="0", enable_kv_cache_events=events, max_model_len=512, profile=profile,
    )  # fmt: skip


def comparable(state: dict[str, Any]) -> dict[str, Any]:
    """An engine state with what only says how it was built taken out: blocks the mirror
    made at once and the server as first taken (one free order either way), the order
    of a set, and the statistics and events each side hands out on its own."""
    own = ("prefix_cache_stats", "lookup_counters", "pending_events")
    out = {k: v for k, v in state.items() if k not in own}
    nb, made = state["num_blocks"], state["created"]
    out["free_order"] = [*out.pop("free_front"), *range(made, nb), *out.pop("free_used")]
    out["ref_cnt"] = [*state["ref_cnt"], *[0] * (nb - made)]
    del out["created"]
    out["managers"] = [
        {**m, "mamba_cached_this_step": sorted(map(tuple, m["mamba_cached_this_step"]))}
        if "mamba_cached_this_step" in m
        else m
        for m in state["managers"]
    ]
    return out


class KVMemory:
    """What the worker wrote into each block slot of group 0 (full attention): a key of
    the whole token prefix up to that position (attention at a position reads them all)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, dict[int, tuple[int, ...]]] = {}

    def write(self, table: list[int], tokens: list[int], start: int, end: int) -> None:
        bs = self.block_size
        for p in range(start, end):
            self.slots.setdefault(table[p // bs], {})[p % bs] = tuple(tokens[: p + 1])

    def copy(self, src: int, dst: int) -> None:
        self.slots[dst] = dict(self.slots.get(src, {}))

    def wrong(self, hit: list[int], tokens: list[int], num_tokens: int) -> int | None:
        """The first position of the hit whose slot holds another prefix's KV."""
        bs = self.block_size
        for p in range(num_tokens):
            if self.slots.get(hit[p // bs], {}).get(p % bs) != tuple(tokens[: p + 1]):
                return p
        return None


def _request(rid: str, tokens: list[int]) -> Any:
    """A request as vLLM's gives it: its tokens a read-only view of its list, its block
    hashes one list extended in place (so running steps take the decode path)."""
    r: Any = Req(rid, _View(list(tokens)))  # type: ignore[arg-type]
    r.hasher = BlockHasher("sha256_cbor", 4, NONE)
    r.hasher.extend(tokens)
    r.block_hashes = r.hasher.block_hashes
    return r


def _grow(r: Any, tokens: list[int]) -> None:
    r.all_token_ids._x.extend(tokens)
    r.hasher.extend(tokens)


def drive(m: PredictingKVCacheManager, server: InProcessServer, pool: str, seed: int, steps: int,
          speculative: bool) -> dict[str, int]:  # fmt: skip
    """The workload (see the module docstring); asserts as it goes. Returns its counts."""
    rnd = random.Random(seed)
    is_033 = isinstance(m, Predicting033KVCacheManager)
    kv = KVMemory(m.config.groups[0].full.block_size)
    prefixes = [[rnd.randrange(30) for _ in range(n)] for n in (0, 5, 12, 21)]
    waiting: list[Any] = []
    running: list[Any] = []
    counts = dict.fromkeys(("lost", "hits", "undone", "preempted", "checks"), 0)
    # the step's scheduled requests (with their token counts) and hits; a loss met
    # mid-step takes its requests out, as vLLM's scheduler undoes a schedule() a loss
    # cut short (what it scheduled before is the lost session's) and schedules again:
    # a lost request admitted again the same step is scheduled once, from its new hit
    scheduled: list[tuple[Any, int]] = []
    hits: list[tuple[Any, list[int], int]] = []
    # the sender thread may end a Step before any call of the next scheduler step (the
    # earlier, the more often under load): waited for before a few calls here, so a
    # lost Step is met mid-step in every run, not only on a loaded machine
    sender_done = random.Random(seed + 1)

    def lose(err: RequestsLostError) -> None:
        # only a Step this test lost: an answer that differed from the mirror's
        # (PREDICTION_FAILED) is loud, but a defect all the same
        assert isinstance(err.cause, OutcomeUnknownError) and "test:" in err.cause.message, err
        counts["lost"] += len(err.request_ids)
        for r in [r for r in running if r.request_id in err.request_ids]:
            running.remove(r)
            waiting.insert(0, r)
        for r in waiting:
            if r.request_id in err.request_ids:
                r.num_computed_tokens = 0
        scheduled[:] = [(r, n) for r, n in scheduled if r.request_id not in err.request_ids]
        hits[:] = [h for h in hits if h[0].request_id not in err.request_ids]

    def call(f: Any, *args: Any) -> tuple[Any, bool]:
        if sender_done.random() < 0.25:
            m.sender.settle()
        try:
            return f(*args), True
        except RequestsLostError as err:
            lose(err)
            return None, False

    for step in range(steps):
        if is_033:
            call(m.new_step_starts)  # type: ignore[attr-defined]
        if rnd.random() < 0.5:
            tokens = rnd.choice(prefixes) + [rnd.randrange(30) for _ in range(rnd.randint(1, 20))]
            waiting.append(_request(f"s{seed}-r{step}", tokens))
        scheduled.clear()
        hits.clear()
        for r in list(running):
            if r not in running:
                continue
            decoding = r.num_computed_tokens + 1 >= len(r.all_token_ids)
            n = min(len(r.all_token_ids) + (rnd.randint(0, 2) if speculative and decoding else 0)
                    - r.num_computed_tokens, 16)  # fmt: skip
            new, ok = call(m.allocate_slots, r, n, 0, None, 2 if speculative else 0)
            while ok and new is None:  # preempt from the end, as vLLM
                victim = running.pop()
                call(m.free, victim)
                victim.num_computed_tokens = 0
                waiting.insert(0, victim)
                counts["preempted"] += 1
                if victim is r:
                    break
                new, ok = call(m.allocate_slots, r, n, 0, None, 2 if speculative else 0)
            if ok and new is not None and r in running:
                scheduled.append((r, n))
        for r in list(waiting)[:3]:
            if len(running) >= 6:
                break
            found, ok = call(m.get_computed_blocks, r)
            if not ok:
                continue
            hit, hit_tokens = found
            n = min(len(r.all_token_ids) - hit_tokens, rnd.choice([4, 8, 32]))
            new, ok = call(m.allocate_slots, r, n, hit_tokens, hit)
            if not ok:
                continue
            if new is None:
                break
            waiting.remove(r)
            running.append(r)
            r.num_computed_tokens = hit_tokens
            scheduled.append((r, n))
            hits.append((r, list(hit.block_ids[0]), hit_tokens))
        # the model runs the step: vLLM 0.33's copies first, then every scheduled token
        # (a cut-short call undone instead: nothing written, its allocations freed with
        # the tokens whose KV existed before it)
        retained: list[int] = []
        if is_033:
            copies, ok = call(m.take_kv_cache_block_copies)  # type: ignore[attr-defined]
            if ok:
                for src, dst in copies[0]:
                    kv.copy(src, dst)
                retained = copies[1]
            call(m.take_new_block_ids)  # type: ignore[attr-defined]
        if rnd.random() < 0.05:
            for r, _ in scheduled:
                if r in running:
                    call(m.free, r, r.num_computed_tokens)
                    running.remove(r)
                    r.num_computed_tokens = 0
                    waiting.insert(0, r)
            counts["undone"] += 1
            scheduled.clear()
            hits.clear()
        once = [r.request_id for r, _ in scheduled]
        assert len(once) == len(set(once)), f"step {step}: a request scheduled twice: {once}"
        drafts: dict[str, list[int]] = {}
        for r, n in scheduled:
            if r in running:
                c = r.num_computed_tokens
                dr = drafts[r.request_id] = [rnd.randrange(30) for _ in range(c + n - len(r.all_token_ids))]
                kv.write(m.get_block_ids(r.request_id)[0], [*r.all_token_ids, *dr], c, c + n)
        for r, hit_ids, hit_tokens in hits:  # (read in the same forward, after its layer's writes)
            if r in running:
                wrong = kv.wrong(hit_ids, r.all_token_ids, hit_tokens)
                assert wrong is None, f"step {step}: {r.request_id}'s hit {hit_ids} holds other KV at {wrong}"
                counts["hits"] += hit_tokens > 0
        for r, n in scheduled:
            if r not in running:
                continue
            r.num_computed_tokens += n
            if r.num_computed_tokens >= len(r.all_token_ids):
                dr = drafts[r.request_id]
                accepted = rnd.randint(0, len(dr))
                r.num_computed_tokens -= len(dr) - accepted
                _grow(r, dr[:accepted] + [rnd.randrange(30)])
            if len(r.all_token_ids) > 90 or rnd.random() < 0.03:
                call(m.free, r)
                running.remove(r)
        if retained:
            call(m.release_retained_blocks, retained)  # type: ignore[attr-defined]
        for r in list(running):
            call(m.remove_skipped_blocks, r.request_id, r.num_computed_tokens)
        if rnd.random() < 0.03:
            call(m.evict_blocks, rnd.sample(range(NUM_BLOCKS), 3))
        if rnd.random() < 0.01:
            call(m.reset_prefix_cache)
        call(m.take_events)
        if step % 3 == 2:
            flushed = any(call(m.flush)[1] for _ in range(20))  # (a flush that met a loss goes again)
            assert flushed, f"step {step}: every flush met a loss"
            engine = server.running.servicer.registry.pools[pool].engine  # type: ignore[union-attr]
            mine, theirs = comparable(export_state(m.mirror.engine)), comparable(export_state(engine))
            assert mine == theirs, f"step {step}"
            counts["checks"] += 1
    return counts


@pytest.mark.parametrize(
    ("layout", "profile", "events"),
    [("full+swa", "", False), ("full+mamba-align", "vllm-0.33", True)],
    ids=["swa-016", "mamba-033-events"],
)
def test_the_mirror_is_the_servers_pool_through_lost_steps(
    server: InProcessServer, client: KVCoordClient, layout: str, profile: str, events: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """The module's workload, two seeds per layout: full + sliding window on vllm-0.16
    without KV events (vLLM's default: the Steps' answers then say nothing of cached
    hashes, so a difference there shows only at a later hit, or here), and full + mamba
    "align" on vllm-0.33 with events and copy-on-write copies."""
    decodes: list[int] = []
    add_decode = StepSender.add_decode

    def counted(self: StepSender, *args: Any) -> None:
        decodes.append(1)
        add_decode(self, *args)

    monkeypatch.setattr(StepSender, "add_decode", counted)
    faults = random.Random(5)
    send = client.send_step

    def lossy(request: pb.StepRequest) -> pb.StepResponse:
        x = faults.random()
        if x < 1 / 24:
            send(request)
            raise OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "test: the answer was lost (applied)")
        if x < 1 / 12:
            raise OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "test: the Step was lost (not applied)")
        return send(request)

    client.send_step = lossy  # type: ignore[method-assign]
    total = dict.fromkeys(("lost", "hits", "undone", "preempted", "checks"), 0)
    for seed in range(2):
        pool = f"mirror-{layout.replace('+', '-')}-{seed}"
        client.create_pool(pool, _config(layout, profile, events))
        kind = Predicting033KVCacheManager if profile else PredictingKVCacheManager
        m = kind(client, pool, hash_seed="0", renew=False, max_backlog=4, reset_at_attach=True)
        counts = drive(m, server, pool, seed, 240, speculative="mamba" not in layout)
        m.close()
        for k, v in counts.items():
            total[k] += v
    assert total["checks"] == 160
    assert total["lost"] > 20 and total["hits"] > 10 and total["undone"] > 5 and total["preempted"] > 0, total
    if "mamba" not in layout:  # (a mamba group's steps take the general path)
        assert len(decodes) > 100  # decode steps on the decode path


@pytest.mark.parametrize("sender_first", [False, True], ids=["sent-after", "sent-before"])
@pytest.mark.parametrize("reset_at_attach", [True, False], ids=["reset-at-attach", "default"])
def test_blocks_a_lost_step_handed_out_are_no_hit_after_the_session_starts_again(
    client: KVCoordClient, reset_at_attach: bool, sender_first: bool
) -> None:
    """The run-ahead case itself: a prompt's blocks are cached and free; the next
    scheduler step gives them to another request (the mirror evicts them) and the worker
    writes that request's KV there, but its Step never reaches the server, which still
    caches the prompt in them. The loss is reported, the session starts again (the pool's
    prefix cache reset with it), and the prompt asked again is no hit on those blocks.
    Whatever ``reset_at_attach`` says of the first Attach: the re-attach after a loss
    resets always (before, the default handed the prompt a 16-token hit on blocks holding
    the other request's KV, no error)."""
    client.create_pool("run-ahead", _config("full", "", False))
    lose_next = [False]
    send = client.send_step

    def lossy(request: pb.StepRequest) -> pb.StepResponse:
        if lose_next[0]:
            lose_next[0] = False
            raise OutcomeUnknownError(grpc.StatusCode.UNAVAILABLE, "test: the Step was lost (not applied)")
        return send(request)

    client.send_step = lossy  # type: ignore[method-assign]
    m = PredictingKVCacheManager(
        client, "run-ahead", hash_seed="0", renew=False, reset_at_attach=reset_at_attach
    )
    kv = KVMemory(4)
    usable = m.mirror.num_free_blocks

    def run(rid: str, tokens: list[int]) -> list[int]:
        r = _request(rid, tokens)
        hit, hit_tokens = m.get_computed_blocks(r)
        assert hit_tokens == 0
        assert m.allocate_slots(r, len(tokens)) is not None
        table = m.get_block_ids(rid)[0]
        kv.write(table, tokens, 0, len(tokens))
        return table

    prompt = list(range(100, 117))  # four full blocks
    cached = run("a", prompt)[:4]
    m.free("a")
    m.flush()  # the server caches the prompt's blocks, all free
    lose_next[0] = True
    taken = run("b", list(range(200, 200 + 4 * usable)))  # every block: the prompt's too
    assert set(cached) <= set(taken)
    # the step's Step goes at take_events and is lost: reported once, by take_events
    # when the sender thread failed it first (as under load), else by the flush
    if sender_first:  # the sender thread fails the Step before take_events looks
        cut = m.sender.cut

        def cut_and_wait(*args: Any) -> bool:
            sent = cut(*args)
            m.sender.settle()
            return sent

        m.sender.cut = cut_and_wait  # type: ignore[method-assign,assignment]
    reports = []
    for end_of_step in (m.take_events, m.flush):
        try:
            end_of_step()
        except RequestsLostError as err:
            reports.append((end_of_step.__name__, err.request_ids))
    assert [ids for _, ids in reports] == [["b"]], reports
    assert not sender_first or reports[0][0] == "take_events", reports
    again = _request("c", prompt + [1, 2, 3])
    hit, hit_tokens = m.get_computed_blocks(again)
    assert kv.wrong(list(hit.block_ids[0]), again.all_token_ids, hit_tokens) is None, (
        hit.block_ids,
        hit_tokens,
    )
    m.close()
