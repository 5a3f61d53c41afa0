"""The RPC fuzzer shared by tests/service/test_fuzz.py and bench/fuzz.py.

:func:`calls` generates one call at a time: any Allocator RPC with generated or
mutated fields (wrong hash lengths, huge counts, duplicate and unknown request and
session ids within a batch, stale and foreign fences, invalid pool configs, any
tenant's token or none), or raw random bytes sent through a raw channel method.
The server's state carries over from call to call, so successive calls come in
every order. :class:`Fuzzer` sends them and reports each status it saw (of the call
and of every operation inside a Step); :data:`DOCUMENTED` are the statuses the proto's
error model allows. INTERNAL and UNKNOWN never are.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import grpc
from hypothesis import strategies as st
from kvcoord.client.hashing import BlockHasher, none_hash
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.v1 import allocator_pb2_grpc as pb_grpc
from kvcoord.wire.columns import write_packed_decode
from support import pool_toml

SC = grpc.StatusCode
#: Every status the proto's error model names (DEADLINE_EXCEEDED: a WatchEvents
#: stream the fuzzer stops waiting on).
DOCUMENTED = {
    SC.OK, SC.INVALID_ARGUMENT, SC.NOT_FOUND, SC.ALREADY_EXISTS, SC.FAILED_PRECONDITION,
    SC.PERMISSION_DENIED, SC.UNAUTHENTICATED, SC.RESOURCE_EXHAUSTED, SC.ABORTED,
}  # fmt: skip
_BY_VALUE = {c.value[0]: c for c in SC}

ROOT, ALICE, BOB = "fuzz-root", "fuzz-alice", "fuzz-bob"
CONFIG = f"""
[server]
auth_tokens = ["{ROOT}"]

[limits]
max_pools = 16
max_ops_per_step = 64
max_tokens_per_request = 4096
max_pool_memory_bytes = 200000000

[tenants.alice]
tokens = ["{ALICE}"]
grants = [{{ pools = ["p*", "fz*"], roles = ["administer", "use", "observe"] }}]

[tenants.bob]
tokens = ["{BOB}"]
grants = [{{ pools = ["p*"], roles = ["use", "observe"] }}]
"""
CONFIG += pool_toml("p", 48, sliding_window=8, max_model_len=128, extra='shared_cache_tenants = ["bob"]\n')
CONFIG += pool_toml(
    "p-eagle",
    32,
    hash_algo="xxhash",
    hash_seed="1",
    events=False,
    max_model_len=0,
    extra="use_eagle = true\n",
)

POOLS = ["p", "p", "p", "p-eagle", "p-eagle", "fz1", "fz2", "", "nope"]
#: (hash_algo, hash_block_size, hash_seed) of the configured pools
HASHING = {"p": ("sha256_cbor", 4, "0"), "p-eagle": ("xxhash", 4, "1")}
RIDS = ["r0", "r1", "r2", "r3", ""]
_NONE = none_hash("sha256_cbor", "0")
METHODS = [m.name for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods]

# -- strategies ---------------------------------------------------------------------------
counts = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
tokens = st.lists(st.integers(0, 2**32 - 1) | st.integers(0, 50), max_size=40)
pool_names = st.sampled_from(POOLS) | st.text(max_size=8)
request_ids = st.sampled_from(RIDS) | st.text(max_size=6)


@st.composite
def syncs(draw: Any) -> pb.RequestSync:
    toks = draw(tokens)
    kind = draw(st.sampled_from(["real", "real", "real", "random", "short", "none"]))
    if kind == "real":
        hashes = BlockHasher("sha256_cbor", 4, _NONE).extend(list(toks))
    elif kind == "random":
        hashes = draw(st.lists(st.binary(min_size=32, max_size=32), max_size=12))
    elif kind == "short":
        hashes = draw(st.lists(st.binary(max_size=40), max_size=12))
    else:
        hashes = []
    s = pb.RequestSync(
        request_id=draw(request_ids),
        append_token_ids=toks,
        append_block_hashes=hashes,
        new_request=draw(st.booleans()),
        base_num_tokens=draw(st.sampled_from([0, 0, 0, 4, 8]) | counts),
        base_num_hashes=draw(st.sampled_from([0, 0, 0, 1, 2]) | counts),
        skip_reading_prefix_cache=draw(st.booleans()),
    )
    if draw(st.booleans()):
        s.num_computed_tokens = draw(counts)
    if draw(st.booleans()):
        s.lora.CopyFrom(pb.LoRA(adapter_id=draw(counts), name=draw(st.text(max_size=4))))
    if draw(st.booleans()):
        s.num_preemptions = draw(counts)
    return s


@st.composite
def hits(draw: Any) -> pb.CacheHit:
    groups = draw(st.lists(st.lists(st.integers(0, 60) | counts, max_size=6), max_size=3))
    return pb.CacheHit(groups=[pb.BlockIds(block_ids=g) for g in groups], num_tokens=draw(counts))


@st.composite
def allocate_ops(draw: Any) -> pb.AllocateOp:
    return pb.AllocateOp(
        request=draw(syncs()),
        num_new_tokens=draw(counts),
        num_new_computed_tokens=draw(st.integers(0, 16) | counts),
        new_computed_blocks=draw(hits()) if draw(st.booleans()) else None,
        num_lookahead_tokens=draw(st.integers(0, 8) | counts),
        num_external_computed_tokens=draw(st.integers(0, 8) | counts),
        delay_cache_blocks=draw(st.booleans()),
        num_encoder_tokens=draw(st.integers(0, 8)),
        lookup=draw(st.booleans()),
        must_succeed=draw(st.booleans()),
        must_refuse=draw(st.booleans()),
    )


@st.composite
def allocate_runs(draw: Any) -> pb.AllocateRunOp:
    """Runs of decode allocations: columns usually of one length, sometimes not."""
    n = draw(st.integers(0, 4))
    small = st.sampled_from([0, 0, 1, 4, 8]) | counts

    def column(values: Any) -> list[Any]:
        size = n if draw(st.integers(0, 9)) else draw(st.integers(0, 5))
        return [draw(values) for _ in range(size)]

    toks = column(st.integers(0, 3))
    return pb.AllocateRunOp(
        request_ids=column(request_ids),
        base_num_tokens=column(small),
        base_num_hashes=column(st.sampled_from([0, 1, 2]) | counts),
        num_computed_tokens=column(small),
        num_new_tokens=column(st.integers(0, 4) | counts),
        num_lookahead_tokens=column(st.sampled_from([0, 0, 1]) | counts),
        num_append_tokens=toks,
        append_token_ids=draw(
            st.lists(st.integers(0, 50), min_size=sum(toks) if sum(toks) < 40 else 0, max_size=40)
        ),
        num_append_hashes=column(st.integers(0, 1)),
        append_block_hashes=draw(st.lists(st.binary(min_size=32, max_size=32), max_size=3)),
    )


class _RunColumns:
    """A run's columns written by DecodeOp field name (what write_packed_decode reads)."""

    def __init__(self, run: pb.AllocateRunOp) -> None:
        self.run = run

    def write(self, op: Any) -> None:
        for name in REPEATED_DECODE_FIELDS:
            getattr(op, name).extend(getattr(self.run, name))


#: DecodeOp's repeated columns, each also a field of AllocateRunOp by the same name
REPEATED_DECODE_FIELDS = [
    f.name
    for f in pb.DecodeOp.DESCRIPTOR.fields
    if f.name != "must_succeed" and f.name in pb.AllocateRunOp.DESCRIPTOR.fields_by_name
]


def decode_of(run: pb.AllocateRunOp, must_succeed: bool, packed: bool = False) -> pb.DecodeOp:
    """A run's columns as a DecodeOp (the same fields, by name), in the repeated or the
    packed form (the predicting client's)."""
    d = pb.DecodeOp(must_succeed=must_succeed)
    if packed:
        write_packed_decode(d, _RunColumns(run))
    else:
        _RunColumns(run).write(d)
    return d


@st.composite
def lookups(draw: Any) -> pb.LookupOp:
    op = pb.LookupOp(request=draw(syncs()))
    mode = draw(st.sampled_from(["plain", "plain", "hint", "answered", "both"]))
    if mode in ("hint", "both"):
        op.hint = True
        op.walk_limit = draw(st.sampled_from([0, 1, 4096]) | counts)
    if mode in ("answered", "both"):
        op.answered.CopyFrom(draw(hits()))
    return op


@st.composite
def operations(draw: Any) -> pb.Operation:
    kinds = list(pb.Operation.DESCRIPTOR.fields_by_name)
    kind = draw(st.sampled_from(kinds + ["allocate", "lookup", "free", "sync"] * 3 + ["none"]))
    rid = draw(request_ids)
    build: dict[str, Any] = {
        "lookup": lambda: draw(lookups()),
        "allocate_run": lambda: draw(allocate_runs()),
        "decode": lambda: decode_of(draw(allocate_runs()), draw(st.booleans()), draw(st.booleans())),
        "allocate": lambda: draw(allocate_ops()),
        "free": lambda: pb.FreeOp(
            request_id=rid, **({"uncomputed_from": draw(counts)} if draw(st.booleans()) else {})
        ),
        "preempt": lambda: pb.PreemptOp(request_id=rid),
        "cache_blocks": lambda: pb.CacheBlocksOp(request=draw(syncs()), num_computed_tokens=draw(counts)),
        "remove_skipped_blocks": lambda: pb.RemoveSkippedBlocksOp(
            request=draw(syncs()), total_computed_tokens=draw(counts)
        ),
        "evict_blocks": lambda: pb.EvictBlocksOp(
            block_ids=draw(st.lists(st.integers(0, 60) | counts, max_size=6))
        ),
        "get_block_ids": lambda: pb.GetBlockIdsOp(request_id=rid),
        "common_prefix": lambda: pb.CommonPrefixOp(request_id=rid),
        "reset_prefix_cache": pb.ResetPrefixCacheOp,
        "take_events": pb.TakeEventsOp,
        "make_prefix_cache_stats": lambda: pb.MakePrefixCacheStatsOp(peek=draw(st.booleans())),
        "sync": lambda: pb.SyncOp(request=draw(syncs())),
        # vllm-0.33's operations (a 0.16 pool refuses them with a documented status)
        "record_prefix_cache_stats": lambda: pb.RecordPrefixCacheStatsOp(
            request_id=rid, num_hits=draw(counts)
        ),
        "estimate_cached_tokens": lambda: pb.EstimateCachedTokensOp(request_id=rid),
        "new_step_starts": pb.NewStepStartsOp,
        "get_num_blocks_to_allocate": lambda: pb.GetNumBlocksToAllocateOp(
            request_id=rid,
            num_tokens=draw(counts),
            total_computed_tokens=draw(counts),
            num_tokens_main_model=draw(counts),
            apply_admission_cap=draw(st.booleans()),
            num_encoder_tokens=draw(counts),
        ),
        "take_new_block_ids": pb.TakeNewBlockIdsOp,
        "take_boundary_state_offloads": pb.TakeBoundaryStateOffloadsOp,
        "take_kv_cache_block_copies": pb.TakeKVCacheBlockCopiesOp,
        "release_retained_blocks": lambda: pb.ReleaseRetainedBlocksOp(
            block_ids=draw(st.lists(st.integers(0, 60) | counts, max_size=6))
        ),
        "drop_boundary_state_offloads": lambda: pb.DropBoundaryStateOffloadsOp(request_id=rid),
        "drop_uncomputed": lambda: pb.DropUncomputedOp(request_id=rid, uncomputed_from=draw(counts)),
        "record_blocks_for_zeroing": lambda: pb.RecordBlocksForZeroingOp(
            request_id=rid, start_token=draw(st.sampled_from([0, 16, 32]) | counts)
        ),
        "admit": lambda: pb.AdmitOp(
            requests=draw(st.lists(syncs(), max_size=4)),
            token_budget=draw(counts),
            num_lookahead_tokens=draw(st.sampled_from([0, 1, 3]) | counts),
        ),
    }
    if kind == "none":
        return pb.Operation()
    return pb.Operation(**{kind: build[kind]()})


@st.composite
def group_specs(draw: Any) -> pb.KVCacheGroupSpec:
    bs = draw(st.sampled_from([0, 1, 3, 4, 8, 16]) | st.integers(0, 2**32 - 1))
    kind = draw(
        st.sampled_from(["full", "sliding_window", "chunked_local", "mamba", "cross_attention", "none"])
    )
    if kind == "full":
        return pb.KVCacheGroupSpec(
            full=pb.FullAttentionSpec(block_size=bs, sink_len=draw(st.sampled_from([0, 4, 5])))
        )
    if kind == "sliding_window":
        return pb.KVCacheGroupSpec(
            sliding_window=pb.SlidingWindowSpec(block_size=bs, sliding_window=draw(counts))
        )
    if kind == "chunked_local":
        return pb.KVCacheGroupSpec(
            chunked_local=pb.ChunkedLocalAttentionSpec(block_size=bs, attention_chunk_size=draw(counts))
        )
    if kind == "mamba":
        mode = draw(st.sampled_from(["", "none", "all", "align", "bogus"]))
        return pb.KVCacheGroupSpec(
            mamba=pb.MambaSpec(
                block_size=bs, mamba_cache_mode=mode, num_speculative_blocks=draw(st.integers(0, 3))
            )
        )
    if kind == "cross_attention":
        return pb.KVCacheGroupSpec(cross_attention=pb.CrossAttentionSpec(block_size=bs))
    return pb.KVCacheGroupSpec()


@st.composite
def pool_configs(draw: Any) -> pb.PoolConfig:
    cfg = pb.PoolConfig(
        num_blocks=draw(st.integers(0, 200) | st.integers(0, 2**32 - 1)),
        groups=draw(st.lists(group_specs(), max_size=3)),
        hash_block_size=draw(st.sampled_from([0, 1, 4, 8, 16]) | counts),
        enable_caching=draw(st.booleans()),
        use_eagle=draw(st.booleans()),
        enable_kv_cache_events=draw(st.booleans()),
        max_model_len=draw(st.sampled_from([0, 64, 4096, 5000]) | counts),
        hash_algo=draw(st.sampled_from(["sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "", "md5"])),
        hash_seed=draw(st.sampled_from(["0", "", "x"])),
        shared_cache_tenants=draw(st.lists(st.sampled_from(["*", "bob", "alice", ""]), max_size=2)),
    )
    if draw(st.booleans()):
        cfg.log_stats = draw(st.booleans())
    return cfg


@dataclasses.dataclass(frozen=True)
class Call:
    """One generated call: an RPC and its message (or raw bytes), the token to send,
    and which known session / fence to fill in (indexes into the fuzzer's lists)."""

    rpc: str
    message: Any
    token: str | None
    session: int
    fence: int


@st.composite
def calls(draw: Any) -> Call:
    rpc = draw(st.sampled_from(METHODS + ["raw"] + ["Step"] * 6 + ["Allocate", "Attach"] * 2))
    # Most calls are plausible on the outside (a known token, a configured pool, the
    # caller's own session and fence) so that the mutated insides reach the pool.
    if draw(st.integers(0, 9)) < 7:
        token = draw(st.sampled_from([ROOT, ALICE, BOB]))
        session, fence = draw(st.integers(0, 3)), draw(st.sampled_from([0, 0, 1]))
        pool = draw(st.sampled_from(["p", "p", "p-eagle"]))
    else:
        token = draw(st.sampled_from([ROOT, ALICE, BOB, None, "wrong"]))
        session, fence = draw(st.integers(0, 8)), draw(st.integers(0, 3))
        pool = draw(pool_names)
    key = draw(st.sampled_from(["", "", "k1", "k2"]))
    message: Any
    if rpc == "raw":
        message = (draw(st.sampled_from(METHODS)), draw(st.binary(max_size=200)))
    elif rpc == "CreatePool":
        message = pb.CreatePoolRequest(
            name=draw(st.sampled_from(["fz1", "fz2", "p", ""]) | st.text(max_size=6)),
            config=draw(pool_configs()),
        )
    elif rpc in ("GetPool", "DeletePool"):
        name = draw(pool_names) if rpc == "GetPool" else draw(st.sampled_from(["fz1", "fz2", "nope", ""]))
        message = getattr(pb, f"{rpc}Request")(name=name)
    elif rpc == "ListPools":
        message = pb.ListPoolsRequest()
    elif rpc == "Attach":
        algo, size, seed = HASHING.get(pool, ("sha256_cbor", 4, "0"))
        if draw(st.integers(0, 3)) == 0:  # a handshake mismatch now and then
            algo, size, seed = (
                draw(st.sampled_from(["sha256_cbor", "xxhash"])),
                draw(st.sampled_from([4, 8])),
                "2",
            )
        message = pb.AttachRequest(
            pool=pool,
            hash_algo=algo,
            hash_block_size=size,
            hash_seed=seed,
            client_name=draw(st.text(max_size=8)),
            lease_seconds=draw(st.sampled_from([0.0, 1.0, 3600.0, -1.0, float("inf"), float("nan")])),
            exclusive=draw(st.booleans()) and draw(st.booleans()),
        )
    elif rpc in ("Heartbeat", "Detach"):
        message = getattr(pb, f"{rpc}Request")()
    elif rpc == "FindLongestCacheHit":
        s = draw(syncs())
        message = pb.FindLongestCacheHitRequest(
            pool=pool, block_hashes=s.append_block_hashes, num_tokens=draw(counts)
        )
    elif rpc == "Allocate":
        message = pb.AllocateRequest(pool=pool, op=draw(allocate_ops()), idempotency_key=key)
    elif rpc == "Free":
        message = pb.FreeRequest(
            pool=pool,
            request_ids=draw(st.lists(request_ids, max_size=4)),
            preempt=draw(st.booleans()),
            idempotency_key=key,
        )
    elif rpc == "Step":
        message = pb.StepRequest(
            pool=pool,
            ops=draw(st.lists(operations(), max_size=8)),
            idempotency_key=key,
            include_state=draw(st.booleans()),
        )
    elif rpc == "ResetPrefixCache":
        message = pb.ResetPrefixCacheRequest(pool=pool)
    elif rpc == "GetStats":
        message = pb.GetStatsRequest(pool=pool)
    elif rpc == "InspectPool":
        message = pb.InspectPoolRequest(
            pool=pool,
            free_queue_limit=draw(counts),
            request_ids=draw(st.lists(request_ids, max_size=3)),
            all_requests=draw(st.booleans()),
            include_cached_blocks=draw(st.booleans()),
        )
    elif rpc in ("CheckPool", "ListSessions"):
        message = getattr(pb, f"{rpc}Request")(pool=pool)
    elif rpc == "ScorePools":
        s = draw(syncs())
        algo, size, seed = HASHING.get(pool, ("sha256_cbor", 4, "0"))
        prompt = pb.HashedPrompt(
            hash_algo=algo, hash_block_size=size, hash_seed=seed, block_hashes=s.append_block_hashes
        )
        message = pb.ScorePoolsRequest(
            candidate_pools=draw(st.lists(pool_names, max_size=2)),
            num_tokens=draw(counts),
            prompts=draw(st.lists(st.just(prompt), max_size=2)),
            include_block_ids=draw(st.booleans()),
        )
    else:
        message = pb.WatchEventsRequest(pool=pool, after_sequence=draw(st.integers(0, 3) | counts))
    return Call(rpc, message, token, session, fence)


# -- the driver ---------------------------------------------------------------------------
class Fuzzer:
    """Sends generated calls to a server and keeps what it needs to make them deep:
    sessions it attached (per token) and fences it saw.

    Args:
        address: the server.
    """

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.AllocatorStub(self.channel)
        #: (session id, token that attached it, pool, its fence)
        self.sessions: list[tuple[str, str | None, str, pb.Fence]] = []
        self.fences: list[pb.Fence] = []
        #: statuses seen: of calls ("call"), of Step operations ("op")
        self.seen: collections.Counter[tuple[str, str]] = collections.Counter()
        self.calls = 0

    def close(self) -> None:
        self.channel.close()

    def _fill(self, call: Call) -> Any:
        m = call.message
        if isinstance(m, tuple):
            return m
        fence = self.fences[-1] if self.fences else pb.Fence()
        if hasattr(m, "session_id"):
            # Mostly a session of the caller's own tenant, on the pool the call names.
            own = [s for s in self.sessions if s[1] == call.token] if call.session < 6 else self.sessions
            if own and call.session < 7:
                sid, _, pool, fence = own[-1 - call.session % len(own)]
                m.session_id = sid
                if hasattr(m, "pool") and call.session < 5:
                    m.pool = pool
            elif call.session == 7:
                m.session_id = "0" * 32
        if hasattr(m, "fence") and call.fence:
            m.fence.CopyFrom(
                fence if call.fence == 1 else pb.Fence(instance_id="gone", incarnation=call.fence)
            )
        return m

    def run(self, call: Call) -> list[str]:
        """Send one call; returns the problems found (an undocumented status)."""
        self.calls += 1
        message = self._fill(call)
        metadata = [("authorization", f"Bearer {call.token}")] if call.token else []
        problems: list[str] = []
        code, response = self._send(call.rpc, message, metadata)
        self.seen[("call", code.name)] += 1
        method = message[0] if isinstance(message, tuple) else call.rpc
        allowed = DOCUMENTED | ({SC.DEADLINE_EXCEEDED} if method == "WatchEvents" else set())
        if code not in allowed:
            problems.append(f"{call.rpc}: {code.name} {response!r:.300}")
        if code != SC.OK:
            return problems
        if isinstance(response, pb.AttachResponse):
            self.sessions.append((response.session_id, call.token, message.pool, response.fence))
            self.fences.append(response.fence)
        if isinstance(response, pb.StepResponse):
            for r in response.results:
                op_code = _BY_VALUE.get(r.status_code, SC.UNKNOWN)
                self.seen[("op", op_code.name)] += 1
                if op_code not in DOCUMENTED:
                    problems.append(f"Step operation: {op_code.name} {r.status_message!r:.300}")
        return problems

    def _send(self, rpc: str, message: Any, metadata: list[tuple[str, str]]) -> tuple[grpc.StatusCode, Any]:
        try:
            if isinstance(message, tuple):
                method, data = message
                path = f"/kvcoord.v1.Allocator/{method}"
                if method == "WatchEvents":
                    stream = self.channel.unary_stream(path)(data, metadata=metadata, timeout=0.05)
                    for _ in stream:
                        break
                    stream.cancel()
                    return SC.OK, None
                return SC.OK, self.channel.unary_unary(path)(data, metadata=metadata, timeout=10)
            if rpc == "WatchEvents":
                stream = self.stub.WatchEvents(message, metadata=metadata, timeout=0.05)
                first = next(stream, None)
                stream.cancel()
                return SC.OK, first
            return SC.OK, getattr(self.stub, rpc)(message, metadata=metadata, timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == SC.CANCELLED:
                return SC.OK, None
            return exc.code(), exc.details()

    def check_pools(self) -> dict[str, list[str]]:
        """Every pool's CheckPool violations (empty lists when all is well)."""
        pools = self.stub.ListPools(
            pb.ListPoolsRequest(), metadata=[("authorization", f"Bearer {ROOT}")], timeout=10
        )
        out = {}
        for p in pools.pools:
            r = self.stub.CheckPool(
                pb.CheckPoolRequest(pool=p.name), metadata=[("authorization", f"Bearer {ROOT}")], timeout=60
            )
            out[p.name] = list(r.violations)
        return out
