"""vLLM 0.16.0's schedulers with kvcoord as their KV cache manager (needs vLLM).

Use with vLLM's own option, the pool given by ``KVCOORD_*`` environment variables
(:class:`kvcoord.client.vllm.Settings`)::

    KVCOORD_TARGET=kvcoord:50051 KVCOORD_POOL=llama-8b PYTHONHASHSEED=0 \\
        vllm serve MODEL --scheduler-cls kvcoord.client.vllm_scheduler.KVCoordScheduler

``KVCoordAsyncScheduler`` is the same on vLLM's ``AsyncScheduler`` (``--scheduler-cls``
replaces vLLM's choice between the two, so pick the one matching ``--async-scheduling``).
The engine profiles memory and builds its ``KVCacheConfig`` as usual; the scheduler then
creates the pool from it (or attaches to an existing one, refusing a mismatch) and every
allocation decision is the pool's.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from .vllm import KVCoordKVCacheManager, Settings, connect

__all__ = ["KVCoordAsyncScheduler", "KVCoordScheduler"]


def _install(scheduler: Any) -> KVCoordKVCacheManager:
    """Replace the scheduler's in-process manager with one on the configured pool."""
    manager = connect(
        Settings.from_env(), scheduler.kv_cache_config, scheduler.vllm_config, log_stats=scheduler.log_stats
    )
    # vLLM's own manager (built by Scheduler.__init__) holds nothing yet: drop it
    scheduler.kv_cache_manager = manager
    return manager


#: lookups fetched ahead at most per round trip, and the prompt tokens they may cover
#: (a multiple of the step's token budget: prefix hits let more requests in)
HINT_REQUESTS = 32
HINT_BUDGET_FACTOR = 2


class _OnKVCoord:
    """Installs a kvcoord pool as the scheduler's ``kv_cache_manager`` and closes it."""

    kvcoord: KVCoordKVCacheManager
    waiting: Any
    running: list[Any]
    max_num_running_reqs: int
    max_num_scheduled_tokens: int

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kvcoord = _install(self)
        self.kvcoord.remote.upcoming = self._upcoming_lookups

    def _upcoming_lookups(self, current: Any) -> list[Any]:
        """The waiting requests this step's waiting loop may look up after ``current``,
        in its order: the round trip that looks ``current`` up fetches their hints."""
        room = self.max_num_running_reqs - len(self.running) - 1
        tokens = HINT_BUDGET_FACTOR * self.max_num_scheduled_tokens
        out: list[Any] = []
        for request in self.waiting:
            if room <= 0 or tokens <= 0 or len(out) >= HINT_REQUESTS:
                break
            if request is current or request.num_computed_tokens:
                continue  # only requests starting from zero look up
            out.append(request)
            room -= 1
            tokens -= request.num_tokens
        return out

    def shutdown(self) -> None:
        super().shutdown()  # type: ignore[misc]
        self.kvcoord.close()


class KVCoordScheduler(_OnKVCoord, Scheduler):
    """vLLM's ``Scheduler``; its ``kv_cache_manager`` is a kvcoord pool."""


class KVCoordAsyncScheduler(_OnKVCoord, AsyncScheduler):
    """vLLM's ``AsyncScheduler``; its ``kv_cache_manager`` is a kvcoord pool."""
