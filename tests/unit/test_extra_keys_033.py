"""vllm-0.33 pools publish a request's multimodal and prompt-embeds extra keys in
BlockStored.extra_keys (the client registers their sources with the request), through
the wire and a state export too. vLLM 0.33.0's own bytes: tests/with_vllm/test_kv_events.py."""

from __future__ import annotations

import hashlib

import cbor2
import pytest
from kvcoord.client.hashing import BlockHasher033, MultiModalItem, prompt_embeds_digests
from kvcoord.engine import BlockStored, FullAttentionSpec, InvalidArgumentError
from kvcoord.engine.extra_keys import EMPTY_EMBEDS_DIGEST, ExtraKeySources, event_extra_keys
from kvcoord.engine.state import export_state, import_state
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import event_from_pb, event_to_pb, extra_key_sources_from_pb, write_extra_key_sources
from support import Driver, toks

ITEMS = (MultiModalItem("img-a", 2, 5), MultiModalItem("img-b", 9, 8))


def _stored_keys(d: Driver) -> list[object]:
    return [k for e in d.pool.take_events() if isinstance(e, BlockStored) for k in e.extra_keys or ()]


def test_multimodal_items_and_salt_name_their_blocks() -> None:
    """Each block lists (identifier, item offset - block start) for every item it
    overlaps (an item begun earlier: a negative offset), after the LoRA-less, salted
    first block's salt order: items, then the salt."""
    d = Driver((FullAttentionSpec(4),), num_blocks=12, enable_kv_cache_events=True, profile="vllm-0.33")
    d.add("A", toks(1, 22), cache_salt="s", extra_key_sources=ExtraKeySources(ITEMS))
    assert d.pool.allocate_slots("A", 22) is not None
    assert _stored_keys(d) == [
        (("img-a", 2), "s"),
        (("img-a", -2),),
        (("img-b", 1),),
        (("img-b", -3),),
        (("img-b", -7),),
    ]


def test_prompt_embeds_digests_name_every_block_past_the_prompt_too() -> None:
    """A block inside the prompt names its digest (the client's, the same rule as the
    hash's extra keys); a block past the prompt the digest of no bytes."""
    rows = [bytes([i]) * 6 for i in range(9)]
    digests = prompt_embeds_digests(rows, 4)
    hasher = BlockHasher033("sha256_cbor", 4, b"\0" * 32, prompt_embeds=rows)
    hasher.extend([0] * 9)
    assert [hasher.block_extra_keys(i * 4, i * 4 + 4) for i in range(3)] == [
        (("prompt_embeds", x),) for x in digests
    ]
    d = Driver((FullAttentionSpec(4),), num_blocks=12, enable_kv_cache_events=True, profile="vllm-0.33")
    d.add("A", [0] * 9, extra_key_sources=ExtraKeySources(embeds_digests=digests))
    assert d.pool.allocate_slots("A", 9) is not None
    d.append("A", [5, 6, 7], 9)
    assert d.pool.allocate_slots("A", 3) is not None
    assert _stored_keys(d) == [(digests[0],), (digests[1],), (digests[2],)]
    assert digests[2] == hashlib.sha256(rows[8]).digest()
    d.append("A", [8, 9, 10, 11], 12)
    assert d.pool.allocate_slots("A", 4) is not None
    assert _stored_keys(d) == [(EMPTY_EMBEDS_DIGEST,)]


def test_sources_that_do_not_fit_the_prompt_are_refused() -> None:
    d = Driver((FullAttentionSpec(4),), num_blocks=12, enable_kv_cache_events=True, profile="vllm-0.33")
    with pytest.raises(InvalidArgumentError, match="want 1 to 3 sha256 digests"):
        d.add("A", [0] * 9, extra_key_sources=ExtraKeySources(embeds_digests=(EMPTY_EMBEDS_DIGEST,) * 4))
    with pytest.raises(InvalidArgumentError, match="want 1 to 3 sha256 digests"):
        d.add("A", [0] * 9, extra_key_sources=ExtraKeySources(embeds_digests=(b"short",)))
    with pytest.raises(InvalidArgumentError, match="sorted by offset"):
        d.add("B", [0] * 9, extra_key_sources=ExtraKeySources(tuple(reversed(ITEMS))))
    assert not d.pool.requests


def test_typed_keys_cross_the_wire_and_a_state_export() -> None:
    """Digests and (identifier, offset) pairs travel as typed EventExtraKey values
    (strings alone as before); the sources as RequestSync fields; a pool's pending
    events and requests survive its CBOR state."""
    event = BlockStored(
        (b"\1" * 32, b"\2" * 32), None, tuple(range(8)), 4, None, None,
        extra_keys=((("img", -3), "salt", b"\7" * 32), ("only", "strings")), group_idx=0,
    )  # fmt: skip
    message = event_to_pb(event)
    assert not message.block_stored.extra_keys[0].keys and len(message.block_stored.extra_keys[0].values) == 3
    assert list(message.block_stored.extra_keys[1].keys) == ["only", "strings"]
    assert event_from_pb(message) == event
    sources = ExtraKeySources(ITEMS, (b"\3" * 32,))
    sync = pb.RequestSync(request_id="A", new_request=True)
    write_extra_key_sources(sources, sync)
    assert extra_key_sources_from_pb(pb.RequestSync.FromString(sync.SerializeToString())) == sources
    assert extra_key_sources_from_pb(pb.RequestSync(request_id="A")) is None

    d = Driver((FullAttentionSpec(4),), num_blocks=12, enable_kv_cache_events=True, profile="vllm-0.33")
    d.add("A", toks(1, 22), extra_key_sources=ExtraKeySources(ITEMS))
    assert d.pool.allocate_slots("A", 22) is not None
    copy = import_state(d.config, cbor2.loads(cbor2.dumps(export_state(d.pool))))
    assert copy.take_events() == d.pool.take_events()
    assert copy.requests["A"].extra_key_sources == ExtraKeySources(ITEMS)


def test_event_keys_are_untagged() -> None:
    assert event_extra_keys(
        (("lora", "ad", "p"), ("mm", "x", 3), ("cache_salt", "s"), ("prompt_embeds", b"d"))
    ) == (
        "ad",
        ("x", 3),
        "s",
        b"d",
    )
    assert event_extra_keys(None) is None
