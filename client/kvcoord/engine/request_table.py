"""The request table: what a remote pool keeps of each request the scheduler runs.

In vLLM the scheduler owns ``Request`` objects and hands them to the manager. A
remote pool cannot see the scheduler's objects, so it keeps the fields the manager
reads (token ids, block hashes, computed-token count, LoRA, flags) per request id,
and the client reports changes. :class:`RequestTable` holds those records and checks
every change before applying it; it knows nothing of blocks (the pool does).

Validation costs O(delta): what a request already holds was checked when it arrived,
so a decode step costs the same whatever the request's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from ._mypyc import mypyc_attr
from .config import KVCacheConfig
from .errors import InvalidArgumentError, RequestExistsError, RequestNotFoundError
from .extra_keys import ExtraKeySources, MultiModalItem
from .hash_list import NAMESPACE_PREFIX_BYTES
from .request import LoRA, Request
from .results import RequestCheckpoint
from .types import RequestId

__all__ = ["BytesHashes", "HandedTokenIds", "RequestTable", "TokenIds", "check_count"]


def check_count(value: object, name: str) -> int:
    """``value`` once it is a non-negative ``int`` (``bool`` is refused).

    Raises:
        InvalidArgumentError: naming ``name`` and what was wrong.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(f"{name} must be an integer, got {type(value).__name__}")
    if value < 0:
        raise InvalidArgumentError(f"{name} must be >= 0, got {value}")
    return value


@mypyc_attr(native_class=False)  # a list: mypyc compiles no subclass of one
class TokenIds(list[int]):
    """Token ids their maker guarantees are non-negative ``int``s, such as those read
    from a ``uint32`` wire field: :meth:`RequestTable.check_tokens` copies such a list
    without checking each element again (only the total length is checked)."""

    __slots__ = ()


@mypyc_attr(native_class=False)  # a list: mypyc compiles no subclass of one
class HandedTokenIds(TokenIds):
    """:class:`TokenIds` handed over by their maker, which keeps no reference to the
    list and never changes it again: :meth:`RequestTable.check_tokens` then keeps this
    very list instead of a copy (copying a 1,048,576-token prompt took 7-18 ms of one
    call). Made only for the one call it is given to."""

    __slots__ = ()


@mypyc_attr(native_class=False)  # a list: mypyc compiles no subclass of one
class BytesHashes(list[bytes]):
    """Block hashes their maker guarantees are each an exact ``bytes`` (not a subclass,
    not another buffer), such as the client tracker's (:func:`kvcoord.client.token_lists.as_bytes`
    makes every one ``bytes`` with its own type pass): :meth:`RequestTable.check_hashes`
    then skips its type pass, so a registration's hashes have their types checked once,
    not twice. Their count and length are still checked (the maker knows neither rule)."""

    __slots__ = ()


class RequestTable:
    """The pool's requests by id, with the checks that keep each one consistent.

    Invariants of every record: ``all_token_ids`` holds at most ``max_model_len``
    non-negative ints; ``block_hashes`` holds exactly one non-empty ``bytes`` hash (of
    the configured length) per full ``hash_block_size`` block of those tokens when
    caching is on, and nothing when it is off.

    The pool composes a table and shares its :attr:`requests` dict (the hot paths
    read it directly); the dict object lives as long as the table and is never
    replaced.

    Args:
        config: the pool's validated layout (limits, hash block size and length).
    """

    def __init__(self, config: KVCacheConfig) -> None:
        self.requests: dict[str, Request] = {}
        self.max_model_len = config.max_model_len
        self.enable_caching = config.enable_caching
        self.hash_block_size = config.hash_block_size
        self.hash_length = config.hash_length
        #: vllm-0.33 look-ahead hashes: a block's hash exists once this many more tokens do
        self.hash_lag = config.num_hash_lookahead_tokens
        #: cache namespace name -> its key prefix, assigned in order of first use
        self.cache_namespaces: dict[str, bytes] = {}
        #: every group's block is one hash block (prompt-embeds digests are per hash block)
        self.one_block_size = all(g.block_size == config.hash_block_size for g in config.groups)

    def namespace_prefix(self, name: str) -> bytes:
        """The key prefix of cache namespace ``name`` (``b""`` for ``""``).

        Prefixes are 4 bytes, distinct per name and assigned in order of first use, so
        the same calls in the same order give the same prefixes (exact replay).

        Raises:
            InvalidArgumentError: a namespace on a caching pool without a fixed hash
                length (keys of two namespaces could then coincide).
        """
        if not name:
            return b""
        prefix = self.cache_namespaces.get(name)
        if prefix is None:
            if not isinstance(name, str):
                raise InvalidArgumentError("cache_namespace must be a string")
            if self.enable_caching and self.hash_length is None:
                raise InvalidArgumentError(
                    "cache namespaces need the pool's hash_length (every hash the same length)"
                )
            prefix = self.cache_namespaces[name] = (len(self.cache_namespaces) + 1).to_bytes(
                NAMESPACE_PREFIX_BYTES, "big"
            )
        return prefix

    def check_extra_key_sources(self, sources: ExtraKeySources, num_prompt_tokens: int) -> None:
        """Raises InvalidArgumentError unless ``sources`` fit a prompt of this length."""
        if not isinstance(sources, ExtraKeySources):
            raise InvalidArgumentError("extra_key_sources must be an ExtraKeySources")
        end = 0
        for item in sources.mm_items:
            if not isinstance(item, MultiModalItem) or not isinstance(item.identifier, str):
                raise InvalidArgumentError(f"multimodal item {item!r}: not a MultiModalItem")
            if (
                check_count(item.offset, "mm item offset") < end
                or check_count(item.length, "mm item length") < 1
            ):
                raise InvalidArgumentError(
                    "multimodal items must be sorted by offset, not overlapping, each one token or more"
                )
            end = item.offset + item.length
        digests = sources.embeds_digests
        if digests is None:
            return
        # (a request registered again after a free counts its outputs as prompt: the
        # embeddings cover only the first tokens)
        most = -(-num_prompt_tokens // self.hash_block_size)
        if not 0 < len(digests) <= most or not all(isinstance(d, bytes) and len(d) == 32 for d in digests):
            raise InvalidArgumentError(
                f"prompt-embeds digests: want 1 to {most} sha256 digests (one per hash block starting "
                f"in the embedded prompt, of {num_prompt_tokens} tokens at most), got {len(digests)}"
            )
        if self.enable_caching and not self.one_block_size:
            raise InvalidArgumentError(
                "prompt-embeds digests are per hash block: a pool with a group whose block is not "
                "one hash block cannot publish its blocks' keys"
            )

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        lora: LoRA | None,
        skip_reading_prefix_cache: bool,
        num_preemptions: int,
        cache_namespace: str = "",
        cache_salt: str | None = None,
        extra_key_sources: ExtraKeySources | None = None,
        num_prompt_tokens: int | None = None,
        kv_cache_report_full: bool = False,
    ) -> None:
        """Register a request with its prompt and the prompt's block hashes (in cache
        namespace ``cache_namespace``: see :meth:`KVCachePool.add_request`).

        Raises:
            RequestExistsError: the id is in use.
            InvalidArgumentError: bad id, tokens, hashes or LoRA, or an empty prompt.
        """
        if not isinstance(request_id, str) or not request_id:
            raise InvalidArgumentError("request_id must be a non-empty string")
        if request_id in self.requests:
            raise RequestExistsError(f"request {request_id!r} already exists in this pool")
        tokens = self.check_tokens(prompt_token_ids, 0, "prompt_token_ids")
        if not tokens:
            raise InvalidArgumentError(
                f"request {request_id!r}: prompt_token_ids is empty; a request needs at least one token"
            )
        hashes = self.check_hashes(block_hashes, 0, len(tokens), f"request {request_id!r}")
        if lora is not None and (
            not isinstance(lora, LoRA) or check_count(lora.adapter_id, "lora.adapter_id") < 0
        ):
            raise InvalidArgumentError("lora must be a LoRA(adapter_id, name)")
        if not isinstance(skip_reading_prefix_cache, bool):
            raise InvalidArgumentError("skip_reading_prefix_cache must be a bool")
        check_count(num_preemptions, "num_preemptions")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidArgumentError("cache_salt must be a string")
        if not isinstance(kv_cache_report_full, bool):
            raise InvalidArgumentError("kv_cache_report_full must be a bool")
        if num_prompt_tokens is None:
            num_prompt_tokens = len(tokens)
        elif not 0 < check_count(num_prompt_tokens, "num_prompt_tokens") <= len(tokens):
            raise InvalidArgumentError(
                f"request {request_id!r}: num_prompt_tokens {num_prompt_tokens} must be in "
                f"1..{len(tokens)} (the tokens registered)"
            )
        if extra_key_sources is not None:
            self.check_extra_key_sources(extra_key_sources, len(tokens))
        prefix = self.namespace_prefix(cache_namespace)
        self.requests[request_id] = Request(
            RequestId(request_id),
            tokens,
            hashes,
            num_preemptions=num_preemptions,
            lora=lora,
            skip_reading_prefix_cache=skip_reading_prefix_cache,
            cache_prefix=prefix,
            cache_salt=cache_salt or None,
            num_prompt_tokens=num_prompt_tokens,
            extra_key_sources=extra_key_sources,
            kv_cache_report_full=kv_cache_report_full,
        )

    def update(
        self,
        request_id: str,
        num_computed_tokens: int | None,
        append_token_ids: Sequence[int],
        append_block_hashes: Sequence[bytes],
    ) -> None:
        """Set the computed-token count, then append tokens and the hashes of the blocks
        they completed; all checked before anything changes.

        Raises:
            RequestNotFoundError: unknown id.
            InvalidArgumentError: counts, tokens or hashes that do not fit.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        have = len(req.all_token_ids)
        new_tokens = self.check_tokens(append_token_ids, have, "append_token_ids")
        new_hashes = self.check_hashes(
            append_block_hashes, len(req.block_hashes), have + len(new_tokens), f"request {request_id!r}"
        )
        if num_computed_tokens is not None:
            if type(num_computed_tokens) is not int or num_computed_tokens < 0:
                check_count(num_computed_tokens, "num_computed_tokens")
            # Under speculative decoding the scheduler counts scheduled drafts as computed
            # before their tokens are appended, so the count may pass num_tokens.
            if num_computed_tokens > self.max_model_len:
                raise InvalidArgumentError(
                    f"num_computed_tokens {num_computed_tokens} exceeds max_model_len {self.max_model_len}"
                )
            req.num_computed_tokens = num_computed_tokens
        if new_tokens:
            req.all_token_ids += new_tokens
            if new_hashes:
                req.block_hashes += new_hashes

    def checkpoint(self, request_id: str) -> RequestCheckpoint | None:
        """The request's sizes now, for :meth:`restore` (``None`` for an unknown id)."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        return RequestCheckpoint(
            req.num_tokens, len(req.block_hashes), req.num_computed_tokens, req.num_prompt_tokens
        )

    def restore(self, request_id: str, checkpoint: RequestCheckpoint) -> None:
        """Cut the request back to ``checkpoint``'s sizes (a no-op for an unknown id).

        Only valid while no pool operation has run for the request since the
        checkpoint: updates only append, so truncating undoes them.
        """
        req = self.requests.get(request_id)
        if req is None:
            return
        del req.all_token_ids[checkpoint.num_tokens :]
        del req.block_hashes[checkpoint.num_block_hashes :]
        req.num_computed_tokens = checkpoint.num_computed_tokens
        if checkpoint.num_prompt_tokens is not None:
            req.num_prompt_tokens = checkpoint.num_prompt_tokens

    def get(self, request_id: str) -> Request:
        """The request's record.

        Raises:
            RequestNotFoundError: unknown id.
        """
        req = self.requests.get(request_id)
        if req is None:
            raise RequestNotFoundError(f"request {request_id!r} is not in this pool")
        return req

    def snapshot(self) -> tuple[tuple[object, ...], ...]:
        """Every record's fields as plain tuples, by request id."""
        return tuple(
            (
                r.request_id,
                tuple(r.all_token_ids),
                tuple(r.block_hashes),
                r.num_computed_tokens,
                r.num_preemptions,
                r.lora,
                r.skip_reading_prefix_cache,
                r.cache_prefix,
                r.cache_salt,
                r.num_prompt_tokens,
                r.shared_prefix_boundary,
                r.extra_key_sources,
                r.kv_cache_report_full,
            )
            for r in sorted(self.requests.values(), key=lambda r: r.request_id)
        )

    def check_tokens(self, tokens: Sequence[int], have: int, name: str) -> list[int]:
        """A copy of ``tokens`` once every one is a non-negative ``int`` (not bool) and
        ``have`` plus their count fits ``max_model_len``.

        Raises:
            InvalidArgumentError: naming ``name`` and the first bad token, or the total.
        """
        kind = type(tokens)
        out = cast(list[int], tokens) if kind is HandedTokenIds else list(tokens)  # (its maker let it go)
        n = len(out)
        if kind is TokenIds or kind is HandedTokenIds:
            ok = True  # checked by whoever made it (a uint32 wire field cannot be negative)
        elif n == 1:
            t = out[0]
            ok = type(t) is int and t >= 0
        else:
            # C-level passes: the set of element types, then the minimum.
            ok = not out or (set(map(type, out)) == {int} and min(out) >= 0)
        if not ok:
            bad = next(t for t in out if type(t) is not int or t < 0)
            raise InvalidArgumentError(f"{name} must hold non-negative integers, got {bad!r}")
        if have + n > self.max_model_len:
            raise InvalidArgumentError(
                f"the request would have {have + n} tokens, more than max_model_len {self.max_model_len}"
            )
        return out

    def check_hashes(self, hashes: Sequence[bytes], have: int, num_tokens: int, label: str) -> list[bytes]:
        """A copy of ``hashes`` once they are exactly the new full blocks' hashes: one
        per full ``hash_block_size`` block past ``have``, non-empty ``bytes`` of the
        pool's hash length (always ``[]`` when caching is off). With look-ahead hashes
        a block counts once the look-ahead tokens after it exist too.

        Raises:
            InvalidArgumentError: prefixed with ``label``: a wrong count, type or length.
        """
        if not self.enable_caching:
            return []
        typed = type(hashes) is BytesHashes
        # (a slice of a list subclass: one plain C copy, where list() iterates it)
        out = cast(list[bytes], hashes)[:] if typed else list(hashes)
        want = max(num_tokens - self.hash_lag, 0) // self.hash_block_size - have
        if len(out) != want:
            raise InvalidArgumentError(
                f"{label}: expected {want} new block hashes (one per full "
                f"block of {self.hash_block_size} tokens), got {len(out)}"
            )
        if not out:
            return out
        length = self.hash_length
        if len(out) == 1:  # a decode step completing a block
            h = out[0]
            if type(h) is bytes and h and (length is None or len(h) == length):
                return out
        # (C passes counting into lists: about a third cheaper than building sets)
        n = len(out)
        # (a BytesHashes' maker made the same type pass: every element is an exact bytes)
        if not typed and list(map(type, out)).count(bytes) != n:
            raise InvalidArgumentError("block hashes must be non-empty bytes")
        lengths = list(map(len, out))
        if length is not None and lengths.count(length) != n:
            bad = next(k for k in lengths if k != length)
            raise InvalidArgumentError(f"block hashes must be {length} bytes long, got one of {bad} bytes")
        if not length and 0 in lengths:  # (every one of a non-zero length is non-empty)
            raise InvalidArgumentError("block hashes must be non-empty bytes")
        return out
