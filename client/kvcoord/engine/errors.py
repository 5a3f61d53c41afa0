"""Exceptions raised by the allocator engine.

Every error the engine raises on bad input derives from :class:`EngineError` and
names the status it deserves through :class:`ErrorStatus` (our own enum, so the
engine never imports gRPC), and, when the caller must act on it, the reason
(``reason``: the name of the proto's ``ErrorReason``). The service maps the status to
a gRPC code in one place; an exclusive session's mirror (``kvcoord.client.mirror``)
raises what the server answers from the same two values. An engine call that raises
has changed nothing.

Hierarchy::

    EngineError
    ├── InvalidArgumentError        malformed values (counts, hashes, ids)
    │   └── ConfigError             a KV cache configuration that cannot be served
    ├── RequestNotFoundError        unknown request id
    ├── RequestExistsError          request id already in use
    └── FailedPreconditionError     valid values, wrong state or order
        ├── StaleCacheHitError      a prefix hit whose blocks are no longer cached
        ├── UncountedBlocksError    vLLM's count lets an allocation through that
        │                           would run out of free blocks half way
        └── HitBlockTakenError      vLLM 0.16 would give a later group's hit block
                                    to an earlier group's external tokens too

Running out of free blocks is not an error: ``allocate_slots`` returns ``None``
(except where vLLM's own count misses blocks and vLLM raises half way:
:class:`UncountedBlocksError`).
"""

from __future__ import annotations

import enum

__all__ = [
    "BlockNotRetainedError",
    "ConfigError",
    "EngineError",
    "ErrorStatus",
    "FailedPreconditionError",
    "HintMismatchError",
    "HitBlockTakenError",
    "InvalidArgumentError",
    "RequestExistsError",
    "RequestNotFoundError",
    "StaleCacheHitError",
    "UncountedBlocksError",
]


class ErrorStatus(enum.Enum):
    """The kind of failure, independent of any transport."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"


class EngineError(Exception):
    """Base class of every error the engine raises on bad input."""

    status: ErrorStatus = ErrorStatus.INVALID_ARGUMENT
    #: the proto's ``ErrorReason`` name the refusal is answered with ("" for none)
    reason: str = ""


class InvalidArgumentError(EngineError):
    """A value is malformed or out of range."""

    status = ErrorStatus.INVALID_ARGUMENT


class ConfigError(InvalidArgumentError):
    """A KV cache configuration breaks a rule; the message names the rule."""


class RequestNotFoundError(EngineError):
    """The request id is not known to this pool."""

    status = ErrorStatus.NOT_FOUND
    #: a request, not the pool: a caller must not take it for a pool that is gone
    reason = "REQUEST_UNKNOWN"


class RequestExistsError(EngineError):
    """The request id is already registered in this pool."""

    status = ErrorStatus.ALREADY_EXISTS


class FailedPreconditionError(EngineError):
    """The call is well formed but not allowed in the current state."""

    status = ErrorStatus.FAILED_PRECONDITION


class StaleCacheHitError(FailedPreconditionError):
    """A prefix hit passed back to ``allocate_slots`` is no longer valid.

    Hits are hints: another request may have evicted the blocks between the lookup
    and the allocation. Look up again, or let the pool do both atomically.
    """


class HintMismatchError(FailedPreconditionError):
    """A lookup the client answered itself differs from the pool's own answer.

    Only a client that proves its answer from a hint (see ``KVCachePool.lookup_hint``)
    sends one; a mismatch means the proof was wrong and the client's decisions
    since then cannot be trusted.
    """


class BlockNotRetainedError(FailedPreconditionError):
    """A release names a block the pool does not retain for a copy-on-write pair (or
    more times than it does): releasing it would drop a reference a request or
    another pair holds. Nothing was released."""

    reason = "BLOCK_NOT_RETAINED"


class UncountedBlocksError(FailedPreconditionError):
    """An allocation vLLM's count lets through but whose blocks the pool does not have.

    A request's first allocation with external (KV connector) tokens in a pool with a
    mamba ``align`` group takes one block more than vLLM's ``get_num_blocks_to_allocate``
    counts (the state block of the external tokens' last position). With fewer free
    blocks than it takes, but enough for the count, vLLM 0.16.0 and 0.33.0 take blocks
    and then raise ``ValueError`` half way, the request left with a partial table. The
    pool refuses instead, before anything changes; the same call succeeds once that
    many blocks are free.
    """

    reason = "UNCOUNTED_BLOCKS"


class HitBlockTakenError(FailedPreconditionError):
    """An allocation after which one block would be held by two groups (vllm-0.16 pools).

    vLLM 0.16.0 adopts a first-use request's prefix hit and external (KV connector)
    tokens group by group: each group touches its own hit blocks, then takes blocks
    from the free queue's head for the external tokens. A later group's hit block that
    is free (evictable) and near the head is taken by the earlier group (its hash
    dropped) and then touched by its own group: one block in two groups' tables, two
    different KV contents written to it. vLLM 0.16.0 does exactly that, silently; the
    pool refuses instead, before anything changes. vLLM 0.24+ (the ``vllm-0.33``
    profile) touches every group's hit first and never hits the case.
    """

    reason = "HIT_BLOCK_TAKEN"
