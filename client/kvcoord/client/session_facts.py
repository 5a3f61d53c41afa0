"""What both managers (:class:`~.manager.RemoteKVCacheManager` and
:class:`~.predicting.PredictingKVCacheManager`) report of their session, read from its
keeper and its Step sender, written once for both."""

from __future__ import annotations

from typing import Any

import grpc
from kvcoord.v1 import allocator_pb2 as pb

from . import _requests as rq
from .client import KVCoordClient
from .errors import FailedPreconditionError
from .hashing import pool_seed
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
    """The names of the configuration fields that differ (none: the same pool's)."""
    fields = {f.name for f, _ in was.ListFields()} | {f.name for f, _ in now.ListFields()}
    return sorted(name for name in fields if getattr(was, name) != getattr(now, name))


class SessionFacts:
    """The pool's settings both managers keep, the session's id and its lost requests;
    the class using it sets ``keeper`` and ``sender``."""

    keeper: SessionKeeper
    sender: StepSender

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
            try:
                self.client.detach(response.session_id, response.fence)
            finally:
                raise PoolChangedError(self.pool, changes)
        return response

    @property
    def session_id(self) -> str:
        return self.keeper.session_id

    @property
    def lost_requests(self) -> int:
        """Requests reported lost (RequestsLostError) since the manager was created."""
        return self.sender.lost_requests
