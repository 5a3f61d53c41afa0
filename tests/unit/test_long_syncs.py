"""A long AllocateOp's tokens are read in slices (long_syncs.py), the operation read
being the one convert.allocate_from_pb gives, its other fields included."""

from __future__ import annotations

import pytest
from kvcoord.engine import HandedTokenIds
from kvcoord.service import long_syncs
from kvcoord.service.convert import allocate_from_pb
from kvcoord.v1 import allocator_pb2 as pb
from support import drive


def _drive(a: pb.AllocateOp) -> tuple[object, int]:
    return drive(long_syncs.allocate_in_slices(a, 1))


def _ops(n: int) -> list[pb.AllocateOp]:
    tokens = [(k * 7919) % 50_000 for k in range(n)]
    new = pb.RequestSync(
        request_id="r", new_request=True, append_token_ids=tokens, append_block_hashes=[b"h" * 8] * 9_000,
        lora=pb.LoRA(adapter_id=3, name="x"), cache_salt="salt", num_prompt_tokens=n - 1,
        num_preemptions=2, skip_reading_prefix_cache=True,
    )  # fmt: skip
    positioned = pb.RequestSync(
        request_id="r", append_token_ids=tokens, base_num_tokens=5, num_computed_tokens=9
    )
    return [
        pb.AllocateOp(request=new, num_new_tokens=n),
        pb.AllocateOp(request=new, num_new_tokens=n, lookup=True, must_succeed=True, num_lookahead_tokens=4),
        pb.AllocateOp(
            request=positioned, num_new_tokens=7, num_external_computed_tokens=16, delay_cache_blocks=True
        ),
    ]


@pytest.mark.parametrize("k", range(3))
def test_a_long_operation_read_in_slices_is_read_at_once(k: int) -> None:
    n = long_syncs.LONG_SYNC_TOKENS + 12_345
    a = _ops(n)[k]
    got, yields = _drive(a)
    want = allocate_from_pb(a, 1)
    assert got == want
    assert type(got.sync.append_token_ids) is HandedTokenIds  # type: ignore[attr-defined]
    hashes = len(a.request.append_block_hashes)
    assert yields == -(-n // long_syncs.TOKENS_SLICE) + -(-hashes // long_syncs.HASHES_SLICE)


def test_a_short_operation_is_read_at_once() -> None:
    a = _ops(1_000)[0]
    assert _drive(a) == (allocate_from_pb(a, 1), 0)
