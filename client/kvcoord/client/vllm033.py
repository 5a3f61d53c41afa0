"""vLLM 0.33.0's ``KVCacheManager`` surface over a kvcoord pool of the ``vllm-0.33`` profile.

:mod:`kvcoord.client.vllm_scheduler` uses this module when the installed vLLM is 0.33.x
(:func:`vllm_profile` decides). vLLM 0.33's scheduler and engine core call the manager in
more ways than 0.16.0's (a 3-tuple from ``get_computed_blocks``, statistics recorded at
admission, ``full_sequence_must_fit`` and ``reserved_blocks`` on ``allocate_slots``,
``new_step_starts``, and reach into ``coordinator`` and ``block_pool``). Each decision is
the pool's: the pool runs vLLM 0.33's rules (the ``vllm-0.33`` profile, part of the
attach handshake). An exclusive pool is predicted, as under 0.16
(:class:`Predicting033KVCacheManager`: the client's mirror is the pool's engine under the
``vllm-0.33`` profile); otherwise every call waits for the pool's answer
(:class:`Remote033KVCacheManager`).

What kvcoord cannot reproduce for 0.33 is refused when the scheduler starts
(:func:`~.vllm033_refusals.unsupported_033` names the reason), or, for a property of one request, when the
scheduler first passes that request (:class:`Unsupported033Error`): never a silent guess.
Supported: KV cache groups of full attention, MLA (``MLAAttentionSpec``, full attention
with ``use_mla`` as vLLM 0.33's FullAttentionManager takes it; MTP drafts too), sliding
window and chunked local attention (of one block size or several: hashes of the smallest, hits and caching at
their LCM; 0.33's processed-token basis travels as
``AllocateOp.num_in_flight_tokens`` for every group that frees blocks early, windows
and mamba; sparse, dense or periodic sliding-window retention as the KVCacheConfig's
``prefix_cache_retention_interval`` says), prefix caching on or off, KV events, statistics, the synchronous and the
asynchronous scheduler, the FCFS and priority policies, the watermark
(``AllocateOp.watermark_blocks``), cache salts, LoRA adapters (their
path is in the hashes vLLM computes; events name the adapter), n-gram / draft-model
speculative decoding, EAGLE/MTP with 0.33's default look-ahead block hashes (multi-module
MTP too: the pool holds back its re-prefillable tail from caching), mamba
groups beside full attention (``align`` mode, or ``none`` with prefix caching off;
speculative blocks, on every scheduler; the pool's shared-prefix boundary and per-step
drains, :mod:`.vllm033_mamba`; prefill checkpoint blocks,
``MambaSpec.num_prefill_checkpoint_blocks`` as vLLM's Mamba2 / GDN layers set it), and KV
connectors (loads, failed loads, delayed and deferred frees, beside a mamba group too:
:mod:`.vllm033_connector`),
fine-grained (partial) hits (:func:`.vllm033_mamba.partial_hits_033` says which; with
``enable_mamba_shared_prefix_checkpoint`` too, :func:`.vllm033_mamba.shared_prefix_checkpoint_033`), and KV
cache zeroing (``take_new_block_ids``: beside a mamba group, or for a mixed-precision KV
cache with ``PoolConfig.needs_kv_cache_zeroing``, set from the KVCacheConfig; an async
load's ``skip_zeroing_group_ids`` travel as ``AllocateOp.skip_zeroing_group_ids``).
A lost session costs recomputation (``check_session`` surfaces a loss met in the
background; the scheduler preempts the requests lost, and undoes a step cut short). Refused: other group types (cross attention; MLA's subclasses, and MLA
with ``tokens_per_state`` other than 1, DeepseekV4 fields or a sparse-MLA indexer role;
attention sinks, which vLLM 0.33.0 itself cannot start), decode / prefill context
parallelism, a positive
``prefix_cache_retention_interval`` beside a mamba group, EAGLE/MTP with the trailing-block drop (look-ahead
hashes turned off), multi-module MTP beside a KV connector, a KV connector with a HiSparse host pool (load
fences), an auxiliary-output connector (see
:func:`~kvcoord.client.vllm033_connector.connector_refusal_033`), other
and fine-grained (partial) hits. With KV events on, a request's multimodal items
and prompt-embeds digests travel with its registration (:func:`extra_key_sources_033`)
so that the pool publishes vLLM 0.33's ``BlockStored.extra_keys`` for its blocks, and
so does its ``full`` report mode (``RequestSync.kv_cache_report_full``), so that the pool
re-announces each hit the request looks up, as vLLM 0.33's ``get_computed_blocks``.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

from .client import KVCoordClient
from .errors import RequestsLostError
from .items import NO_ADMISSION
from .manager import RemoteKVCacheManager
from .predicting import PredictingKVCacheManager
from .vllm import (
    KVCacheBlocks,
    KVCoordKVCacheManager,
    ManagerKinds,
    Settings,
    attach_manager,
    pool_config_from_vllm,
)
from .vllm033_connector import (
    AdapterConnector033,
    DeferredFree,
    PredictingConnector033,
    RemoteConnector033,
)
from .vllm033_extra_keys import extra_key_sources_033, name_extra_keys_033
from .vllm033_mamba import PredictedMamba033, RemoteMamba033, shared_prefix_checkpoint_033
from .vllm033_parts import BlockPool033, Coordinator033, Unsupported033Error, UnsupportedVLLMError
from .vllm033_refusals import eagle_drops_033, unsupported_033
from .vllm_manager import absorbing

__all__ = [
    "VLLM_016",
    "VLLM_033",
    "DeferredFree",
    "KVCoord033KVCacheManager",
    "Predicting033KVCacheManager",
    "Remote033KVCacheManager",
    "Unsupported033Error",
    "UnsupportedVLLMError",
    "connect_033",
    "extra_key_sources_033",
    "pool_config_033",
    "unsupported_033",
    "vllm_profile",
]

VLLM_016 = "vllm-0.16"
VLLM_033 = "vllm-0.33"
#: the semantics profile of each vLLM release (major.minor) kvcoord matches
_PROFILES = {"0.16": VLLM_016, "0.33": VLLM_033}


def vllm_profile(version: str | None = None) -> str:
    """The semantics profile matching vLLM ``version`` (default: the installed one):
    ``vllm-0.16`` for 0.16.x, ``vllm-0.33`` for 0.33.x.

    Raises:
        UnsupportedVLLMError: any other release (its allocator answers differently from
            both; see docs/vllm-integration.md).
    """
    if version is None:
        version = importlib.metadata.version("vllm")
    profile = _PROFILES.get(".".join(version.split(".")[:2]))
    if profile is not None:
        return profile
    raise UnsupportedVLLMError(
        f"vLLM {version} is installed: kvcoord matches vLLM 0.16.x (profile vllm-0.16) and "
        "0.33.x (profile vllm-0.33) only; other releases allocate differently"
    )


class Remote033KVCacheManager(RemoteConnector033, RemoteMamba033, RemoteKVCacheManager):
    """:class:`RemoteKVCacheManager` attached as a ``vllm-0.33`` worker, with 0.33's
    extra calls. Never exclusive: its allocations wait for the pool's answer (the
    client's promises and lookup hints follow 0.16's refusal rules; an exclusive 0.33
    pool is predicted instead, :class:`Predicting033KVCacheManager`)."""

    def __init__(self, client: Any, pool: str, **kwargs: Any) -> None:
        kwargs["exclusive"] = False
        super().__init__(client, pool, profile=VLLM_033, **kwargs)
        #: the request of the last lookup and its shared-prefix boundary
        self.boundary: tuple[str, int] = ("", 0)
        name_extra_keys_033(self.tracker, self.config)

    def new_step_starts(self) -> None:
        self.defer_op(pb.Operation(new_step_starts=pb.NewStepStartsOp()))

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        op = pb.RecordPrefixCacheStatsOp(request_id=request_id, num_hits=num_hits)
        self.defer_op(pb.Operation(record_prefix_cache_stats=op))

    def estimate_cached_tokens(self, request_id: str) -> int:
        return int(self._ask("estimate_cached_tokens", lambda r: r.num_tokens, request_id=request_id))

    def peek_prefix_cache_stats(self) -> pb.PrefixCacheStats | None:
        """As the base's (``make_prefix_cache_stats`` reads it too), the queued calls sent
        first: statistics recorded at admission travel with the next Step."""
        if self.sender.queue:
            self.flush()
        return super().peek_prefix_cache_stats()


class Predicting033KVCacheManager(PredictingConnector033, PredictedMamba033, PredictingKVCacheManager):
    """:class:`PredictingKVCacheManager` attached as a ``vllm-0.33`` worker: its mirror is
    the pool's engine under the ``vllm-0.33`` profile, so it answers 0.33's calls (its
    admission inputs, statistics recorded at admission, ``new_step_starts``) at once,
    as the server will, and sends them with the step's Step."""

    def __init__(self, client: Any, pool: str, **kwargs: Any) -> None:
        super().__init__(client, pool, profile=VLLM_033, **kwargs)
        name_extra_keys_033(self.tracker, self.config)

    def new_step_starts(self) -> None:
        self._settled()
        self._mirrored("new_step_starts")

    def record_prefix_cache_stats(self, request_id: str, num_hits: int) -> None:
        # never where a loss is met (no _settled): vLLM 0.33 calls it after telling the KV
        # connector to load a request's KV and before parking the request in
        # WAITING_FOR_REMOTE_KVS; a loss raised here left the load running for a request
        # the undo put back as never admitted. The next call (or schedule()) meets it.
        self._mirrored("record_prefix_cache_stats", request_id=request_id, num_hits=num_hits)

    def estimate_cached_tokens(self, request_id: str) -> int:
        self._settled()
        return int(self.mirror.call("estimate_cached_tokens", request_id))

    def shared_prefix_boundary(self, request_id: str) -> int:
        """vLLM 0.33's third ``get_computed_blocks`` value for the request's last lookup."""
        if not self.mirror.holds(request_id):
            return 0
        return int(self.mirror.call("shared_prefix_boundary", request_id))


class KVCoord033KVCacheManager(AdapterConnector033, KVCoordKVCacheManager):
    """vLLM 0.33.0's ``KVCacheManager`` interface over a ``vllm-0.33`` kvcoord pool."""

    remote: Remote033KVCacheManager | Predicting033KVCacheManager
    fields_033 = True

    def __init__(
        self, remote: Remote033KVCacheManager | Predicting033KVCacheManager, kv_cache_config: Any
    ) -> None:
        super().__init__(remote, kv_cache_config)
        #: a group frees blocks before the request ends: those that leave its window
        #: (sliding window, chunked local) or a mamba group's skipped and superseded
        #: states and its prefill checkpoint block, freed once processed (async steps
        #: keep them while the chunk that wrote them is in flight)
        self._skipping = any(
            g.WhichOneof("spec") in ("sliding_window", "chunked_local", "mamba") for g in remote.config.groups
        )
        #: a mamba group: the pool records per-step state the scheduler drains
        self._mamba = any(g.WhichOneof("spec") == "mamba" for g in remote.config.groups)
        #: the pool records new attention blocks for the worker to zero: beside a mamba
        #: group, or with vLLM 0.33's needs_kv_cache_zeroing (a mixed-precision KV cache)
        self._zeroing = self._mamba or remote.config.needs_kv_cache_zeroing
        self.coordinator = Coordinator033(kv_cache_config, remote)
        self.block_pool = BlockPool033(
            self.free_deferred, lambda ids: self.remote.release_retained_blocks(ids),
            lambda: self.remote.session_id,
        )  # fmt: skip
        #: vLLM 0.33's flag its scheduler reads to stop a chunk at the junction (the pool's)
        self.mamba_shared_prefix_checkpoint = remote.config.mamba_shared_prefix_checkpoint
        self.retained_hit_group_ids: tuple[int, ...] = ()
        #: vLLM 0.33's int(scheduler_config.watermark * num_blocks) (set by connect_033)
        self.watermark_blocks = 0

    def _took_over(self, remote: Any) -> None:
        self.coordinator.remote = remote

    # -- vLLM 0.33's calls ----------------------------------------------------------------
    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return self.enable_caching and not getattr(request, "skip_reading_prefix_cache", False)

    def get_computed_blocks(  # type: ignore[override]
        self, request: Any, max_cache_hit_length: int | None = None
    ) -> tuple[KVCacheBlocks, int, int]:
        if max_cache_hit_length is not None and max_cache_hit_length != request.num_tokens - 1:
            raise Unsupported033Error(
                "get_computed_blocks with max_cache_hit_length (an aux-output connector)"
            )
        blocks, num_tokens = super().get_computed_blocks(request)
        # The third value (where a shared prefix ends that a sliding-window group has not
        # cached) feeds 0.33's mamba chunk stops; the pool keeps its own from this lookup
        # for its caching
        return blocks, num_tokens, self.remote.shared_prefix_boundary(request.request_id)

    def allocate_slots(
        self,
        request: Any,
        *args: Any,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> KVCacheBlocks | None:
        """0.16's ``allocate_slots`` (its arguments in ``args`` / ``kwargs``) with 0.33's
        keyword arguments."""
        remote = self.remote
        # the processed-token basis matters only to a group that frees blocks early (a
        # window, or mamba: full attention frees nothing early): elsewhere 0, so decode
        # steps stay plain
        in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0) if self._skipping else 0
        # vLLM 0.33's watermark: for a waiting or preempted request only, and only when
        # something is already scheduled this step
        watermark = 0
        if self.watermark_blocks and has_scheduled_reqs:
            from vllm.v1.request import RequestStatus

            if request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                watermark = self.watermark_blocks
        # the groups an async KV load writes: their external blocks are not zeroed (only
        # a zeroing pool records any, and only blocks for external tokens are skipped)
        skip_zeroing = tuple(int(g) for g in skip_zeroing_group_ids) if self._zeroing else ()
        remote.admission = (full_sequence_must_fit, reserved_blocks, in_flight, watermark, skip_zeroing)
        try:
            return super().allocate_slots(request, *args, **kwargs)
        finally:
            remote.admission = NO_ADMISSION

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        # full attention skips nothing; the count is 0.33's processed-token basis
        super().remove_skipped_blocks(request_id, processed_computed_tokens)

    def new_step_starts(self) -> None:
        self.remote.new_step_starts()

    def surface_losses(self) -> set[str]:
        """The requests reported lost since the last call, a loss the session met since
        the last call included (the scheduler preempts them before its step)."""
        try:
            self.remote.check_session()
        except RequestsLostError as err:
            self.lost.update(err.request_ids)
            self.surfaced += 1
        return self.take_lost()

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        if not self.log_stats or not self.prefix_cache_lookup_enabled(request):
            return
        self.remote.record_prefix_cache_stats(request.request_id, num_hits)

    @absorbing(lambda *_: 0)  # read by update_from_output
    def estimate_cached_tokens(self, request: Any) -> int:
        rid = request.request_id
        if rid not in self._held or rid in self.remote.tracker.lost:
            # never allocated here, freed, or lost with its session and not preempted yet
            # (the session attached again does not hold it: asked, it refuses REQUEST_UNKNOWN)
            return 0
        return self.remote.estimate_cached_tokens(rid)

    # vLLM 0.33's per-step drains, the pool's: only a pool with a mamba group records
    # boundary states and copy-on-write pairs, and only one with a mamba group or
    # needs_kv_cache_zeroing new blocks to zero, so the others answer empty without a call
    def take_new_block_ids(self) -> list[int]:
        return self.remote.take_new_block_ids() if self._zeroing else []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        from .vllm033_parts import copies_for_vllm  # (imports vLLM)

        if not self._mamba:
            return [], []
        copies, retained = self.remote.take_kv_cache_block_copies()
        return copies_for_vllm(copies, retained, self.remote.session_id)  # the session that took them

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        return self.remote.take_boundary_state_offloads() if self._mamba else {}

    # refused when first reached (docs/semantics-notes.md)

    def get_computed_blocks_for_connector(self, request: Any, max_cache_hit_length: int | None = None) -> Any:
        raise Unsupported033Error("get_computed_blocks_for_connector (a KV connector)")

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        raise Unsupported033Error("truncate_computed_blocks (a KV connector's partial tails)")


def pool_config_033(
    kv_cache_config: Any, vllm_config: Any, hash_block_size: int, *, log_stats: bool = True
) -> pb.PoolConfig:
    """The ``vllm-0.33`` pool an engine with these configs expects (as 0.33's engine core
    builds its manager: ``hash_block_size`` is the one it passes the scheduler)."""
    cfg = pool_config_from_vllm(kv_cache_config, vllm_config, log_stats=log_stats)
    cfg.profile = VLLM_033
    cfg.hash_block_size = int(hash_block_size)
    # EAGLE's trailing-block drop where 0.33 runs it (no look-ahead hashes), in the
    # groups it flags (none flagged: every group)
    cfg.use_eagle = eagle_drops_033(vllm_config)
    if cfg.use_eagle:
        flagged = [
            i for i, g in enumerate(kv_cache_config.kv_cache_groups) if getattr(g, "is_eagle_group", False)
        ]
        cfg.eagle_group_ids.extend(flagged)
    cfg.num_hash_lookahead_tokens = int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0)
    # sparse retention, as 0.33's coordinator reads it from the KVCacheConfig (EngineCore
    # copies it from cache_config; None keeps every sliding-window hash, on the wire -1)
    retention = getattr(kv_cache_config, "prefix_cache_retention_interval", 0)
    if retention is None:
        cfg.prefix_cache_retention_interval = -1
    elif retention:
        cfg.prefix_cache_retention_interval = int(retention)  # periodic (beside mamba: refused)
    # the admission cap of sliding-window and chunked-local groups (0: max_model_len, as vLLM)
    cfg.max_in_flight_tokens = int(getattr(vllm_config, "max_in_flight_tokens", 0) or 0)
    # the worker zeroes new blocks (mamba layers, a mixed-precision KV cache): the pool
    # records the attention groups' new blocks for take_new_block_ids
    cfg.needs_kv_cache_zeroing = bool(getattr(kv_cache_config, "needs_kv_cache_zeroing", False))
    # enable_mamba_shared_prefix_checkpoint as vLLM's manager narrows it (the pool keys
    # mamba states at shared-prefix junctions; off, the option changes nothing)
    cfg.mamba_shared_prefix_checkpoint = shared_prefix_checkpoint_033(
        kv_cache_config.kv_cache_groups, vllm_config, hash_block_size
    )
    return cfg


def connect_033(
    settings: Settings,
    kv_cache_config: Any,
    vllm_config: Any,
    hash_block_size: int,
    *,
    log_stats: bool = True,
    client: KVCoordClient | None = None,
) -> KVCoord033KVCacheManager:
    """:func:`kvcoord.client.vllm.connect` for vLLM 0.33: create or find the ``vllm-0.33``
    pool, check it matches the engine, attach as a ``vllm-0.33`` worker, wrap.

    As under 0.16, an exclusive pool (``KVCOORD_EXCLUSIVE=1``, ``KVCOORD_PREDICT=1``, the
    defaults) is predicted (:class:`Predicting033KVCacheManager`); otherwise, or when the
    server gives no state this client can mirror (a warning says why), every
    allocation waits for the pool's answer (:class:`Remote033KVCacheManager`: 0.16's
    promises do not apply to 0.33's rules, so ``KVCOORD_EXCLUSIVE`` without prediction
    changes nothing but the handshake).

    Raises:
        PoolMismatchError: the pool exists with other settings or another profile.
        RandomSeedError: prefix caching is on and ``PYTHONHASHSEED`` is not set.
        KVCoordError: the server refused or could not be reached.
    """
    expected = pool_config_033(kv_cache_config, vllm_config, hash_block_size, log_stats=log_stats)
    kinds = ManagerKinds(
        Predicting033KVCacheManager, Remote033KVCacheManager, KVCoord033KVCacheManager,
        {"num_hash_lookahead_tokens": expected.num_hash_lookahead_tokens},
    )  # fmt: skip
    manager = attach_manager(settings, expected, kv_cache_config, client, kinds)
    assert isinstance(manager, KVCoord033KVCacheManager)
    # the watermark is the worker's (its scheduler config), sent with each allocation
    watermark = float(getattr(vllm_config.scheduler_config, "watermark", 0.0) or 0.0)
    manager.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
    return manager
