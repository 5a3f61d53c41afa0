"""Connecting an engine to a pool: created from the engine's KVCacheConfig, attached when
equal, refused with every difference named otherwise; stats and events are vLLM's types."""

from __future__ import annotations

import itertools
from pathlib import Path

import msgspec
import pytest
from harness import BLOCK_SIZE, V033, kv_cache_config, vllm_config
from kvcoord.client import PoolBusyError
from kvcoord.client.vllm import PoolMismatchError, Settings, connect, pool_config_from_vllm
from kvcoord.service.testing import InProcessServer
from vllm.distributed.kv_events import BlockStored, KVEventBatch
from vllm.v1.metrics.stats import PrefixCacheStats
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

_names = itertools.count()


def test_pool_created_from_engine_config(model_dir: Path, server: InProcessServer) -> None:
    """The pool gets the engine's groups, blocks and settings; a second engine is refused
    while the first holds the pool exclusively, and attaches once it is gone."""
    cfg, kv = vllm_config(model_dir, 64, async_scheduling=False), kv_cache_config("full+swa", 64)
    settings = Settings(target=server.address, pool=f"made-{next(_names)}")
    first = connect(settings, kv, cfg)
    pool = first.remote.config
    assert (pool.num_blocks, pool.hash_block_size, pool.max_model_len) == (64, BLOCK_SIZE, 1024)
    assert [g.WhichOneof("spec") for g in pool.groups] == ["full", "sliding_window"]
    assert pool.groups[1].sliding_window.sliding_window == 64
    assert (pool.hash_algo, pool.hash_seed, pool.enable_kv_cache_events) == ("sha256", "0", True)
    again = Settings(target=server.address, pool=settings.pool, create_pool=False)
    with pytest.raises(PoolBusyError):
        connect(again, kv, cfg)
    first.close()
    second = connect(again, kv, cfg)
    assert second.num_kv_cache_groups == 2
    second.close()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("stats off", ["log_stats"]),
        ("events off", ["enable_kv_cache_events"]),
        ("one block fewer", ["num_blocks"]),
        ("other block size", ["group 0", "group 1", "hash_block_size"]),
        ("all", ["log_stats", "enable_kv_cache_events", "num_blocks"]),
    ],
)
def test_mismatch_refused_naming_each_difference(
    change: str, named: list[str], model_dir: Path, server: InProcessServer
) -> None:
    """An existing pool with other settings is refused; the message names every difference."""
    pool = f"existing-{next(_names)}"
    connect(Settings(target=server.address, pool=pool), kv_cache_config("full+swa", 64),
            vllm_config(model_dir, 64, async_scheduling=False)).close()  # fmt: skip
    num_blocks = 63 if change in ("one block fewer", "all") else 64
    events = change not in ("events off", "all")
    log_stats = change not in ("stats off", "all")
    cfg = vllm_config(model_dir, num_blocks, async_scheduling=False, events=events)
    kv = kv_cache_config("full+swa", num_blocks)
    if change == "other block size":
        cfg.cache_config.block_size = 32
        for g in kv.kv_cache_groups:
            g.kv_cache_spec = type(g.kv_cache_spec)(**{**g.kv_cache_spec.__dict__, "block_size": 32})
    with pytest.raises(PoolMismatchError) as err:
        connect(Settings(target=server.address, pool=pool), kv, cfg, log_stats=log_stats)
    assert sorted(d.split(":")[0] for d in err.value.differences) == sorted(named), err.value.differences
    for name in named:
        assert name in str(err.value)


def test_stats_and_events_are_vllms_and_serialize(model_dir: Path, server: InProcessServer) -> None:
    """make_prefix_cache_stats / take_events give vLLM's types; msgspec round-trips them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    m = connect(Settings(target=server.address, pool=f"types-{next(_names)}"), kv_cache_config("full", 64),
                vllm_config(model_dir, 64, async_scheduling=False))  # fmt: skip
    req = Request("a", list(range(40)), SamplingParams(max_tokens=4), None, None,
                  block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256))  # fmt: skip
    hit, n = m.get_computed_blocks(req)
    assert m.allocate_slots(req, 40, n, hit) is not None
    stats = m.make_prefix_cache_stats()
    assert isinstance(stats, PrefixCacheStats) and (stats.requests, stats.queries) == (1, 40)
    events = m.take_events()
    assert [type(e) for e in events] == [BlockStored] and len(events[0].block_hashes) == 2
    batch = KVEventBatch(ts=0.0, events=events)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(batch), type=KVEventBatch) == batch
    assert MsgpackDecoder(PrefixCacheStats).decode(MsgpackEncoder().encode(stats)) == stats
    m.free(req)
    m.close()


def test_expected_pool_from_vllm_defaults(model_dir: Path) -> None:
    """vLLM's default hash (sha256) and PYTHONHASHSEED carry into the pool config."""
    cfg = vllm_config(model_dir, 64, async_scheduling=False, enable_caching=False, events=False)
    pc = pool_config_from_vllm(kv_cache_config("full", 64), cfg, log_stats=False)
    assert (pc.enable_caching, pc.hash_algo, pc.hash_seed, pc.log_stats) == (False, "", "", False)


@pytest.mark.parametrize(
    ("qualname", "asynchronous"),
    [
        ("kvcoord.client.vllm_scheduler.KVCoordScheduler", False),
        ("kvcoord.client.vllm_scheduler.KVCoordAsyncScheduler", True),
    ],
)
def test_scheduler_cls_option_runs_on_kvcoord(
    qualname: str,
    asynchronous: bool,
    model_dir: Path,
    server: InProcessServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`vllm serve --scheduler-cls <qualname>`: vLLM's own argument parser takes the
    option, its SchedulerConfig resolves the name to kvcoord's class, and the scheduler
    built with EngineCore's arguments allocates from a pool the engine's config made."""
    # vLLM's parser builds its config defaults, which detect the platform: the CUDA-built
    # PyPI wheel finds none on this machine, so tell it the CPU one (this test only)
    import vllm.platforms
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.structured_output import StructuredOutputManager

    monkeypatch.setattr(vllm.platforms, "_current_platform", CpuPlatform())
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(model_dir), "--scheduler-cls", qualname])
    assert EngineArgs.from_cli_args(args).scheduler_cls == qualname

    monkeypatch.setenv("KVCOORD_TARGET", server.address)
    monkeypatch.setenv("KVCOORD_POOL", f"serve-{asynchronous}")
    config = vllm_config(model_dir, 64, async_scheduling=asynchronous)
    config.scheduler_config.scheduler_cls = qualname
    cls = config.scheduler_config.get_scheduler_cls()
    assert f"{cls.__module__}.{cls.__qualname__}" == qualname
    kv_config = kv_cache_config("full", 64)
    scheduler = cls(  # as vLLM's EngineCore.__init__ builds it
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        include_finished_set=False,
        log_stats=True,
        block_size=BLOCK_SIZE,
    )
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name(config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)  # as EngineCore does
        hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
        scheduler.add_request(
            Request("r0", list(range(40)), SamplingParams(max_tokens=4), None, None, block_hasher=hasher)
        )
        out: SchedulerOutput = scheduler.schedule()
        assert [r.req_id for r in out.scheduled_new_reqs] == ["r0"]
        (table,) = out.scheduled_new_reqs[0].block_ids
        assert len(table) == 3  # 40 tokens in 16-token blocks, from the kvcoord pool
        # predicted by default (an exclusive pool), under vLLM 0.33 too: the step's calls
        # reach the server with its Step, sent when the step ends; flush sends it now
        expected = "Predicting033KVCacheManager" if V033 else "PredictingKVCacheManager"
        assert type(scheduler.kv_cache_manager.remote).__name__ == expected
        scheduler.kv_cache_manager.remote.flush()
        stats = scheduler.kv_cache_manager.remote.client.get_stats(f"serve-{asynchronous}")
        assert stats.num_free_blocks == 63 - 3
    finally:
        scheduler.shutdown()


@pytest.mark.skipif(
    V033, reason="vLLM 0.33: this test drives vLLM 0.16's KVCacheManager API (its constructor, connect)"
)
@pytest.mark.parametrize("predict", [False, True], ids=["exclusive", "predicted"])
def test_an_evicted_block_reports_no_hash_while_held(
    predict: bool, model_dir: Path, server: InProcessServer
) -> None:
    """evict_blocks (a KV connector's failed load) drops a held block's hash: vLLM's
    get_blocks then reports None for it, for as long as its request holds it, and the
    adapter does the same; the block allocated anew to another request reports that
    request's hash again. Block ids, hashes and events equal vLLM's manager's at every
    call. (Before, the adapter kept deriving the dropped hash from the request's
    tokens.)"""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK_SIZE, hash_fn)
    kv = kv_cache_config("full", 8)
    theirs = KVCacheManager(kv, max_model_len=1024, hash_block_size=BLOCK_SIZE, enable_caching=True,
                            log_stats=True, enable_kv_cache_events=True)  # fmt: skip
    ours = connect(Settings(target=server.address, pool=f"evict-{next(_names)}", predict=predict), kv,
                   vllm_config(model_dir, 8, async_scheduling=False))  # fmt: skip

    def view(blocks: object) -> list[list[tuple[int, bytes | None]]]:
        return [[(b.block_id, None if b.block_hash is None else bytes(b.block_hash)) for b in g]
                for g in blocks.blocks]  # type: ignore[attr-defined]  # fmt: skip

    def request(rid: str, tokens: list[int]) -> Request:
        return Request(rid, tokens, SamplingParams(max_tokens=8), None, None, block_hasher=hasher)

    def admit(rid: str, tokens: list[int]) -> None:
        for m in (theirs, ours):
            r = request(rid, tokens)
            hit, n = m.get_computed_blocks(r)
            assert m.allocate_slots(r, len(tokens) - n, n, hit) is not None
            r.num_computed_tokens = len(tokens)
            held[(m is ours, rid)] = r

    def same(rid: str) -> list[list[tuple[int, bytes | None]]]:
        got = view(ours.get_blocks(rid))
        assert got == view(theirs.get_blocks(rid))
        assert [repr(e) for e in ours.take_events()] == [repr(e) for e in theirs.take_events()]
        return got

    held: dict[tuple[bool, str], Request] = {}
    admit("a", list(range(40)))  # two full blocks, cached
    before = same("a")
    assert all(h is not None for _, h in before[0][:2])
    for m in (theirs, ours):
        m.evict_blocks({before[0][1][0]})
    after = same("a")
    assert after[0][1][1] is None and after[0][0][1] is not None
    for m in (theirs, ours):
        m.free(held[(m is ours, "a")])
    admit("b", list(range(100, 196)))  # six blocks: every free one, the evicted one among them
    assert any(b == before[0][1][0] and h is not None for b, h in same("b")[0])
    ours.close()
