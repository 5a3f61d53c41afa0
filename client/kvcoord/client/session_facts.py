"""What both managers (:class:`~.manager.RemoteKVCacheManager` and
:class:`~.predicting.PredictingKVCacheManager`) report of their session, read from its
keeper and its Step sender, written once for both."""

from __future__ import annotations

import dataclasses
from typing import Any, NoReturn

import grpc
from kvcoord.engine.config import KVCacheConfig
from kvcoord.engine.errors import InvalidArgumentError
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import config_from_pb

from . import _requests as rq
from .client import KVCoordClient
from .errors import FailedPreconditionError, KVCoordError
from .hashing import pool_seed
from .items import NO_ADMISSION, Admission
from .sender import StepSender
from .session import SessionKeeper
from .tracking import RequestTracker


class PoolChangedError(FailedPreconditionError):
    """The pool an Attach found is not configured as the one the manager was made for
    (deleted and created again, or a server restarted with other pools, under a running
    engine): its rules and the caller's KV memory may differ, so it is neither mirrored
    nor used, predicted or waiting (the session the Attach made is ended first). Never
    taken over by a waiting session: the engine was sized and checked for the old
    configuration; restart it.
    ``changes`` names the fields that differ."""

    def __init__(self, pool: str, changes: list[str]) -> None:
        super().__init__(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"pool {pool!r} was created again with another configuration ({', '.join(changes)} differ) since "
            "this manager was made for it: it is neither predicted nor used; restart the engine for it",
        )
        self.changes = changes


def pool_changes(was: pb.PoolConfig, now: pb.PoolConfig) -> list[str]:
    """The names of the configuration fields whose rules differ (none: the same pool's).

    A field is compared by what it decides, not how it is written: each engine field
    as the engine reads it (:func:`~kvcoord.wire.config_from_pb`: ``log_stats`` unset is
    on, ``profile`` empty is vllm-0.16, ``prefix_cache_retention_interval`` unset is 0,
    group specs as specs), ``shared_cache_tenants`` as a set, the hash settings as
    written. A pool written otherwise with the same rules (a server or a declaration
    filling a default explicitly, as in a rolling upgrade) is the same pool, not a
    re-created one. Fields this client does not know are not read at all (a newer
    server's: they never decided anything here). A configuration the engine would not
    take is compared as written."""
    fields = {f.name for f, _ in was.ListFields()} | {f.name for f, _ in now.ListFields()}
    differ = sorted(name for name in fields if _written(was, name) != _written(now, name))
    if not differ:
        return []
    try:
        rules = (config_from_pb(was), config_from_pb(now))
    except InvalidArgumentError:  # (WireError, ConfigError): every written difference counts
        return differ
    return [name for name in differ if _decides_otherwise(name, was, now, rules)]


def _written(cfg: pb.PoolConfig, name: str) -> tuple[bool, Any]:
    """Field ``name`` as written: whether it is set (an ``optional`` field's presence
    means something: log_stats unset is on, set false is off) and its value."""
    present = cfg.HasField(name) if cfg.DESCRIPTOR.fields_by_name[name].has_presence else True
    return present, getattr(cfg, name)


def _decides_otherwise(name: str, was: pb.PoolConfig, now: pb.PoolConfig, rules: tuple[Any, Any]) -> bool:
    """Whether field ``name``, written differently in ``was`` and ``now``, decides
    otherwise (``rules``: their engine configs)."""
    if name == "shared_cache_tenants":
        return set(was.shared_cache_tenants) != set(now.shared_cache_tenants)
    if name in _ENGINE_FIELDS:
        return bool(getattr(rules[0], name) != getattr(rules[1], name))
    return True  # hash_algo, hash_seed, and any field the engine does not read: as written


#: the PoolConfig fields the engine config holds under the same name
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(KVCacheConfig)) & frozenset(
    pb.PoolConfig.DESCRIPTOR.fields_by_name
)


class SessionFacts:
    """The pool's settings both managers keep, the session's id and its lost requests;
    the class using it sets ``keeper`` and ``sender``."""

    keeper: SessionKeeper
    sender: StepSender
    #: vLLM 0.33's admission inputs of the allocation being made (its adapter sets them
    #: around each allocate_slots; the allocation sends them and the mirror applies them)
    admission: Admission = NO_ADMISSION

    def _open(
        self, client: KVCoordClient, pool: str, hash_seed: str | None
    ) -> tuple[pb.PoolConfig, str | None]:
        """Read the pool's configuration and keep what both managers need of it; returns
        it and the hash seed workers hash with (see :func:`~.hashing.pool_seed`)."""
        self.client, self.pool = client, pool
        cfg = self.config = client.get_pool(pool).pool.config
        self.enable_caching = cfg.enable_caching
        self.log_stats = cfg.log_stats if cfg.HasField("log_stats") else True
        seed, none = pool_seed(cfg, hash_seed)
        self.tracker = RequestTracker(cfg, none)
        #: the key of the next Attach (AttachRequest.attach_key): see :meth:`_attach_once`
        self._attach_key = rq.key()
        #: allocate_slots calls answered None because the hit had gone stale (another
        #: worker reused its blocks after the lookup); the scheduler looks up again.
        self.stale_hits = 0
        return cfg, seed

    def _attach_once(self, *args: Any, **kwargs: Any) -> pb.AttachResponse:
        """``client.attach`` with this manager's attach key, kept until an Attach is
        answered: an Attach whose every answer was lost (its retries spent) made a
        session nobody holds, and the manager's next attempt, sent with the same key,
        gets that session (a new key would be refused POOL_EXCLUSIVE by it until its
        lease ran out). Once answered, the next Attach is another one: a new key (an
        old session still live must never be taken for a new one).

        Raises:
            PoolChangedError: the pool is configured otherwise than ``self.config`` (the
                pool the manager was made for, created again since): the session made is
                ended first.
        """
        kwargs["attach_key"] = self._attach_key
        response: pb.AttachResponse = self.client.attach(*args, **kwargs)
        self._attach_key = rq.key()
        if changes := pool_changes(self.config, response.pool.config):  # never used by the old rules
            self._unused(response, PoolChangedError(self.pool, changes))
        return response

    def _unused(self, response: pb.AttachResponse, why: KVCoordError) -> NoReturn:
        """End the session an Attach just made, which is not used, and raise ``why``
        (whatever the Detach answers: the session also ends with its lease)."""
        try:
            self.client.detach(response.session_id, response.fence)
        finally:
            raise why

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    @property
    def lost_requests(self) -> int:
        """Requests reported lost (RequestsLostError) since the manager was created."""
        return self.sender.lost_requests
