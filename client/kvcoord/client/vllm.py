"""vLLM 0.16.0 on kvcoord: a drop-in ``KVCacheManager`` and scheduler classes.

Importable without vLLM. With vLLM importable, the adapter returns vLLM's own
``PrefixCacheStats`` and KV event types (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so engine-output serialization, the ZMQ event publisher and the
stats loggers take them unchanged; without vLLM it returns kvcoord's plain equivalents
defined here.

Pieces, from the inside out:

- :class:`KVCacheBlocks` / :class:`KVCacheBlock`: what vLLM's ``KVCacheBlocks`` offers the
  scheduler and KV connectors (``+``, ``new_empty``, ``get_block_ids(allow_none)``,
  ``get_unhashed_block_ids``, ``blocks[g][j].block_id`` / ``.block_hash``).
- :func:`pool_config_from_vllm` builds a pool configuration from the engine's
  ``KVCacheConfig`` and ``VllmConfig``; :func:`pool_config_differences` compares two.
- :class:`KVCoordKVCacheManager` wraps a :class:`RemoteKVCacheManager` and has every
  method and attribute vLLM's scheduler, async scheduler and KV connectors use on
  ``KVCacheManager`` (the list, with vLLM source lines, is in docs/vllm-integration.md).
- :func:`connect` creates the pool (or attaches to an existing one) and refuses a pool
  whose layout or settings differ from the engine's (:class:`PoolMismatchError`).
- ``KVCoordScheduler`` / ``KVCoordAsyncScheduler`` (defined only when vLLM is
  importable): vLLM's ``Scheduler`` / ``AsyncScheduler`` whose ``kv_cache_manager`` is
  kvcoord, for ``vllm serve --scheduler-cls kvcoord.client.vllm.KVCoordScheduler``,
  configured by ``KVCOORD_*`` environment variables (see :class:`Settings`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from collections.abc import Callable
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

from .client import KVCoordClient
from .errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    PoolBusyError,
    ResourceExhaustedError,
)
from .hashing import RandomSeedError
from .manager import RemoteKVCacheManager
from .predicting import PredictingKVCacheManager
from .vllm_manager import OUTAGE_ERRORS, REFUSALS, KVCoordKVCacheManager, is_outage
from .vllm_pool_config import PoolMismatchError, pool_config_differences, pool_config_from_vllm
from .vllm_types import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheBlock,
    KVCacheBlocks,
    PrefixCacheStats,
    convert_events,
    convert_stats,
    vllm_available,
)

__all__ = [
    "OUTAGE_ERRORS",
    "REFUSALS",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "KVCacheBlock",
    "KVCacheBlocks",
    "KVCoordKVCacheManager",
    "ManagerKinds",
    "PoolMismatchError",
    "PrefixCacheStats",
    "Settings",
    "attach_manager",
    "connect",
    "convert_events",
    "convert_stats",
    "is_outage",
    "pool_config_differences",
    "pool_config_from_vllm",
    "vllm_available",
]

logger = logging.getLogger(__name__)

# -- connecting ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Where an engine's KV cache pool lives; :meth:`from_env` reads ``KVCOORD_*``.

    Attributes:
        target: ``host:port`` or ``unix:/path`` of the kvcoord server (``KVCOORD_TARGET``).
        pool: the pool's name (``KVCOORD_POOL``, default ``vllm``).
        token: bearer token when the server sets ``auth_tokens`` (``KVCOORD_TOKEN``).
        create_pool: create the pool from the engine's ``KVCacheConfig`` when it does not
            exist (``KVCOORD_CREATE_POOL``, default ``1``); ``0`` only attaches.
        timeout: deadline of each call in seconds (``KVCOORD_TIMEOUT``, default 10).
        client_name: shown in server logs (``KVCOORD_CLIENT_NAME``, default host:pid).
        exclusive: the engine is the pool's only session (``KVCOORD_EXCLUSIVE``, default
            ``1``), which prediction needs, and the pool's prefix cache is this engine's
            memory's: reset at every Attach (a new process; a session lost and attached
            again). ``0`` lets several engines share the pool (one round trip per lookup or
            allocation), its cached blocks read by every engine as they are: engines
            sharing a pool must share the KV memory its block ids name.
        predict: answer every call from a mirror of the pool (the engine itself, loaded
            from the server) and never wait (``KVCOORD_PREDICT``, default ``1``; needs
            ``exclusive``): a :class:`PredictingKVCacheManager`, for every layout. When
            the server gives no state this client can mirror (an engine of another
            kvcoord release, a state larger than one answer, routers' reservations),
            a warning says why and the engine runs the waiting mode with a shared
            pool's semantics: every call answered by the server, never from a second
            copy of the rules. Mid-run too: a lost session attached again to a server
            restarted meanwhile with another engine (a rolling upgrade) goes on in the
            waiting mode, its requests recomputed.
        max_outage: seconds the scheduler keeps trying again while the server cannot be
            reached, is in its grace period or has lost the pool
            (``KVCOORD_MAX_OUTAGE``, default 600); then the error reaches vLLM.
        cluster: the ``[cluster] name`` of the replica set ``target`` names
            (``KVCOORD_CLUSTER``, default none): every call names it, so a server of
            another cluster, or of none, at one of its addresses refuses the call
            (``KVCoordClient``'s ``cluster``).
    """

    target: str
    pool: str = "vllm"
    token: str | None = dataclasses.field(default=None, repr=False)  # a secret: never printed
    create_pool: bool = True
    timeout: float = 10.0
    client_name: str = ""
    exclusive: bool = True
    predict: bool = True
    max_outage: float = 600.0
    cluster: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        e = os.environ if env is None else env
        target = e.get("KVCOORD_TARGET", "")
        if not target:
            raise ValueError("KVCOORD_TARGET is not set: give the kvcoord server's host:port")
        return cls(
            target=target,
            pool=e.get("KVCOORD_POOL", "vllm") or "vllm",
            token=e.get("KVCOORD_TOKEN") or None,
            create_pool=e.get("KVCOORD_CREATE_POOL", "1").lower() not in ("0", "false", "no"),
            timeout=float(e.get("KVCOORD_TIMEOUT", "10")),
            client_name=e.get("KVCOORD_CLIENT_NAME", "") or f"{os.uname().nodename}:{os.getpid()}",
            exclusive=e.get("KVCOORD_EXCLUSIVE", "1").lower() not in ("0", "false", "no"),
            predict=e.get("KVCOORD_PREDICT", "1").lower() not in ("0", "false", "no", ""),
            max_outage=float(e.get("KVCOORD_MAX_OUTAGE", "600")),
            cluster=e.get("KVCOORD_CLUSTER", "").strip(),
        )


def find_pool(c: KVCoordClient, settings: Settings, expected: pb.PoolConfig) -> pb.PoolConfig:
    """Create the pool (when ``settings`` allow it and it does not exist) and return its
    configuration.

    Raises:
        PoolMismatchError: the pool exists with other settings (each difference named,
            the semantics profile included).
    """
    if settings.create_pool:
        try:
            c.create_pool(settings.pool, expected)
        except AlreadyExistsError:
            pass  # a different pool of that name: compared (and refused) below
    actual = c.get_pool(settings.pool).pool.config
    diffs = pool_config_differences(expected, actual)
    want, got = expected.profile or "vllm-0.16", actual.profile or "vllm-0.16"
    if want != got:
        diffs.append(f"profile: engine expects {want!r}, pool has {got!r}")
    if diffs:
        raise PoolMismatchError(settings.pool, diffs)
    return actual


def connect(
    settings: Settings,
    kv_cache_config: Any,
    vllm_config: Any,
    *,
    log_stats: bool = True,
    client: KVCoordClient | None = None,
) -> KVCoordKVCacheManager:
    """Create or find the pool, check it matches the engine, attach, wrap.

    Args:
        settings: where the pool is.
        kv_cache_config, vllm_config, log_stats: the engine's, as its scheduler gets them.
        client: an existing client to use (else one is opened from ``settings``).

    Raises:
        PoolMismatchError: the pool exists with other settings (each difference named).
        RandomSeedError: prefix caching is on and ``PYTHONHASHSEED`` is not set.
        KVCoordError: the server refused or could not be reached.
    """
    expected = pool_config_from_vllm(kv_cache_config, vllm_config, log_stats=log_stats)
    return attach_manager(
        settings, expected, kv_cache_config, client,
        ManagerKinds(PredictingKVCacheManager, RemoteKVCacheManager, KVCoordKVCacheManager),
    )  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class ManagerKinds:
    """The classes :func:`attach_manager` builds for one vLLM release: the predicted
    session, the waiting one, the vLLM-facing adapter, and keyword arguments both
    sessions take (the release's handshake)."""

    predicting: Callable[..., Any]
    remote: Callable[..., Any]
    adapter: Callable[[Any, Any], KVCoordKVCacheManager]
    handshake: dict[str, Any] = dataclasses.field(default_factory=dict)


def attach_manager(
    settings: Settings,
    expected: pb.PoolConfig,
    kv_cache_config: Any,
    client: KVCoordClient | None,
    kinds: ManagerKinds,
) -> KVCoordKVCacheManager:
    """Create or find the pool ``expected`` describes, attach (predicted when
    ``settings`` allow it and the server gives a state this client can mirror, else
    waiting for the server), and wrap in the release's adapter.

    Raises:
        PoolMismatchError, RandomSeedError, KVCoordError: as :func:`connect`.
    """
    if expected.enable_caching and not expected.hash_seed:
        raise RandomSeedError(
            "PYTHONHASHSEED is not set: vLLM then hashes blocks with a random seed no other "
            "process shares; set it (to the same value) for the engine"
        )
    own = client is None
    c = (
        client
        if client is not None
        else KVCoordClient(
            settings.target, timeout=settings.timeout, token=settings.token, cluster=settings.cluster
        )
    )
    # The pool's block ids are slots of this engine's KV memory, so the engine's own pool
    # (KVCOORD_EXCLUSIVE=1) caches only what that memory holds: every Attach, this
    # process's first (its memory holds nothing) and each after a loss (its worker may
    # have written blocks the server never heard of), resets the prefix cache with the
    # session's start. A shared pool's cached blocks are every engine's: read as they are.
    common = {
        "hash_seed": expected.hash_seed, "client_name": settings.client_name,
        "reset_at_attach": settings.exclusive, **kinds.handshake,
    }  # fmt: skip
    if not settings.exclusive:
        logger.info(
            "KVCOORD_EXCLUSIVE=0: pool %r is shared, its cached blocks read as they are (not reset at "
            "Attach): the engines sharing it must share the KV memory its block ids name",
            settings.pool,
        )
    try:
        find_pool(c, settings, expected)
        remote: Any = None
        # Prediction needs the pool to itself: with KVCOORD_EXCLUSIVE=0 the engine shares
        # it and waits for the server, as asked (no warning: nothing is missing).
        why: str | None = None
        if settings.predict and settings.exclusive:
            try:
                remote = kinds.predicting(c, settings.pool, **common)
            except (FailedPreconditionError, ResourceExhaustedError) as err:
                if isinstance(err, PoolBusyError) or (
                    isinstance(err, ResourceExhaustedError) and err.reason != "ANSWER_TOO_LARGE"
                ):
                    raise
                why = err.message  # the server gives no state for this pool (or not in one answer)
        exclusive = settings.exclusive
        if why is not None:
            # Never wrong, and loud: the client's own arithmetic would be a second copy of
            # the rules (and, against another release's engine, possibly not the server's),
            # so the engine waits for the server's answer to every call, as on a shared pool.
            logger.warning(
                "KVCOORD_PREDICT: pool %r is not predicted (%s); running the waiting mode: every "
                "call is answered by the server, as on a shared pool",
                settings.pool,
                why,
            )
            exclusive = False
        if remote is None:
            remote = kinds.remote(c, settings.pool, exclusive=exclusive, **common)
    except BaseException:
        if own:
            c.close()
        raise
    manager = kinds.adapter(remote, kv_cache_config)
    manager.owned_client = c if own else None
    # a pool that can no longer be predicted mid-run (a rolling upgrade to another engine)
    # goes on waiting for the server, as one that cannot be predicted from the start
    manager.go_on_waiting_with(functools.partial(kinds.remote, c, settings.pool, exclusive=False, **common))
    if settings.create_pool:
        manager.pool_to_create = (settings.pool, expected)
    return manager
