"""Helpers shared by the tests: a pool driver that hashes like a vLLM worker."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import threading
import urllib.request
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

from kvcoord.client import NO_RETRY, KVCoordClient, KVCoordError
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.engine import (
    AttentionSpec,
    CacheHit,
    FullAttentionSpec,
    KVCacheConfig,
    KVCachePool,
)
from kvcoord.service.testing import InProcessServer
from kvcoord.v1 import allocator_pb2 as pb
from prometheus_client.parser import text_string_to_metric_families
from service.helpers import allocate


@dataclasses.dataclass
class Req:
    """What vLLM's Request exposes to the manager: id, tokens, computed count, preemptions."""

    request_id: str
    all_token_ids: list[int]
    num_computed_tokens: int = 0
    num_preemptions: int = 0


ALGO = "sha256_cbor"
NONE = none_hash(ALGO, "0")


def wire_pool_config(num_blocks: int, events: bool = False) -> pb.PoolConfig:
    """A small pool on the wire: full attention, 4-token blocks, caching on."""
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
        hash_block_size=4,
        enable_caching=True,
        enable_kv_cache_events=events,
        hash_algo=ALGO,
        hash_seed="0",
    )


def hashed_req(rid: str, tokens: list[int]) -> Req:
    """A :class:`Req` of a copy of ``tokens`` with their block hashes (as vLLM's Request
    carries them) for :func:`wire_pool_config`'s pools."""
    r = Req(rid, list(tokens))
    r.block_hashes = BlockHasher(ALGO, 4, NONE).extend(tokens)  # type: ignore[attr-defined]
    return r


def admit_prompt(m: Any, r: Any) -> list[int]:
    """``r``'s whole prompt admitted by manager ``m`` (its hit, then the rest), computed:
    group 0's block ids."""
    hit, hit_tokens = m.get_computed_blocks(r)
    new = m.allocate_slots(r, len(r.all_token_ids) - hit_tokens, hit_tokens, hit)
    assert new is not None
    r.num_computed_tokens = len(r.all_token_ids)
    return list(hit.block_ids[0]) + list(new.block_ids[0])


def lapse_predicted_session(
    c: KVCoordClient, server: InProcessServer, clock: Any, *, reap: bool = True
) -> tuple[Any, str]:
    """A predicted session on a new 32-block pool "p" whose lease (5 s) ran out on the
    server (``clock`` a ManualClock moved 30 s) after request "a" was admitted and
    flushed, and reaped there if ``reap``; then "b" admitted (answered: the client still
    vouches for its lease) and the step's events taken: the next flush meets the loss.
    The manager, and the id of the session it lost."""
    from kvcoord.client import PredictingKVCacheManager

    c.create_pool("p", wire_pool_config(32))
    m = PredictingKVCacheManager(c, "p", hash_seed="0", renew=False, lease_seconds=5)
    lost = m.keeper.session_id
    admit_prompt(m, hashed_req("a", list(range(9))))
    m.flush()
    clock.advance(30)
    if reap:
        assert server.call(server.running.servicer.reap_expired_sessions) == 1  # type: ignore[union-attr]
    admit_prompt(m, hashed_req("b", list(range(40, 50))))
    m.take_events()
    return m, lost


def wire_mamba_pool_033(
    num_blocks: int,
    attention_block: int,
    mamba_block: int,
    mode: str,
    hash_block_size: int,
    max_model_len: int,
) -> pb.PoolConfig:
    """A vllm-0.33 pool on the wire: full attention and a mamba group in ``mode``,
    caching on exactly when the mode is "align" (as vLLM 0.33 runs them)."""
    return pb.PoolConfig(
        num_blocks=num_blocks,
        groups=[
            pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=attention_block)),
            pb.KVCacheGroupSpec(mamba=pb.MambaSpec(block_size=mamba_block, mamba_cache_mode=mode)),
        ],
        hash_block_size=hash_block_size,
        enable_caching=mode == "align",
        hash_algo=ALGO,
        hash_seed="0",
        profile="vllm-0.33",
        max_model_len=max_model_len,
    )


class Driver:
    """A pool plus one block hasher per request, as a scheduler would hold them."""

    def __init__(
        self,
        groups: Sequence[AttentionSpec] = (FullAttentionSpec(4),),
        num_blocks: int = 10,
        hash_block_size: int = 4,
        **kw: object,
    ) -> None:
        self.config = KVCacheConfig(
            num_blocks=num_blocks,
            groups=tuple(groups),
            hash_block_size=hash_block_size,
            **kw,  # type: ignore[arg-type]
        )
        self.pool = KVCachePool(self.config)
        self.hashers: dict[str, BlockHasher] = {}

    def add(self, rid: str, tokens: Sequence[int], **kw: object) -> list[bytes]:
        h = BlockHasher(ALGO, self.config.hash_block_size, NONE)
        hashes = h.extend(tokens)
        self.hashers[rid] = h
        self.pool.add_request(rid, list(tokens), hashes, **kw)  # type: ignore[arg-type]
        return hashes

    def append(self, rid: str, tokens: Sequence[int], num_computed_tokens: int) -> list[bytes]:
        new = self.hashers[rid].extend(tokens)
        self.pool.update_request(
            rid,
            num_computed_tokens=num_computed_tokens,
            append_token_ids=list(tokens),
            append_block_hashes=new,
        )
        return new

    def hit(self, rid: str) -> CacheHit:
        return self.pool.get_computed_blocks(rid)

    def admit(self, rid: str, tokens: Sequence[int], **kw: object) -> tuple[CacheHit, object]:
        """Add, look up, and allocate the whole prompt minus the hit (a fresh request)."""
        self.add(rid, tokens)
        hit = self.hit(rid)
        new = self.pool.allocate_slots(rid, len(tokens) - hit.num_tokens, hit.num_tokens, hit, **kw)  # type: ignore[arg-type]
        return hit, new

    def ids(self, rid: str) -> tuple[tuple[int, ...], ...]:
        return self.pool.get_block_ids(rid)


def toks(a: int, b: int) -> list[int]:
    """Tokens a..b inclusive."""
    return list(range(a, b + 1))


def pool_toml(
    name: str, num_blocks: int, *, caching: bool = True, sliding_window: int = 0, events: bool = True,
    max_model_len: int | None = 256, hash_algo: str = "sha256_cbor", hash_seed: str = "0", extra: str = "",
) -> str:  # fmt: skip
    """One pool of a server's config file, blocks of 4 tokens: a full-attention group
    (and a sliding-window one of ``sliding_window`` tokens); with ``caching``, prefix
    caching on ``hash_algo`` hashes of ``hash_seed``, with KV events if ``events`` and
    ``max_model_len`` unless ``None``. ``extra``: more lines of the pool's table."""
    text = f"""
[[pools]]
name = "{name}"
num_blocks = {num_blocks}
hash_block_size = 4
"""
    if caching:
        text += f"""hash_algo = "{hash_algo}"
hash_seed = "{hash_seed}"
enable_caching = true
"""
        text += "enable_kv_cache_events = true\n" if events else ""
        text += "" if max_model_len is None else f"max_model_len = {max_model_len}\n"
    text += extra
    text += """
[[pools.groups]]
type = "full"
block_size = 4
"""
    if sliding_window:
        text += f"""
[[pools.groups]]
type = "sliding_window"
block_size = 4
sliding_window = {sliding_window}
"""
    return text


#: Pool "p" of the service and reliability suites: full4 + sliding4 (window 8), 64 blocks.
POOL_TOML = pool_toml("p", 64, sliding_window=8)


def scrape_metrics(server: InProcessServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a real /metrics scrape over HTTP, as Prometheus reads it:
    (name, sorted labels) -> value."""
    assert server.metrics is not None
    address = server.metrics.start_http("127.0.0.1:0")
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as answer:
            text = answer.read().decode()
    finally:
        server.metrics.stop_http()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


class PoolWorker:
    """A session allocating (atomic lookup) and freeing requests in one pool, hashing as
    that pool's workers do; on a refusal it frees everything it holds."""

    def __init__(self, client: KVCoordClient, pool: str, cfg: pb.PoolConfig, rnd: random.Random) -> None:
        self.client, self.pool, self.cfg, self.rnd = client, pool, cfg, rnd
        r = client.attach(pool, cfg.hash_algo, cfg.hash_block_size, cfg.hash_seed)
        self.sid, self.fence = r.session_id, r.fence
        self.live: list[str] = []
        self.n = 0

    def hashes(self, tokens: list[int], lora: str | None = None) -> list[bytes]:
        if not self.cfg.enable_caching:
            return []
        none = none_hash(self.cfg.hash_algo, self.cfg.hash_seed)
        return BlockHasher(self.cfg.hash_algo, self.cfg.hash_block_size, none, lora_name=lora).extend(tokens)

    def step(self, prompt: list[int], lora: str | None) -> None:
        rid = f"{self.pool}-{self.n}"
        self.n += 1
        sync = pb.RequestSync(
            request_id=rid,
            append_token_ids=prompt,
            append_block_hashes=self.hashes(prompt, lora),
            new_request=True,
        )
        if lora:
            sync.lora.CopyFrom(pb.LoRA(adapter_id=1, name=lora))
        op = pb.Operation(allocate=pb.AllocateOp(request=sync, num_new_tokens=len(prompt), lookup=True))
        ops = [op]
        if self.live and self.rnd.random() < 0.4:
            ops.append(pb.Operation(free=pb.FreeOp(request_id=self.live.pop(0))))
        r = self.client.step(self.pool, ops, self.sid, fence=self.fence)
        result = r.results[0].allocate
        if result.refused:
            self.client.step(
                self.pool, [pb.Operation(free=pb.FreeOp(request_id=rid))], self.sid, fence=self.fence
            )
            for old in self.live:
                self.client.step(
                    self.pool, [pb.Operation(free=pb.FreeOp(request_id=old))], self.sid, fence=self.fence
                )
            self.live.clear()
        else:
            self.live.append(rid)


def admit_on_both(manager: Any, local: KVCachePool, request: Any) -> bool:
    """A waiting request's lookup then its allocation of every remaining token, on a
    remote manager and on an in-process engine that already holds the request: the
    hits, the refusal and the block ids must be equal. A refused request is freed on
    both (a scheduler would keep it waiting). Returns whether it was admitted."""
    rid, num_tokens = request.request_id, len(request.all_token_ids)
    hit, n = manager.get_computed_blocks(request)
    want = local.get_computed_blocks(rid)
    assert (hit.block_ids, n) == (tuple(list(g) for g in want.block_ids), want.num_tokens)
    got = manager.allocate_slots(request, num_tokens - n, n, hit)
    exp = local.allocate_slots(rid, num_tokens - n, n, None if want.is_empty else want)
    assert (got is None) == (exp is None)
    if got is None:
        manager.free(request)
        local.free(rid)
        return False
    assert got.block_ids == tuple(list(g) for g in exp)
    return True


def child_pids(pid: int) -> list[int]:
    """The child processes of ``pid`` (Linux: /proc's children lists of its threads)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


#: a server process's ``sitecustomize``: ``os.fork`` fails as under a pids limit, and
#: state_export counts pools of FORK_BLOCKS blocks or more as large
_FORK_REFUSED = """
import errno
import os

import kvcoord.service.state_export as _export

_export.FORK_BLOCKS = {fork_blocks}


def _refused():
    raise OSError(errno.EAGAIN, "Resource temporarily unavailable (fork refused by the test)")


os.fork = _refused
"""


def fork_refused_env(base: dict[str, str], hook_dir: Path, fork_blocks: int = 16) -> dict[str, str]:
    """``base`` (a server process's environment) with a ``sitecustomize`` first on its
    PYTHONPATH that makes every ``os.fork`` of the server fail (EAGAIN) and counts a pool
    of ``fork_blocks`` blocks as large (state_export.FORK_BLOCKS)."""
    hook_dir.mkdir(parents=True, exist_ok=True)
    (hook_dir / "sitecustomize.py").write_text(_FORK_REFUSED.format(fork_blocks=fork_blocks))
    env = dict(base)
    env["PYTHONPATH"] = f"{hook_dir}:{env.get('PYTHONPATH', '')}"
    return env


def held_blocks(client: KVCoordClient, pool: str) -> dict[str, list[int]]:
    """Every request of ``pool`` with its first group's block ids (InspectPool)."""
    view = client.inspect_pool(pool, all_requests=True)
    return {r.request_id: list(r.groups[0].block_ids) for r in view.requests}


def allocate_each_answered_truly(
    client: KVCoordClient, pool: str, count: int, tokens_each: int
) -> dict[str, list[int]]:
    """Attach to ``pool`` (hash settings sha256_cbor, 4, "0") and allocate ``count``
    requests of ``tokens_each`` tokens, one call each; assert that no call answered
    with an error was applied (an error hiding an applied allocation makes its client
    reuse or lose blocks it never knew it held). Returns the answered block ids, which
    must be what the pool holds."""
    s = client.attach(pool, "sha256_cbor", 4, "0", lease_seconds=600)
    answered: dict[str, list[int]] = {}
    failed: dict[str, str] = {}
    for n in range(count):
        rid = f"r{n}"
        tokens = list(range(n * tokens_each, (n + 1) * tokens_each))
        try:
            got = client.allocate(pool, allocate(rid, tokens, tokens_each).allocate, s.session_id, s.fence)
        except KVCoordError as err:
            failed[rid] = str(err)
            continue
        assert not got.result.refused
        answered[rid] = list(got.result.new_block_ids[0].block_ids)
    held = held_blocks(client, pool)
    assert not (set(failed) & set(held)), f"applied, but answered {failed}"
    assert held == answered
    return answered


def drive(work: Generator[None, None, Any]) -> tuple[Any, int]:
    """A sliced generator run to its end: what it returns and how often it yielded."""
    yields = 0
    while True:
        try:
            next(work)
        except StopIteration as done:
            return done.value, yields
        yields += 1


def calls_in_threads(
    address: str,
    call: Callable[[KVCoordClient], object],
    n: int = 1,
    timeout: float = 20.0,
    retry: Any = NO_RETRY,
) -> tuple[list[threading.Thread], list[object]]:
    """Start ``n`` threads, each making ``call`` on a client of its own (as separate
    workers would, while the test holds the server somewhere); returns the threads and
    the list each one's answer, or the exception it was told, is appended to."""
    out: list[object] = []

    def run() -> None:
        with KVCoordClient(address, timeout=timeout, retry=retry) as c:
            try:
                out.append(call(c))
            except BaseException as exc:  # noqa: BLE001 - told to the test
                out.append(exc)

    threads = [threading.Thread(target=run) for _ in range(n)]
    for t in threads:
        t.start()
    return threads, out
