"""The mamba groups and lost sessions of :mod:`kvcoord.client.vllm033` (vLLM 0.33.0's
``KVCacheManager`` surface): the checks that decide which mamba layouts a ``vllm-0.33``
pool reproduces, and the calls its two manager kinds add for them (the pool's
shared-prefix boundary, the three per-step drains) and for a session lost between
steps (``check_session``)."""

from __future__ import annotations

import math
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import copies_from_pb, offloads_from_pb

from .items import Item, KVCacheBlockIds

__all__ = [
    "PredictedMamba033",
    "RemoteMamba033",
    "partial_hits_033",
    "shared_prefix_checkpoint_033",
    "uncached_mamba_hybrid",
]


def shared_prefix_checkpoint_033(groups: Any, vllm_config: Any, hash_block_size: int) -> bool:
    """vLLM 0.33's ``KVCacheManager.mamba_shared_prefix_checkpoint``: the engine option
    ``enable_mamba_shared_prefix_checkpoint`` as vLLM's manager narrows it, on only with an
    EAGLE group (a group flagged ``is_eagle_group``, or every group under the EAGLE drop),
    fine-grained (partial) hits and no multi-module MTP re-prefill tail (more than one
    prefill look-ahead token). Off, the option changes nothing in vLLM 0.33 (its scheduler
    reads the narrowed flag); on, the pool keys mamba states at shared-prefix junctions
    (``PoolConfig.mamba_shared_prefix_checkpoint``) and the scheduler stops chunks there."""
    if not getattr(vllm_config.cache_config, "enable_mamba_shared_prefix_checkpoint", False):
        return False
    spec = vllm_config.speculative_config
    drop = spec is not None and bool(spec.use_eagle_block_drop())
    if not (drop or any(getattr(g, "is_eagle_group", False) for g in groups)):
        return False
    # (the scheduler's num_prefill_lookahead: a multi-module MTP drafter's k, else at most 1)
    if int(getattr(vllm_config, "num_prefill_lookahead_tokens", 0) or 0) > 1:
        return False
    return partial_hits_033(groups, vllm_config, hash_block_size) is not None


def partial_hits_033(groups: Any, vllm_config: Any, hash_block_size: int) -> str | None:
    """vLLM 0.33's fine-grained (partial) hits (issue 25), on every scheduler (a step
    in flight included: the pool frees mamba states on the processed-token basis):
    ``coordinator.enable_partial_hash_hits`` is then True,
    ``take_kv_cache_block_copies`` answers the pool's pairs as vLLM's ``KVCacheBlockCopy``
    with :class:`~.vllm033_parts.RetainedBlock` handles, and ``block_pool.free_blocks``
    releases those in the pool in the order given (``ReleaseRetainedBlocksOp``, with the
    next Step).

    ``None`` unless vLLM 0.33 turns fine-grained (partial) hits on (prefix caching and a
    mamba "align" group whose block is larger than the hash block); then ``""`` when
    kvcoord takes the layout (full attention and mamba "align" groups of one block size,
    prefill checkpoint blocks or not, drafts (n-gram, draft model, MTP/EAGLE with
    look-ahead hashes) or none, no KV connector, no periodic retention), else why not."""
    if not vllm_config.cache_config.enable_prefix_caching:
        return None
    specs = [g.kv_cache_spec for g in groups]
    if not any(
        getattr(s, "mamba_cache_mode", None) == "align" and int(s.block_size) > hash_block_size for s in specs
    ):
        return None
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    why = "fine-grained (partial) prefix hits with copy-on-write are supported"
    if any(type(s) not in (FullAttentionSpec, MambaSpec) for s in specs):
        return f"{why} beside full attention only"
    if len({int(s.block_size) for s in specs}) > 1 or any(int(s.block_size) % hash_block_size for s in specs):
        return f"{why} with groups of one block size (a multiple of hash_block_size {hash_block_size}) only"
    if vllm_config.kv_transfer_config is not None:
        return f"{why} without KV connectors only"
    # (drafts run: the mamba group's speculative blocks are modelled, and MTP/EAGLE's
    # look-ahead hashes key partial tails at the same boundaries as vLLM 0.33)
    # (mamba prefill checkpoint blocks, Mamba2's and GDN's layouts, are modelled beside
    # them: the chunk reaching the prefill's end may take the copy and the checkpoint)
    return ""


def uncached_mamba_hybrid(groups: Any, vllm_config: Any, hash_block_size: int) -> bool:
    """Attention groups of one block size beside mamba groups of another, with nothing
    cached (prefix caching off): vLLM 0.33 schedules by their LCM, the pool's scheduler
    block size, and keeps no hash. (A KV connector's request hashes, then of the LCM
    too, are vLLM's for the connector: the pool takes the external tokens it reports and
    caches nothing.)"""
    if vllm_config.cache_config.enable_prefix_caching:
        return False
    mamba = [g for g in groups if hasattr(g.kv_cache_spec, "mamba_cache_mode")]
    others = {int(g.kv_cache_spec.block_size) for g in groups if g not in mamba}
    lcm = math.lcm(*(int(g.kv_cache_spec.block_size) for g in groups))
    return bool(mamba) and len(others) == 1 and hash_block_size == lcm


class RemoteMamba033:
    """Remote033KVCacheManager's calls for mamba groups and lost sessions: every answer
    is the pool's (methods of a RemoteKVCacheManager subclass)."""

    def get_computed_blocks(self: Any, request: Any) -> tuple[KVCacheBlockIds, int]:
        """0.16's lookup, keeping the pool's shared-prefix boundary of its answer."""
        item = self._ops.get_computed_blocks(request)
        decode = item.decode

        def with_boundary(r: pb.OperationResult) -> tuple[KVCacheBlockIds, int]:
            self.boundary = (request.request_id, int(r.lookup.shared_prefix_boundary))
            looked_up: tuple[KVCacheBlockIds, int] = decode(r)
            return looked_up

        item.decode = with_boundary
        self.boundary = (request.request_id, 0)
        looked_up: tuple[KVCacheBlockIds, int] = self._now(item)
        return looked_up

    def shared_prefix_boundary(self: Any, request_id: str) -> int:
        """vLLM 0.33's third ``get_computed_blocks`` value: the pool's, from the request's
        lookup just made."""
        rid, boundary = self.boundary
        return boundary if rid == request_id else 0

    def check_session(self: Any) -> None:
        """Nothing to check: every answer waits for the pool, so a loss is met by the
        call it interrupts."""

    def _ask(self: Any, name: str, decode: Any, **fields: Any) -> Any:
        """The pool's answer to vLLM 0.33's call ``name``: the operation of that name, of
        ``fields``, sent now (one round trip), its result read by ``decode``."""
        return self._now(Item(pb.Operation(**{name: fields}), lambda r: decode(getattr(r, name))))

    # vLLM 0.33's per-step drains (mamba pools; the others answer empty without a call)
    def take_new_block_ids(self: Any) -> list[int]:
        return list(self._ask("take_new_block_ids", lambda r: r.block_ids))

    def take_boundary_state_offloads(self: Any) -> dict[str, list[tuple[int, int, int]]]:
        return self._ask("take_boundary_state_offloads", offloads_from_pb)  # type: ignore[no-any-return]

    def take_kv_cache_block_copies(self: Any) -> tuple[list[tuple[int, int]], list[int]]:
        return self._ask("take_kv_cache_block_copies", copies_from_pb)  # type: ignore[no-any-return]

    def release_retained_blocks(self: Any, block_ids: list[int]) -> None:
        """The scheduler's release of the copies' blocks once their step ran (sent with
        the next Step; a block not retained fails it, BLOCK_NOT_RETAINED)."""
        self.defer_op(pb.Operation(release_retained_blocks=pb.ReleaseRetainedBlocksOp(block_ids=block_ids)))


class PredictedMamba033:
    """Predicting033KVCacheManager's calls for mamba groups and lost sessions: the
    mirror answers, the server does the same with the step's Step (methods of a
    PredictingKVCacheManager subclass)."""

    def check_session(self: Any) -> None:
        """Raise now a loss the session met since the last call (a Step that failed, a
        lease that may have run out), before the scheduler's step changes anything.

        Raises:
            RequestsLostError: naming every request the session held.
        """
        self._vouch()
        self._settled()

    def _mirrored(self: Any, name: str, **fields: Any) -> Any:
        """vLLM 0.33's call ``name`` applied to the mirror now (``fields``' values its
        arguments, in order; its answer returned), and sent with the step's Step as the
        operation of that name, of those fields: the server makes the same call."""
        out = self.mirror.call(name, *fields.values())
        op = getattr(self.sender.op(), name)
        op.MergeFrom(type(op)(**fields))
        return out

    # vLLM 0.33's per-step drains: the mirror's answer now; the server drains its own
    # with the step's Step
    def _drain(self: Any, name: str) -> Any:
        self._settled()
        return self._mirrored(name)

    def take_new_block_ids(self: Any) -> list[int]:
        return list(self._drain("take_new_block_ids"))

    def take_boundary_state_offloads(self: Any) -> dict[str, list[tuple[int, int, int]]]:
        return self._drain("take_boundary_state_offloads")  # type: ignore[no-any-return]

    def take_kv_cache_block_copies(self: Any) -> tuple[list[tuple[int, int]], list[int]]:
        out = self._drain("take_kv_cache_block_copies")
        self.sender.expect("copies", out)  # the server's pairs must be the mirror's
        return out  # type: ignore[no-any-return]

    def release_retained_blocks(self: Any, block_ids: list[int]) -> None:
        """The mirror releases now; the server does the same with the step's Step."""
        self._settled()
        self._mirrored("release_retained_blocks", block_ids=list(block_ids))
