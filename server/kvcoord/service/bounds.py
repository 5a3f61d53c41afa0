"""Input bounds: the longest string and the longest list every request may carry.

Every string, bytes and repeated field of every request message has a bound in
:data:`BOUNDS`, keyed ``"Message.field"`` (a list's elements: ``"Message.field[]"``).
A bound is a number, or the name of a ``[limits]`` setting (``Limits`` attribute). A
request past one is refused with INVALID_ARGUMENT naming the field, its length and the
bound, before any handler sees it, so nothing changes. docs/input-bounds.md lists the
same table (a test keeps them equal).

Why: gRPC's ``max_message_bytes`` bounds a message, not what the server keeps from it.
Idempotency keys, request ids, client and LoRA names are kept (the idempotency store,
the engine, sessions, events, the journal), so one 4 MiB key per call would grow the
server by megabytes each time. Lists that name requests are bounded like a Step's
operations; token and hash lists like one request's tokens.

A few fields are bounded elsewhere (:data:`ELSEWHERE`, in the table too):
``StepRequest.ops`` by ``max_ops_per_step`` (RESOURCE_EXHAUSTED, pool_service.py); an
``AllocateRunOp``'s and a ``DecodeOp``'s per-entry columns by their ``request_ids`` (each needs one value per
entry); its token and hash columns (every entry's appends together) by the message
size only (a DecodeOp's tokens, by ``max_tokens_per_request`` too, checked before any
column is read), each entry's share then checked against the pool's ``max_model_len``; and
each appended block hash by the engine (a pool with caching takes exactly its hash
length, one without ignores hashes).

Plain Python over protobuf descriptors; no gRPC types beyond the status code.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor

from .bound_checkers import SIZE_FIRST_ITEMS, TooLong, compile_checkers, is_repeated, request_messages
from .errors import ServiceError, Status

__all__ = [
    "BOUNDS",
    "check_request_slices",
    "fields_of",
    "ELSEWHERE",
    "MAX_ABANDONED_CALLS",
    "MAX_CLIENT_NAME_LENGTH",
    "MAX_IDEMPOTENCY_KEY_LENGTH",
    "MAX_NAME_LENGTH",
    "MAX_REQUEST_ID_LENGTH",
    "SIZE_FIRST_ITEMS",
    "check_request",
    "request_fields",
]

#: pool and tenant names (the pool-name rule of registry.py allows 128 characters)
MAX_NAME_LENGTH = 128
#: idempotency keys (the client library sends 32 hex digits)
MAX_IDEMPOTENCY_KEY_LENGTH = 128
#: request ids (vLLM's are a prefix and a UUID: about 50 characters)
MAX_REQUEST_ID_LENGTH = 256
#: AttachRequest.client_name (host, pid) and LoRA names
MAX_CLIENT_NAME_LENGTH = 256
MAX_LORA_NAME_LENGTH = 256
#: session and server-instance ids (the server makes them: 32 and 16 hex digits)
MAX_SESSION_ID_LENGTH = 64
#: block hashes (sha256: 32 bytes; the engine then checks the exact length)
MAX_BLOCK_HASH_BYTES = 64
#: KV cache groups of a pool (vLLM's hybrid models have a few)
MAX_GROUPS = 256
#: calls a keyed call may name as given up on (``abandoned``): a client names those
#: of its session not yet carried by an answered call (a handful, after a failure)
MAX_ABANDONED_CALLS = 256

#: "Message.field" (or "Message.field[]" for a list's elements) -> its bound: the
#: longest length (characters, bytes, or items for a list) or a Limits attribute.
BOUNDS: Mapping[str, int | str] = {
    # names and ids
    "CreatePoolRequest.name": MAX_NAME_LENGTH,
    "GetPoolRequest.name": MAX_NAME_LENGTH,
    "DeletePoolRequest.name": MAX_NAME_LENGTH,
    "AttachRequest.pool": MAX_NAME_LENGTH,
    "FindLongestCacheHitRequest.pool": MAX_NAME_LENGTH,
    "AllocateRequest.pool": MAX_NAME_LENGTH,
    "FreeRequest.pool": MAX_NAME_LENGTH,
    "StepRequest.pool": MAX_NAME_LENGTH,
    "ResetPrefixCacheRequest.pool": MAX_NAME_LENGTH,
    "GetStatsRequest.pool": MAX_NAME_LENGTH,
    "InspectPoolRequest.pool": MAX_NAME_LENGTH,
    "WatchEventsRequest.pool": MAX_NAME_LENGTH,
    "CheckPoolRequest.pool": MAX_NAME_LENGTH,
    "ListSessionsRequest.pool": MAX_NAME_LENGTH,
    "HeartbeatRequest.pool": MAX_NAME_LENGTH,
    "DetachRequest.pool": MAX_NAME_LENGTH,
    "HeartbeatRequest.session_id": MAX_SESSION_ID_LENGTH,
    "DetachRequest.session_id": MAX_SESSION_ID_LENGTH,
    "AllocateRequest.session_id": MAX_SESSION_ID_LENGTH,
    "FreeRequest.session_id": MAX_SESSION_ID_LENGTH,
    "StepRequest.session_id": MAX_SESSION_ID_LENGTH,
    "ResetPrefixCacheRequest.session_id": MAX_SESSION_ID_LENGTH,
    "DeletePoolRequest.session_id": MAX_SESSION_ID_LENGTH,
    "Fence.instance_id": MAX_SESSION_ID_LENGTH,
    "Fence.position_tag": 16,  # positions.TAG_BYTES: a tag the server issued is never longer
    "AllocateRequest.idempotency_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "FreeRequest.idempotency_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "StepRequest.idempotency_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "ScorePoolsRequest.idempotency_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "AllocateRequest.abandoned": MAX_ABANDONED_CALLS,
    "FreeRequest.abandoned": MAX_ABANDONED_CALLS,
    "StepRequest.abandoned": MAX_ABANDONED_CALLS,
    "AbandonedCall.idempotency_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "AttachRequest.client_name": MAX_CLIENT_NAME_LENGTH,
    "AttachRequest.attach_key": MAX_IDEMPOTENCY_KEY_LENGTH,
    "AttachRequest.hash_algo": 32,
    "AttachRequest.hash_seed": 256,
    "AttachRequest.profile": 32,
    "LoRA.name": MAX_LORA_NAME_LENGTH,
    # requests
    "RequestSync.request_id": MAX_REQUEST_ID_LENGTH,
    "RequestSync.append_token_ids": "max_tokens_per_request",
    "RequestSync.append_block_hashes": "max_tokens_per_request",
    "RequestSync.cache_salt": 256,
    # (each item is one token or more; one digest per hash block of the prompt)
    "RequestSync.mm_items": "max_tokens_per_request",
    "MultiModalItem.identifier": 256,
    "RequestSync.prompt_embeds_digests": "max_tokens_per_request",
    "RequestSync.prompt_embeds_digests[]": 32,
    "FindLongestCacheHitRequest.block_hashes": "max_tokens_per_request",
    "FindLongestCacheHitRequest.block_hashes[]": MAX_BLOCK_HASH_BYTES,
    "ScorePoolsRequest.candidate_pools": "max_pools",
    "ScorePoolsRequest.candidate_pools[]": MAX_NAME_LENGTH,
    "ScorePoolsRequest.prompts": "max_pools",
    "HashedPrompt.hash_algo": 32,
    "HashedPrompt.hash_seed": 256,
    "HashedPrompt.profile": 32,
    "HashedPrompt.block_hashes": "max_tokens_per_request",
    "HashedPrompt.block_hashes[]": MAX_BLOCK_HASH_BYTES,
    "FreeRequest.request_ids": "max_ops_per_step",
    "FreeRequest.request_ids[]": MAX_REQUEST_ID_LENGTH,
    "InspectPoolRequest.request_ids": "max_ops_per_step",
    "InspectPoolRequest.request_ids[]": MAX_REQUEST_ID_LENGTH,
    "FreeOp.request_id": MAX_REQUEST_ID_LENGTH,
    "PreemptOp.request_id": MAX_REQUEST_ID_LENGTH,
    "GetBlockIdsOp.request_id": MAX_REQUEST_ID_LENGTH,
    "CommonPrefixOp.request_id": MAX_REQUEST_ID_LENGTH,
    "RecordPrefixCacheStatsOp.request_id": MAX_REQUEST_ID_LENGTH,
    "EstimateCachedTokensOp.request_id": MAX_REQUEST_ID_LENGTH,
    "DropBoundaryStateOffloadsOp.request_id": MAX_REQUEST_ID_LENGTH,
    "RecordBlocksForZeroingOp.request_id": MAX_REQUEST_ID_LENGTH,
    "DropUncomputedOp.request_id": MAX_REQUEST_ID_LENGTH,
    "GetNumBlocksToAllocateOp.request_id": MAX_REQUEST_ID_LENGTH,
    "AdmitOp.requests": "max_ops_per_step",
    "AllocateRunOp.request_ids": "max_ops_per_step",
    "AllocateRunOp.request_ids[]": MAX_REQUEST_ID_LENGTH,
    "AllocateRunOp.check_request_ids": "max_ops_per_step",
    "AllocateRunOp.check_request_ids[]": MAX_REQUEST_ID_LENGTH,
    "DecodeOp.request_ids": "max_ops_per_step",
    "DecodeOp.request_ids[]": MAX_REQUEST_ID_LENGTH,
    # every entry's appends together: each entry's are at most max_model_len, and a
    # longer column was read whole (3.9M tokens: 220-900 ms) before that was checked
    "DecodeOp.append_token_ids": "max_tokens_per_request",
    "DecodeOp.packed_append_token_ids": "4 * max_tokens_per_request",
    # block ids
    "CacheHit.groups": MAX_GROUPS,
    "GetBlockIdsResult.groups": MAX_GROUPS,
    "AllocateOp.skip_zeroing_group_ids": MAX_GROUPS,
    "BlockIds.block_ids": "max_blocks_per_pool",
    "EvictBlocksOp.block_ids": "max_blocks_per_pool",
    "ReleaseRetainedBlocksOp.block_ids": "max_blocks_per_pool",
    # pool configurations
    "PoolConfig.groups": MAX_GROUPS,
    "PoolConfig.eagle_group_ids": MAX_GROUPS,
    "PoolConfig.hash_algo": 32,
    "PoolConfig.hash_seed": 256,
    "PoolConfig.profile": 32,
    "PoolConfig.shared_cache_tenants": 1024,
    "PoolConfig.shared_cache_tenants[]": MAX_NAME_LENGTH,
    "FullAttentionSpec.dtype": 64,
    "SlidingWindowSpec.dtype": 64,
    "ChunkedLocalAttentionSpec.dtype": 64,
    "CrossAttentionSpec.dtype": 64,
    "MambaSpec.mamba_cache_mode": 16,
    "MambaSpec.shape_dims": 16,
    "MambaSpec.dtypes": 16,
    "MambaSpec.dtypes[]": 64,
}

#: an AllocateRunOp's and a DecodeOp's columns with one value per entry
_ENTRY_COLUMNS = (
    "base_num_tokens",
    "base_num_hashes",
    "num_computed_tokens",
    "num_new_tokens",
    "num_lookahead_tokens",
    "num_append_tokens",
    "num_append_hashes",
)

#: lists bounded elsewhere (see the module docstring): field -> what bounds it
ELSEWHERE: Mapping[str, str] = {
    "StepRequest.ops": "max_ops_per_step (RESOURCE_EXHAUSTED)",
    **{f"AllocateRunOp.{name}": "one value per entry (request_ids)" for name in _ENTRY_COLUMNS},
    **{
        f"AllocateRunOp.{name}": "one value per check (check_request_ids)"
        for name in (
            "check_at",
            "check_num_computed_tokens",
            "check_num_new_tokens",
            "check_num_lookahead_tokens",
            "check_num_tokens",
        )  # fmt: skip
    },
    **{f"DecodeOp.{name}": "one value per entry (request_ids)" for name in _ENTRY_COLUMNS},
    "DecodeOp.append_block_hashes": "max_message_bytes",
    "AllocateRunOp.append_token_ids": "max_message_bytes",
    "AllocateRunOp.append_block_hashes": "max_message_bytes",
    # a pool with caching on takes hashes of exactly its hash length, one without ignores them
    "RequestSync.append_block_hashes[]": "the pool's hash length (engine)",
    "AllocateRunOp.append_block_hashes[]": "the pool's hash length (engine)",
    "DecodeOp.append_block_hashes[]": "the pool's hash length (engine)",
    # the packed form of a DecodeOp's columns (one bytes field each, read in one call)
    **{f"DecodeOp.packed_{name}": "4 bytes per entry (request_ids)" for name in _ENTRY_COLUMNS},
    "DecodeOp.packed_append_block_hashes": "max_message_bytes",
}


def request_fields() -> list[tuple[str, FieldDescriptor]]:
    """Every string, bytes and list field of every message a request can contain, as
    ("Message.field", descriptor)."""
    text = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)
    return [
        (f"{d.name}.{f.name}", f)
        for d in request_messages()
        for f in d.fields
        if is_repeated(f) or f.type in text
    ]


_CHECKERS = compile_checkers(BOUNDS, ELSEWHERE)


def check_request(request: Any, limits: Any) -> None:
    """Check every bounded field of a request message (any Allocator request type).

    Args:
        request: the parsed request.
        limits: the server's ``Limits`` (bounds named after its settings read them).

    Raises:
        ServiceError: INVALID_ARGUMENT naming the first field past its bound.
    """
    check = _CHECKERS.get(request.DESCRIPTOR.full_name)
    if check is None:
        return
    try:
        check(request, limits)
    except TooLong as exc:
        setting = f" ([limits] {exc.setting})" if exc.setting else ""
        raise ServiceError(
            Status.INVALID,
            f"{exc.path.lstrip('.')} is {exc.size:,} {exc.unit} long; the longest accepted is "
            f"{exc.bound:,}{setting} (docs/input-bounds.md); nothing was changed",
        ) from None


def fields_of(request: Any, keep: Callable[[FieldDescriptor], bool]) -> Any:
    """A new message of ``request``'s type holding the fields ``keep`` is true of."""
    shell = type(request)()
    for fd, value in request.ListFields():
        if not keep(fd):
            continue
        if is_repeated(fd):
            getattr(shell, fd.name).extend(value)
        elif fd.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(shell, fd.name).CopyFrom(value)
        else:
            setattr(shell, fd.name, value)
    return shell


_OPS_PATH = re.compile(r"^ops\[(\d+)\]")


def check_request_slices(request: Any, limits: Any, every: int) -> Iterator[None]:
    """:func:`check_request` yielding after every ``every`` operations of a Step (a
    request with more: the rest of it first, then its operations a slice at a time), so
    that a 65,536-operation Step does not hold the event loop while it is checked.

    Raises:
        ServiceError: as :func:`check_request`, naming the same field.
    """
    fields = request.DESCRIPTOR.fields_by_name
    if "ops" not in fields or len(request.ops) <= every:
        check_request(request, limits)
        return
    check_request(fields_of(request, lambda fd: fd.name != "ops"), limits)
    ops = request.ops
    for k in range(0, len(ops), every):
        yield
        part = type(request)(ops=ops[k : k + every])
        try:
            check_request(part, limits)
        except ServiceError as exc:  # the part's operation i is the request's k + i
            message = _OPS_PATH.sub(lambda m: f"ops[{k + int(m.group(1))}]", exc.message)  # noqa: B023
            raise ServiceError(exc.status, message, exc.reason) from None
