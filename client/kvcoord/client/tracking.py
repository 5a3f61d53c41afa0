"""What the server holds of each request, and the positioned syncs that change it.

Each request the manager has sent is tracked by its position on the server (tokens
and hashes sent) and what queued operations will add. A sync names the position it
applies at; after the Step that carried it the position is committed, or rolled back
when the Step failed. Work per sync is proportional to what changed, never to the
request's history.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import grpc
from kvcoord.engine import HandedTokenIds
from kvcoord.engine.extra_keys import ExtraKeySources
from kvcoord.v1 import allocator_pb2 as pb

from .errors import InvalidArgumentError, KVCoordError, RequestsLostError
from .hashing import BlockHasher, MultiModalItem
from .rewinds import FIRST_LAST, changed, forget_after, keep_note, new_seen, note, note_token, rewind_point
from .sync_values import SyncValues
from .token_lists import as_bytes, token_list

__all__ = ["LostRequestInUseError", "RequestTracker", "SyncValues"]


class LostRequestInUseError(RequestsLostError):
    """A request reported lost is used as if it still held its blocks (the scheduler
    must preempt it: reset its computed tokens and start it again)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(
            [request_id],
            KVCoordError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"request {request_id!r} was reported lost; preempt it (computed tokens back to 0) "
                "before using it again",
                "REQUEST_LOST",
            ),
        )


@dataclasses.dataclass(slots=True)
class _Tracked:
    """``sent_*`` is the position the next sync applies at; ``committed`` what the
    server acknowledged. The hasher holds exactly the ``sent_tokens`` first tokens: a
    position moved back takes the hasher back with it, so the next sync hashes the
    request's own tokens from there (never tokens a refused or abandoned sync took)."""

    hasher: BlockHasher | None
    sent_tokens: int = 0
    sent_hashes: int = 0
    sent_computed: int = -1
    registered: bool = False
    committed: tuple[int, int, int, bool] = (0, 0, -1, False)
    #: the request object registered, and the list behind its tokens' read-only view
    #: (:func:`token_list`): :meth:`RequestTracker.sync_run` reads that list in place
    #: only while it is called with this very object
    request: Any = None
    tokens: list[int] | None = None
    #: per position sent (a token count), the last token, hash count and last hash (its
    #: very object) then sent, to see a rewind at the next sync: rings of the last notes,
    #: written in place (:func:`.rewinds.new_seen`)
    seen: list[Any] = dataclasses.field(default_factory=new_seen)
    seen_at: int = 0
    last_at: int = FIRST_LAST
    #: a rewind sent, not all committed since; ``uncertain``: the position moved back
    #: meanwhile, so the next sync rewinds whatever it sees (:mod:`.rewinds`)
    rewound: bool = False
    uncertain: bool = False
    #: the request's ``num_prompt_tokens`` as last sent (or registered), and as last
    #: committed: vLLM 0.33's streaming-input cut grows it, and the sync after carries
    #: it. A position moved back takes it back to the committed one (a sync carrying it
    #: may be lost): sent again, a value the server holds already changes nothing
    prompt: object = None
    prompt_committed: object = None
    #: the position the last sync carrying a rewind or a prompt length started at: a
    #: commit up to that mark may be the answer of a call before that sync (a prompt-only
    #: sync leaves the position as it found it), so it settles neither
    changed_from: tuple[int, int, int, bool] | None = None

    def commit(self) -> None:
        self.committed = (self.sent_tokens, self.sent_hashes, self.sent_computed, self.registered)
        self.rewound = False
        self.prompt_committed = self.prompt

    def restore(self, mark: tuple[int, int, int, bool]) -> None:
        """Back to ``mark`` (a position at or after the committed one)."""
        self.uncertain = self.uncertain or self.rewound
        self.sent_tokens, self.sent_hashes, self.sent_computed, self.registered = mark
        self.prompt = self.prompt_committed
        if self.hasher is not None:
            self.hasher.truncate(self.sent_tokens)
        keep_note(self)


class RequestTracker:
    """Positions of the requests one session has on the server.

    Args:
        config: the pool's configuration (hash settings).
        none_hash: the hash chain's seed (``b""`` when caching is off).
    """

    def __init__(self, config: pb.PoolConfig, none_hash: bytes) -> None:
        self.config = config
        self.enable_caching = config.enable_caching
        self.none_hash = none_hash
        self._tracked: dict[str, _Tracked] = {}
        #: requests reported lost (RequestsLostError) that the scheduler has not reset yet
        self.lost: set[str] = set()
        #: a first sync names the request's cache salt (a vllm-0.33 pool's events name it)
        self.name_salts = False
        #: a first sync carries what the request's blocks' event extra keys derive from
        #: (a vllm-0.33 pool publishing events of cached blocks: kvcoord.client.vllm033)
        self.extra_keys_of: Callable[[Any], ExtraKeySources | None] | None = None
        #: a first sync names the request's report mode when it is vLLM 0.33's "full"
        #: (a vllm-0.33 pool publishing events: kvcoord.client.vllm033)
        self.report_modes = False

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def sync(self, request: Any, into: pb.RequestSync | None = None) -> pb.RequestSync:
        """The sync bringing the server to the request's current state (registers a
        request the first time), written into ``into`` when given: the field of the
        operation that carries it, so a long prompt is not copied again."""
        return self.sync_values(request).write(pb.RequestSync() if into is None else into)

    def sync_values(self, request: Any) -> SyncValues:
        """:meth:`sync`'s values, not written into any message (the predicted mode
        applies them to its mirror at once and writes the message on its sender
        thread): the appended tokens and hashes are slices taken now."""
        rid = request.request_id
        t = self._tracked.get(rid)
        if t is None:
            if rid in self.lost:
                if int(request.num_computed_tokens):
                    # The scheduler still runs a request this client reported lost: its
                    # blocks are gone; registering it afresh would hand out a second
                    # table as if it were new blocks.
                    raise LostRequestInUseError(rid)
                self.lost.discard(rid)  # reset by the scheduler (preempted): a new start
            t = _Tracked(self._hasher(request))
            self._tracked[rid] = t
        tokens = request.all_token_ids
        given = getattr(request, "block_hashes", None)
        rewind = None
        if t.registered and t.hasher is None and changed(t, tokens, given):
            # cut back since its last sync (vLLM 0.33's streaming input): rewound
            rewind = rewind_point(
                rid, t, tokens, given, int(request.num_computed_tokens), self.config.hash_block_size
            )
        else:
            self._check_same(request, t)
        new = not t.registered
        raw = token_list(request) if new else None
        # (what may raise comes before the tracker moves: a failed call leaves it as it was)
        extra = self.extra_keys_of(request) if new and self.extra_keys_of is not None else None
        values = SyncValues(rid, new, t.sent_tokens, t.sent_hashes)
        before = (t.sent_tokens, t.sent_hashes, t.sent_computed, t.registered)
        prompt = getattr(request, "num_prompt_tokens", None)
        if not new and prompt != t.prompt and type(prompt) is int:
            values.num_prompt_tokens = prompt  # grown by vLLM 0.33's streaming-input cut
            t.changed_from = before
        t.prompt = prompt
        if rewind is not None:
            values.rewind = rewind
            t.rewound, t.uncertain = True, False
            t.changed_from = before
            t.sent_tokens, t.sent_hashes = rewind, min(t.sent_hashes, rewind // self.config.hash_block_size)
            forget_after(t, rewind)
        n = len(tokens)
        if n > t.sent_tokens:
            # a registration's prompt: copied once, into the list the mirror's engine keeps
            # (from vLLM's own list when it has one: one C copy, not an iteration of its view)
            if not t.sent_tokens:
                source = tokens if raw is None else raw
                values.tokens = HandedTokenIds(source)
                if type(source) is list:
                    values.source_tokens = source
            else:
                values.tokens = tokens[t.sent_tokens :]
            values.num_tokens = n - t.sent_tokens
            if self.enable_caching:
                hashes = self._new_hashes(request, t)
                if hashes:
                    values.hashes = hashes
                    t.sent_hashes += len(hashes)
            t.sent_tokens = n
        computed = int(request.num_computed_tokens)
        if computed != t.sent_computed:
            values.computed = computed
            t.sent_computed = computed
        if new:
            lora = getattr(request, "lora_request", None)
            if lora is not None:
                values.lora = (
                    int(getattr(lora, "lora_int_id", getattr(lora, "adapter_id", 0))),
                    str(getattr(lora, "lora_name", getattr(lora, "name", ""))),
                )
            values.skip_reading_prefix_cache = bool(getattr(request, "skip_reading_prefix_cache", False))
            values.num_preemptions = int(getattr(request, "num_preemptions", 0))
            if self.name_salts and getattr(request, "cache_salt", None):
                values.cache_salt = str(request.cache_salt)
            prompt = getattr(request, "num_prompt_tokens", None)
            if type(prompt) is int and 0 < prompt < n:
                values.num_prompt_tokens = prompt  # registered again after a preemption
            values.extra_key_sources = extra
            if self.report_modes:
                values.kv_cache_report_full = (
                    getattr(request, "kv_cache_report_mode", "incremental") == "full"
                )
            t.registered = True
            t.request, t.tokens = request, raw
        note(t, tokens, given)
        return values

    def sync_run(
        self, request: Any
    ) -> tuple[tuple[int, int, int, bool], int, int, Sequence[int], Sequence[bytes], int] | None:
        """What :meth:`sync` sends, as plain values for a run of allocations (an
        AllocateRunOp entry), with the request's position before it (its :meth:`mark`,
        to :meth:`restore` when the call fails): ``(mark, base_num_tokens,
        base_num_hashes, append_token_ids, append_block_hashes, num_computed_tokens)``;
        ``None`` (nothing changed here) for a request not registered yet, which needs a
        full sync."""
        t = self._tracked.get(request.request_id)
        if t is None or not t.registered:
            return None
        base_t, base_h = t.sent_tokens, t.sent_hashes
        mark = (base_t, base_h, t.sent_computed, True)
        tokens = t.tokens
        if tokens is None or t.request is not request:
            tokens = request.all_token_ids
        given = getattr(request, "block_hashes", None)
        if t.hasher is None and changed(t, tokens, given):
            return None  # a rewind: a full sync (never an entry of a run)
        if getattr(request, "num_prompt_tokens", None) != t.prompt:
            return None  # a prompt grown by a streaming-input cut: a full sync carries it
        n = len(tokens)
        if n < base_t or (base_t and t.hasher is not None):
            self._check_same(request, t)  # (with hashes given, only the length says anything)
        new_tokens: Sequence[int] = ()
        new_hashes: Sequence[bytes] = ()
        if n > base_t:
            new_tokens = tokens[base_t:]
            if self.enable_caching:
                if given is None:
                    new_hashes = self._new_hashes(request, t)
                    t.sent_hashes = base_h + len(new_hashes)
                elif len(given) > base_h:
                    new_hashes = as_bytes(given[base_h:])
                    t.sent_hashes = base_h + len(new_hashes)
            t.sent_tokens = n
        computed = request.num_computed_tokens
        if type(computed) is not int:
            computed = int(computed)
        t.sent_computed = computed
        note(t, tokens, given)
        return mark, base_t, base_h, new_tokens, new_hashes, computed

    def next_token(self, request: Any) -> tuple[int, int, int, int, int, bytes | None] | None:
        """A decode step's sync, the position moved: for a registered request read in
        place (:meth:`sync_run`'s case, the very object registered) whose only change
        since its last sync is one token appended and at most one block hash (vLLM's
        hashes; a ``bytes``), ``(base_num_tokens, base_num_hashes, the token,
        num_computed_tokens, the computed count before, the hash or None)``: what
        :meth:`sync_run` would give (its appended tokens the one token, its hashes that
        one or none; its mark ``(base_num_tokens, base_num_hashes, the count before,
        True)``); ``None`` for anything else, nothing changed (:meth:`sync_run` then)."""
        t = self._tracked.get(request.request_id)
        if t is None or t.request is not request or not t.registered or t.hasher is not None:
            return None
        tokens = t.tokens
        base_t = t.sent_tokens
        if tokens is None or len(tokens) != base_t + 1:
            return None
        try:
            prompt = request.num_prompt_tokens  # (read as an attribute: a builtin call costs more)
        except AttributeError:
            prompt = None
        if prompt != t.prompt:
            return None  # (a streaming session's prompt grew: sync_run tells)
        ring = t.seen
        at = t.seen_at
        if ring[at] != base_t or t.uncertain or tokens[base_t - 1] != ring[at + 1]:
            return None  # (maybe a rewind, or a position restored: sync_run tells)
        last = ring[ring[at + 3]]
        base_h = t.sent_hashes
        block_hash = None
        if self.enable_caching:
            given = request.block_hashes
            more = len(given) - base_h
            if more:
                if more != 1:
                    return None
                block_hash = given[base_h]
                if type(block_hash) is not bytes:
                    return None  # (sync_run makes it one)
            if base_h and given[base_h - 1] is not last:
                return None  # (maybe a rewind, or an equal hash: sync_run tells)
        computed = request.num_computed_tokens
        if type(computed) is not int:
            return None
        was = t.sent_computed
        t.sent_tokens = base_t + 1
        if block_hash is not None:
            t.sent_hashes = base_h + 1
        t.sent_computed = computed
        token = tokens[base_t]
        note_token(t, token, block_hash if block_hash is not None else last)
        return base_t, base_h, token, computed, was, block_hash

    def hashes(self, request: Any) -> Sequence[bytes]:
        """The request's block hashes as sent (a tracked request; empty when caching is
        off). Values may be any bytes-like type; nothing is copied."""
        given = getattr(request, "block_hashes", None)
        if given is not None:
            return given  # type: ignore[no-any-return]
        t = self._tracked.get(request.request_id)
        if t is None or t.hasher is None:
            return ()
        return t.hasher.block_hashes

    def position(self, request_id: str) -> pb.RequestSync:
        """A sync that changes nothing but names the request at its position."""
        sync = pb.RequestSync(request_id=request_id)
        t = self._tracked.get(request_id)
        if t is not None:
            sync.base_num_tokens, sync.base_num_hashes = t.sent_tokens, t.sent_hashes
        return sync

    def mark(self, request_id: str) -> tuple[int, int, int, bool] | None:
        """Where the request stands once what was synced so far is applied (taken right
        after building a call's sync: its commit then stops at that call, not at later
        calls of the same Step that may fail)."""
        t = self._tracked.get(request_id)
        return None if t is None else (t.sent_tokens, t.sent_hashes, t.sent_computed, t.registered)

    def commit(
        self, request_ids: Iterable[str], marks: dict[str, tuple[int, int, int, bool] | None] | None = None
    ) -> None:
        """The server applied these requests' syncs: up to each one's mark when given,
        else up to everything sent. A rewind or a prompt length sent is settled by a
        mark only when it is the position after that sync and not the one before it
        (the same position after a prompt-only sync: the earlier call's answer, while
        the sync carrying it may still fail); unsettled, a rollback sends it again
        (a value the server holds already changes nothing)."""
        for rid in request_ids:
            t = self._tracked.get(rid)
            if t is None:
                continue
            mark = marks.get(rid) if marks is not None else None
            if mark is None:
                t.commit()
            else:
                t.committed = mark
                if (
                    (t.rewound or t.prompt_committed != t.prompt)
                    and mark != t.changed_from
                    and mark == (t.sent_tokens, t.sent_hashes, t.sent_computed, t.registered)
                ):
                    t.rewound, t.prompt_committed = False, t.prompt

    def rollback(self, request_ids: Iterable[str] | None = None) -> None:
        """Positions back to what the server acknowledged (of these requests, or all).
        A request the server never acknowledged registering is forgotten with its
        hasher: nothing of it is on the server, and its id may come back as another
        request (another prompt, LoRA or salt)."""
        tracked = self._tracked
        ids = list(tracked) if request_ids is None else request_ids
        self.restore({rid: tracked[rid].committed for rid in ids if rid in tracked})

    def restore(self, marks: dict[str, tuple[int, int, int, bool] | None]) -> None:
        """Positions back to these marks (taken with :meth:`mark` before syncs that
        were never sent); a request not registered at its mark is forgotten."""
        tracked = self._tracked
        for rid, mark in marks.items():
            t = tracked.get(rid)
            if t is None:
                continue
            if mark is None or not mark[3]:
                del tracked[rid]
            else:
                t.restore(mark)

    def sent_computed(self, request_id: str) -> int:
        """The computed-token count last sent for the request (0: none, or untracked)."""
        t = self._tracked.get(request_id)
        return max(t.sent_computed, 0) if t is not None else 0

    def drop(self, request_id: str) -> bool:
        """Stop tracking one request (a free); whether it was tracked."""
        return self._tracked.pop(request_id, None) is not None

    def take(self, request_id: str) -> object | None:
        """:meth:`drop`, giving back what was tracked (``None``: nothing), for the caller
        to let go of where its deallocation costs the scheduler nothing (the request
        object and its token list let go of now: their lifetime stays the caller's)."""
        t = self._tracked.pop(request_id, None)
        if t is not None:
            t.request = t.tokens = None
        return t

    def forget(self, request_ids: Iterable[str], lost: bool = False) -> list[str]:
        """Stop tracking these requests; returns those that were tracked. With ``lost``
        they are remembered as lost until the scheduler resets them."""
        gone = [rid for rid in dict.fromkeys(request_ids) if self._tracked.pop(rid, None) is not None]
        if lost:
            self.lost.update(gone)
        return gone

    def clear(self) -> list[str]:
        """Forget every request, remembering them as lost (the session is gone)."""
        return self.forget(list(self._tracked), lost=True)

    @staticmethod
    def _check_same(request: Any, t: _Tracked) -> None:
        """Refuse a request that cannot be the one tracked under its id (checked in
        constant time: no fewer tokens than were sent, the last one sent unchanged).
        Its sync would extend the old request's hashes with the new tokens."""
        sent = t.sent_tokens
        if not sent:
            return
        tokens = request.all_token_ids
        hasher = t.hasher
        if len(tokens) < sent or (hasher is not None and tokens[sent - 1] != hasher.token_ids[sent - 1]):
            raise InvalidArgumentError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"request {request.request_id!r} is not the one sent under its id ({sent} tokens sent; it "
                f"has {len(tokens)}, or another token at position {sent - 1}): an id is used for another "
                "request while the pool still holds the first one; free it first",
            )

    def _hasher(self, request: Any) -> BlockHasher | None:
        if not self.enable_caching or getattr(request, "block_hashes", None) is not None:
            return None
        lora = getattr(request, "lora_request", None)
        items: Sequence[MultiModalItem] = getattr(request, "mm_items", ()) or ()
        return BlockHasher(
            self.config.hash_algo,
            self.config.hash_block_size,
            self.none_hash,
            lora_name=getattr(lora, "lora_name", getattr(lora, "name", None)) if lora else None,
            cache_salt=getattr(request, "cache_salt", None),
            mm_items=items,
        )

    @staticmethod
    def _new_hashes(request: Any, t: _Tracked) -> list[bytes]:
        """Hashes of blocks completed since the last sync (only those: no history copy)."""
        given = getattr(request, "block_hashes", None)
        if given is not None:
            return as_bytes(given[t.sent_hashes :])
        assert t.hasher is not None
        tokens = request.all_token_ids
        have = t.sent_tokens
        assert len(t.hasher.token_ids) == have, "the hasher holds exactly the tokens sent"
        if len(tokens) > have:
            t.hasher.extend(tokens[have:])
        return t.hasher.block_hashes[t.sent_hashes :]
