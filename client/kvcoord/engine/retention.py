"""vLLM 0.33's sliding-window retention: which of a window group's newly full blocks
get a hash (:func:`window_block_mask`), and the replay positions whose window tails
sparse retention keeps (:func:`replay_boundaries`)."""

from __future__ import annotations

from collections.abc import Sequence


def window_block_mask(
    window: int,
    block_size: int,
    scheduler_block_size: int,
    retention: int | None,
    num_cached: int,
    num_full: int,
    boundaries: Sequence[int],
    eagle: bool = False,
) -> list[bool] | None:
    """vLLM 0.33's sliding-window caching: which of blocks ``num_cached .. num_full-1``
    get a hash (``None``: all). A hit needs ``need = cdiv(w - 1, block)`` blocks; they
    are kept ending at the end of every segment (a scheduler block under dense
    retention, ``retention`` tokens under a positive interval, no segment under sparse
    retention, 0) and, unless dense (``None``), ending at each reachable ``boundaries``
    position rounded down to the scheduler block. Where ``need`` covers a whole
    segment every block is kept. With EAGLE's drop (``eagle``) a hit needs one block
    more, the block past each end (the one its search peeks at and drops)."""
    shift = 1 if eagle else 0
    need = -(-(window - 1) // block_size) + shift
    segment = scheduler_block_size if retention is None else retention
    mask = [False] * (num_full - num_cached)
    if segment:
        per_segment = segment // block_size
        if need >= per_segment:
            return None
        for i in range(max(num_cached, shift), num_full):
            if (i - shift) % per_segment >= per_segment - need:
                mask[i - num_cached] = True
    if retention is not None:
        for boundary in boundaries:
            end = boundary // scheduler_block_size * scheduler_block_size // block_size + shift
            for j in range(max(num_cached, end - need), min(num_full, end)):
                mask[j - num_cached] = True
    return mask


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int, eagle: bool) -> tuple[int, ...]:
    """vLLM 0.33's positions a later request replaying a prompt can resume at, whose
    sliding-window tails sparse retention keeps: ``num_prompt_tokens - 1`` (a resend's
    cap); with EAGLE's drop the two aligned ends one block lower (a resend's, capped at
    ``num_prompt_tokens - 1``, and a longer sibling's), not below 0."""
    if not eagle:
        return (num_prompt_tokens - 1,)
    block = scheduler_block_size
    resend = (num_prompt_tokens - 1) // block * block
    extension = num_prompt_tokens // block * block
    return tuple(sorted({max(resend - block, 0), max(extension - block, 0)}))
