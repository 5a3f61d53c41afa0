"""vLLM 0.33's KV connector calls over a ``vllm-0.33`` kvcoord pool.

The pieces :mod:`kvcoord.client.vllm033` mixes into its sessions and its adapter so that
vLLM 0.33's scheduler runs a KV connector on kvcoord and decides as with its own
manager: a connector's synchronous and asynchronous loads (their block reservation,
``coordinator.get_num_blocks_to_allocate``), failed loads (recompute and fail), frees
delayed while KV is sent, the tables a finished request hands over
(``get_block_ids_for_computed_tokens``), the blocks a failed load left unwritten
recorded again for zeroing (``record_blocks_for_zeroing``), and deferred frees: with a KV consumer and
overlapping steps (the async scheduler, pipeline parallelism) vLLM 0.33 takes a
finished request's blocks (``pop_blocks_for_free``) and returns them a step later
(``block_pool.free_blocks(reversed(blocks))``: all groups' blocks in one reversed pass).
The pool frees the request at that later call, in that order (``FreeOp.all_groups_reversed``);
beside a mamba group, what vLLM drops when it takes the blocks and the scheduler could
see before they return (the request's pending boundary-state hand-offs) is dropped at
the take (``DropBoundaryStateOffloadsOp``); so are, when the scheduler undoes a call cut
short, the hashes that call's allocation cached on blocks the worker never wrote
(``DropUncomputedOp``).

What is not reproduced is named by :func:`connector_refusal_033` (refused at start) or
refused when first used (see :mod:`kvcoord.client.vllm033`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, TypeVar

from kvcoord.v1 import allocator_pb2 as pb

from . import vllm_manager
from .errors import KVCoordError
from .items import Item

T = TypeVar("T")

__all__ = [
    "AdapterConnector033",
    "ConnectorOps033",
    "DeferredFree",
    "PredictingConnector033",
    "RemoteConnector033",
    "connector_refusal_033",
]


def connector_refusal_033(kv_cache_config: Any, vllm_config: Any) -> str | None:
    """Why kvcoord cannot serve this engine's KV connector under vLLM 0.33 (``None``: it
    can, or there is none): the load fence (``defer_async_loads``, which vLLM 0.33 sets
    only with a HiSparse host pool, itself not reproduced) and an auxiliary-output
    connector (it caps prefix hits). A connector asking for per-group divergent hits
    (``get_computed_blocks_for_connector``) or sub-block tails
    (``truncate_computed_blocks``, with fine-grained hits, refused) is refused when first
    used."""
    if vllm_config.kv_transfer_config is None:
        return None
    if getattr(kv_cache_config, "hisparse_host_num_blocks", None) is not None:
        return (
            "a KV connector with a HiSparse host pool: not supported (out of scope): HiSparse "
            "keeps a second, host-side block pool with its own managers and coordinator, and "
            "0.33 defers asynchronous loads behind load fences only with it; a kvcoord pool is "
            "one block pool"
        )
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and getattr(aux, "enabled", False):
        return (
            "an auxiliary-output connector: not supported by the vllm-0.33 profile: its scheduler "
            "side reads vLLM's block pool directly (cached-hash lookups per block through "
            "coordinator.single_type_managers) to cap each prefix hit and to retain or release "
            "hashes, state that lives in the kvcoord pool"
        )
    return None


@dataclasses.dataclass(frozen=True, slots=True)
class DeferredFree:
    """What ``pop_blocks_for_free`` answers vLLM 0.33's scheduler in place of a request's
    blocks (its one item): the scheduler keeps it until the step that may still write
    the blocks is processed, then hands it to ``block_pool.free_blocks``, which frees
    the request in the pool in vLLM's deferred order (all groups, one reversed pass).
    Until then the pool still holds the request's blocks, as vLLM's pool does."""

    request_id: str


class ConnectorOps033:
    """The calls of vLLM 0.33's scheduler that change a request's state in the pool
    beside its allocations, each one operation (named as the call) of the next call to
    the pool: :meth:`_connector_op`, the waiting session's
    (:class:`RemoteConnector033`) or the predicted one's (:class:`PredictingConnector033`)."""

    def _connector_op(self, name: str, request_id: str, **fields: Any) -> None:
        raise NotImplementedError

    def drop_boundary_state_offloads(self, request_id: str) -> None:
        """The request's pending boundary-state hand-offs dropped as vLLM 0.33 takes its
        blocks."""
        self._connector_op("drop_boundary_state_offloads", request_id)

    def drop_uncomputed(self, request_id: str, uncomputed_from: int) -> None:
        """An undone step's deferred free, at the take: the cache entries of the
        request's blocks past ``uncomputed_from`` dropped (``DropUncomputedOp``)."""
        self._connector_op("drop_uncomputed", request_id, uncomputed_from=uncomputed_from)

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM 0.33's ``record_blocks_for_zeroing``: the request's blocks from
        ``start_token`` on recorded again for ``take_new_block_ids``."""
        self._connector_op("record_blocks_for_zeroing", request_id, start_token=start_token)


class RemoteConnector033(ConnectorOps033):
    """The connector calls of a waiting ``vllm-0.33`` session (mixed into
    :class:`~kvcoord.client.vllm033.Remote033KVCacheManager`)."""

    _ops: Any
    defer: Any
    defer_op: Any
    tracker: Any
    #: (RemoteMamba033's: the pool's answer to an operation, one round trip)
    _ask: Any
    if TYPE_CHECKING:

        def _now(self, item: Item[T]) -> T: ...

    def free_all_groups_reversed(self, request_id: str) -> None:
        """vLLM 0.33's deferred free of the request (sent with the next call)."""
        item = self._ops.free(request_id)
        if item is not None:
            item.op.free.all_groups_reversed = True
            self.defer(item)

    def _connector_op(self, name: str, request_id: str, **fields: Any) -> None:
        """Sent with the next call; nothing for a request the pool never got (it holds
        no blocks of it)."""
        if request_id in self.tracker:
            self.defer_op(pb.Operation(**{name: {"request_id": request_id, **fields}}))

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, total_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool, num_encoder_tokens: int,
    ) -> int:  # fmt: skip
        """vLLM 0.33's ``coordinator.get_num_blocks_to_allocate`` with no new hit: one
        round trip."""
        return int(self._ask(
            "get_num_blocks_to_allocate", lambda r: r.num_blocks, request_id=request_id, num_tokens=num_tokens,
            total_computed_tokens=total_computed_tokens, num_tokens_main_model=num_tokens_main_model,
            apply_admission_cap=apply_admission_cap, num_encoder_tokens=num_encoder_tokens,
        ))  # fmt: skip

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """vLLM 0.33's ``get_block_ids_for_computed_tokens``: one round trip."""
        return self._now(self._ops.get_block_ids(request_id, num_computed_tokens))


class PredictingConnector033(ConnectorOps033):
    """The connector calls of a predicted ``vllm-0.33`` session (mixed into
    :class:`~kvcoord.client.vllm033.Predicting033KVCacheManager`): answered by the
    mirror; only the deferred free changes anything, and is sent with the next Step."""

    tracker: Any
    mirror: Any
    sender: Any
    _settled: Any
    #: (PredictedMamba033's: the call applied to the mirror, and sent as its operation)
    _mirrored: Any

    def free_all_groups_reversed(self, request_id: str) -> None:
        """vLLM 0.33's deferred free of the request: applied to the mirror now, sent
        with the next Step (as ``free``)."""
        self.tracker.lost.discard(request_id)
        if request_id not in self.tracker:
            return  # never sent (or lost with its session): nothing to free
        if self.mirror.holds(request_id):
            self.mirror.call("free", request_id, True)
        self.tracker.forget([request_id])
        op = self.sender.op().free
        op.request_id = request_id
        op.all_groups_reversed = True

    def _connector_op(self, name: str, request_id: str, **fields: Any) -> None:
        """Applied to the mirror now (a zeroing record: its next ``take_new_block_ids``
        answers them), sent with the next Step; nothing for a request the mirror does
        not hold."""
        if request_id not in self.tracker or not self.mirror.holds(request_id):
            return
        self._settled()
        self._mirrored(name, request_id=request_id, **fields)

    def get_num_blocks_to_allocate(self, request_id: str, *args: Any) -> int:
        """As :meth:`RemoteConnector033.get_num_blocks_to_allocate`, read from the mirror
        (nothing is sent: it changes nothing)."""
        self._settled()
        return int(self.mirror.call("get_num_blocks_to_allocate", request_id, *args))

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        self._settled()
        ids = self.mirror.call("get_block_ids_for_computed_tokens", request_id, num_computed_tokens)
        return tuple(list(g) for g in ids)


class AdapterConnector033:
    """The connector calls of vLLM 0.33's ``KVCacheManager`` surface (mixed into
    :class:`~kvcoord.client.vllm033.KVCoord033KVCacheManager`)."""

    _held: dict[str, Any]
    _tables: dict[str, Any]
    allocated: dict[str, int]
    undoing: bool
    remote: Any
    absorbing: bool
    _absorb: Any
    num_kv_cache_groups: int
    _mamba: bool
    _zeroing: bool

    def pop_blocks_for_free(self, request: Any) -> list[DeferredFree]:
        """vLLM 0.33's deferred free, first half: the request is gone for the scheduler
        (no table, no hashes); its blocks stay held in the pool until
        ``block_pool.free_blocks`` gets the answer back (:meth:`free_deferred`). While
        the scheduler undoes a call that allocated for it (``undoing``, see the
        adapter's ``free``), the hashes that allocation cached past the tokens whose KV
        existed before it are dropped now (``DropUncomputedOp``): a lookup before the
        deferred free must not hit them."""
        rid = request.request_id
        self._held.pop(rid, None)
        self._tables.pop(rid, None)
        if self.undoing and rid in self.allocated:
            self._kept_for_scheduler(self.remote.drop_uncomputed, rid, int(self.allocated[rid]))
        if self._mamba:  # its pending hand-offs go now, as vLLM's MambaManager drops them
            self._kept_for_scheduler(self.remote.drop_boundary_state_offloads, rid)
        return [DeferredFree(rid)]

    @vllm_manager.absorbing(lambda *_: None)  # inside update_from_output: kept for the scheduler
    def free_deferred(self, request_id: str) -> None:
        """The deferred free's second half: the pool frees the request (all groups, one
        reversed pass)."""
        self.remote.free_all_groups_reversed(request_id)

    def _kept_for_scheduler(self, call: Any, *args: Any) -> None:
        """``call(*args)``, each on its own: inside ``update_from_output`` a loss or an
        outage is kept for the scheduler, as for every other call there."""
        try:
            call(*args)
        except KVCoordError as err:
            self._absorb(err)

    @vllm_manager.absorbing(lambda *_: None)  # (as free_deferred)
    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """vLLM 0.33's scheduler calls it in a zeroing pool when an asynchronous KV load
        failed but left valid computed tokens (``start_token``): the pool records the
        request's blocks from there on again for ``take_new_block_ids``."""
        if self._zeroing:
            self.remote.record_blocks_for_zeroing(request_id, start_token)

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        # only mamba groups in align mode keep a producer's partial tails (refused at start)
        return []

    # vLLM 0.33 asks from update_from_output (_free_request -> _connector_finished): a
    # loss or an outage met there is kept for the scheduler, as for every other call
    # there, and no table is given (a request lost with its session holds no blocks;
    # after an outage its KV is not sent: the receiving engine's load fails and its
    # policy decides, recomputation by default)
    @vllm_manager.absorbing(lambda self, *_: tuple([] for _ in range(self.num_kv_cache_groups)))
    def get_block_ids_for_computed_tokens(self, request_id: str, num_computed_tokens: int) -> Any:
        if request_id not in self._held or request_id in self.remote.tracker.lost:
            # no table, as vLLM answers (a lost request finishing before the scheduler
            # preempted it holds none: its session's blocks are gone)
            return tuple([] for _ in range(self.num_kv_cache_groups))
        return self.remote.get_block_ids_for_computed_tokens(request_id, num_computed_tokens)
