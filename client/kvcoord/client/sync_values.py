"""One request sync as plain values (:class:`SyncValues`): what a
:class:`~.tracking.RequestTracker` decides to send, before it is written into a
``RequestSync`` (the predicting mode applies it to its mirror first)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvcoord.engine.extra_keys import ExtraKeySources
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import write_extra_key_sources

__all__ = ["SyncValues"]


@dataclasses.dataclass(slots=True)
class SyncValues:
    """One request sync as plain values (what :meth:`write` puts in a ``RequestSync``):
    registration (``new_request``, with its LoRA, flags and salt) or the position it
    applies at, the appended tokens and block hashes, and the computed-token count
    (``None``: unchanged)."""

    request_id: str
    new_request: bool
    base_num_tokens: int
    base_num_hashes: int
    #: a registration's tokens are a :class:`HandedTokenIds`, made for the mirror's
    #: engine, which keeps that very list and appends the request's later tokens to
    #: it: only its first ``num_tokens`` are this sync's (:meth:`write` reads no more;
    #: ``None``: every one)
    tokens: Sequence[int] = ()
    num_tokens: int | None = None
    #: a registration's: the plain list its :class:`HandedTokenIds` was copied from in
    #: this very call (vLLM's own), for the mirror's one-pass wire check, which reads
    #: no list subclass (so it need not copy the tokens a second time); not kept
    source_tokens: list[int] | None = None
    hashes: Sequence[bytes] = ()
    computed: int | None = None
    lora: tuple[int, str] | None = None
    skip_reading_prefix_cache: bool = False
    num_preemptions: int = 0
    cache_salt: str = ""
    #: registering, fewer than every token registered: the prompt's length (registered
    #: again); a registered request's: its new prompt length (vLLM 0.33's cut of a
    #: streaming-input session grew it)
    num_prompt_tokens: int | None = None
    #: what a vllm-0.33 pool's events derive blocks' extra keys from (multimodal items,
    #: prompt-embeds digests)
    extra_key_sources: ExtraKeySources | None = None
    #: vLLM 0.33's kv_cache_report_mode "full" (a vllm-0.33 pool publishing events
    #: re-announces the request's hits)
    kv_cache_report_full: bool = False
    #: a rewind (:mod:`.rewinds`): the request's tokens past this many and its hashes
    #: from this many // hash_block_size on dropped before the append (``None``: none)
    rewind: int | None = None

    def write(self, into: pb.RequestSync) -> pb.RequestSync:
        into.request_id = self.request_id
        if self.new_request:
            into.new_request = True
            if self.lora is not None:
                into.lora.adapter_id, into.lora.name = self.lora
            into.skip_reading_prefix_cache = self.skip_reading_prefix_cache
            into.num_preemptions = self.num_preemptions
            if self.cache_salt:
                into.cache_salt = self.cache_salt
            if self.num_prompt_tokens is not None:
                into.num_prompt_tokens = self.num_prompt_tokens
            if self.extra_key_sources is not None:
                write_extra_key_sources(self.extra_key_sources, into)
            if self.kv_cache_report_full:
                into.kv_cache_report_full = True
        else:
            into.base_num_tokens = self.base_num_tokens
            into.base_num_hashes = self.base_num_hashes
            if self.rewind is not None:
                into.rewind_num_tokens = self.rewind
            if self.num_prompt_tokens is not None:
                into.num_prompt_tokens = self.num_prompt_tokens
        tokens = self.tokens
        if tokens:
            n = self.num_tokens
            # A registration's tokens are the very list the mirror's engine keeps and
            # the scheduler's thread appends to, and this may run on the sender's
            # thread: its first ``n`` are taken in one slice (a check of its length
            # and then the list itself would send a token appended in between).
            into.append_token_ids.extend(tokens if n is None else tokens[:n])
        if self.hashes:
            into.append_block_hashes.extend(self.hashes)
        if self.computed is not None:
            into.num_computed_tokens = self.computed
        return into
