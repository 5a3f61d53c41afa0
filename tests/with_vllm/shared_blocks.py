"""vLLM 0.16.0's group-by-group adoption can put one block in two groups' tables (a KV
connector's external tokens: an earlier group takes a later group's free hit block);
a vllm-0.16 pool refuses that allocation instead (``HitBlockTakenError``, reason
HIT_BLOCK_TAKEN). Scheduler comparisons use this to check that kvcoord's refusal is
exactly where vLLM's own manager first shared a block."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["SharedByVllm", "watch_shared_blocks", "refused_request"]


class SharedByVllm(Exception):
    """kvcoord's run stopped on HIT_BLOCK_TAKEN: the refused request, and the requests
    whose allocation in vLLM's own run left a block in two groups' tables (in order)."""

    def __init__(
        self,
        refused: str,
        sharers: list[str],
        decided: list[Any] | None = None,
        want: list[Any] | None = None,
    ) -> None:
        super().__init__(f"kvcoord refused {refused!r}; vLLM's own manager shared a block for {sharers}")
        self.refused = refused
        self.sharers = sharers
        #: kvcoord's record until the refusal, and vLLM's whole record (the former must
        #: be the start of the latter)
        self.decided = decided if decided is not None else []
        self.want = want if want is not None else []


def watch_shared_blocks(manager: Any) -> list[str]:
    """Wrap vLLM's ``KVCacheManager.allocate_slots``: after each call, the request ids
    whose tables now hold one block in two groups are appended to the returned list."""
    sharers: list[str] = []
    allocate = manager.allocate_slots
    groups = manager.coordinator.single_type_managers

    def watched(request: Any, *args: Any, **kw: Any) -> Any:
        out = allocate(request, *args, **kw)
        seen: dict[int, int] = {}
        for gid, m in enumerate(groups):
            for b in m.req_to_blocks.get(request.request_id, ()):
                if b.is_null:
                    continue
                if seen.setdefault(b.block_id, gid) != gid:
                    sharers.append(request.request_id)
                    return out
        return out

    manager.allocate_slots = watched
    return sharers


def refused_request(message: str) -> str:
    """The request id a HIT_BLOCK_TAKEN refusal names."""
    found = re.search(r"request '([^']*)'", message)
    assert found is not None, message
    return found.group(1)
