"""The two refusals an allocation with external (KV connector) tokens can meet, as pools
built over real gRPC and, call for call, in an in-process engine pool (the twin the
server's state is compared with): UNCOUNTED_BLOCKS (a mamba ``align`` group, one block
short of what it takes: tests/service/test_mamba_external_wire.py) and HIT_BLOCK_TAKEN
(vllm-0.16, a later group's free hit block at the free queue's head:
tests/service/test_hit_block_taken_wire.py). Used by test_refusals_under_faults.py and
test_refusals_managers_faults.py, with :class:`FirstFaulted` (the channel's FaultInjector,
one fault at a time)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from helpers import allocate, follow_up, hashes
from kvcoord.client import KVCoordClient
from kvcoord.client.faults import FaultInjector
from kvcoord.engine import KVCachePool
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.layouts import config_from_pb
from test_hit_block_taken_wire import PROMPT as HIT_PROMPT
from test_hit_block_taken_wire import mamba_first_pool
from test_mamba_external_wire import PROMPT as MAMBA_PROMPT
from test_mamba_external_wire import mamba_pool

#: the token a decode appends
DECODED = 9999
#: a request of 3 tokens (one block per group) that no case's refusal involves
OTHER = [7000, 7001, 7002]


@dataclasses.dataclass(frozen=True)
class Case:
    """One refusal: its pool, the allocations (request, prompt, tokens) and frees that
    bring the pool to it, and the refused request's first allocation."""

    reason: str
    config: Callable[[], pb.PoolConfig]
    #: ("alloc", rid, tokens, n) or ("free", rid)
    setup: tuple[tuple[Any, ...], ...]
    rid: str
    prompt: list[int]
    #: set-up requests a Step may decode (no new block) and free around the refusal
    #: without changing what it meets
    decoded: str
    freed: str
    #: a set-up request a manager may free just before the refused call (its free
    #: queued, sent in the same Step) without changing what it meets
    queued: str = ""

    def refused_op(self) -> pb.Operation:
        """The refused allocation: the whole prompt (less the hit, looked up by the
        server in the same call) with one external token."""
        return allocate(
            self.rid, self.prompt, len(self.prompt) - 1, num_external_computed_tokens=1, lookup=True
        )


UNCOUNTED = Case(
    "UNCOUNTED_BLOCKS",
    lambda: mamba_pool(10),
    # "z" and "y" hold 2 blocks each: 5 free, "a" takes 6 (vLLM counts 5)
    (("alloc", "z", [100], 1), ("alloc", "y", [101], 1)),
    "a",
    MAMBA_PROMPT,
    "z",
    "y",
)

HIT_TAKEN = Case(
    "HIT_BLOCK_TAKEN",
    lambda: mamba_first_pool(20),
    (
        ("alloc", "p0", HIT_PROMPT[:4] + [50, 51, 52, 53], 8),
        ("alloc", "q", list(range(200, 217)), 16),
        ("free", "p0"),
        ("free", "q"),
        ("alloc", "p", HIT_PROMPT[:8] + [99], 8),
        *(("alloc", f"h{k}", [1000 + k, 2000 + k, 3000 + k], 3) for k in range(5)),
    ),
    "e",
    HIT_PROMPT,
    "h0",
    "h1",
    "h4",
)

#: UNCOUNTED_BLOCKS with a third holder, "x", whose free (queued before the refused
#: call) brings the pool to 5 free blocks: the refusal needs vLLM's count (5) free
UNCOUNTED_QUEUED = Case(
    "UNCOUNTED_BLOCKS",
    lambda: mamba_pool(10),
    (("alloc", "z", [100], 1), ("alloc", "y", [101], 1), ("alloc", "x", [102], 1)),
    "a",
    MAMBA_PROMPT,
    "z",
    "y",
    "x",
)

CASES = {"uncounted": UNCOUNTED, "hit-taken": HIT_TAKEN}


class Twin:
    """One session on a server pool and an in-process engine pool given the same calls:
    every allocation and free is applied to both (and must answer the same)."""

    def __init__(self, client: KVCoordClient, pool: str, case: Case) -> None:
        self.client, self.pool, self.case = client, pool, case
        client.create_pool(pool, case.config())
        self.local = KVCachePool(config_from_pb(client.get_pool(pool).pool.config))
        att = client.attach(pool, "sha256_cbor", 4, "0")
        self.sid, self.fence = att.session_id, att.fence
        self.held: dict[str, list[int]] = {}  # the tokens each held request has on the server
        for call in case.setup:
            if call[0] == "alloc":
                self.alloc(*call[1:])
            else:
                self.free(call[1])

    def step(self, ops: list[pb.Operation]) -> list[pb.OperationResult]:
        return list(self.client.step(self.pool, ops, self.sid, self.fence).results)

    def alloc_op(self, rid: str, tokens: list[int], n: int) -> pb.Operation:
        return allocate(rid, tokens, n)

    def decode_op(self, rid: str) -> pb.Operation:
        """One more token of a held request, its prompt computed: one slot for it."""
        held = self.held[rid]
        return pb.Operation(
            allocate=pb.AllocateOp(request=follow_up(rid, held, [DECODED], len(held)), num_new_tokens=1)
        )

    def local_alloc(self, rid: str, tokens: list[int], n: int) -> Any:
        """The engine's answer to :meth:`alloc_op`'s (recorded as applied)."""
        self.local.add_request(rid, tokens, hashes(tokens))
        assert self.local.get_computed_blocks(rid).num_tokens == 0  # (none of these finds a hit)
        got = self.local.allocate_slots(rid, n)
        assert got is not None
        self.held[rid] = list(tokens)
        return got

    def local_decode(self, rid: str) -> Any:
        """The engine's answer to :meth:`decode_op`'s (recorded as applied)."""
        held = self.held[rid]
        self.local.update_request(
            rid, num_computed_tokens=len(held), append_token_ids=[DECODED],
            append_block_hashes=hashes(held + [DECODED])[len(held) // 4 :],
        )  # fmt: skip
        got = self.local.allocate_slots(rid, 1)
        assert got is not None
        self.held[rid] = held + [DECODED]
        return got

    def alloc(self, rid: str, tokens: list[int], n: int) -> list[list[int]]:
        (r,) = self.step([self.alloc_op(rid, tokens, n)])
        assert not r.status_code and not r.allocate.refused, r.status_message
        got = [list(g.block_ids) for g in r.allocate.new_block_ids]
        assert got == [list(g) for g in self.local_alloc(rid, tokens, n)]
        return got

    def free(self, rid: str) -> None:
        (r,) = self.step([pb.Operation(free=pb.FreeOp(request_id=rid))])
        assert not r.status_code, r.status_message
        self.local_free(rid)

    def local_free(self, rid: str) -> None:
        self.local.free(rid)
        self.held.pop(rid, None)

    def server_state(self) -> tuple[int, dict[str, list[list[int]]]]:
        s = self.client.inspect_pool(self.pool, all_requests=True)
        return s.num_free_blocks, {r.request_id: [list(g.block_ids) for g in r.groups] for r in s.requests}

    def local_state(self) -> tuple[int, dict[str, list[list[int]]]]:
        held = {rid: [list(g) for g in self.local.get_block_ids(rid)] for rid in self.held}
        return self.local.num_free_blocks, held

    def agrees(self) -> None:
        """The server's free count and tables are the engine's, and CheckPool is clean."""
        assert self.server_state() == self.local_state()
        assert list(self.client.check_pool(self.pool).violations) == []


class FirstFaulted(FaultInjector):
    """The channel's fault injector, with its fault drawn on the first faulted call (or
    StepStream message) only: every later one passes untouched (what ``p`` says is
    certain: 1.0 for the fault wanted)."""

    def _faulted(self) -> int:
        c = self.counts
        return c["dropped"] + c["delayed"] + c["duplicated"]

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        before = self._faulted()
        try:
            return super().intercept_unary_unary(continuation, details, request)
        finally:
            if self._faulted() > before:
                self.enabled = False

    def draw_message(self, request: Any) -> tuple[str, Any]:
        fault, late = super().draw_message(request)
        if fault in ("drop", "delay", "duplicate"):
            self.enabled = False
        return fault, late


def certain(fault: str) -> tuple[float, float, float, float]:
    """FaultInjector's ``p`` for one fault ("drop", "delay", "duplicate", "reorder"), certain."""
    p = tuple(1.0 if f == fault else 0.0 for f in ("drop", "delay", "duplicate", "reorder"))
    return p  # type: ignore[return-value]
