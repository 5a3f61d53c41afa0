"""A pool's state made ready to load off the event loop: the pool a handover brings
(cluster_placement.py, ``AdoptPool``) and the pool a replica takes over from the
cluster store (cluster_recover.py).

**Why.** Loading such a pool decoded its state (``cbor2.loads``), built its engine
(``import_state``) and encoded the state again for the journal's ``adopt`` record
(``cbor2.dumps``), all on the event loop: 1.1 s at 262,144 blocks, 6.5 s at 1,048,576
on an idle core. Meanwhile the replica renewed no cluster lease, read no watch and
answered no call of its other pools: a pool that size cost the replica its lease (and
its claims with it) on a 2 s lease, and on any lease a busier machine.

**How.** :func:`loaded_apart` does all three on a thread of its own (a daemon: it
never holds the process's exit), one pool at a time, touching only what it makes: the
state's value, its CBOR and the engine; the loop sees nothing of them before they are
whole, and then only loads them into the registry (:func:`.registry_state.adopt_pool`
with the engine, which costs what the pool's sessions and kept answers cost) and
journals the bytes it was given or made. cbor2's C calls never let the GIL go, so the
value is decoded and encoded in pieces (cbor_pieces.py): the loop takes the GIL at
every switch interval. The cyclic garbage collector is paused while the thread builds:
a full pass over the millions of objects it makes, run in the thread at any
allocation, held the GIL for hundreds of milliseconds; what it made is frozen out of
the collector when it is done (as :class:`.gc_freezer.GcFreezer` freezes blocks), and
so is whatever the loop made meanwhile (its garbage cycles, if any, stay)."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import MAX_MODEL_LEN_UNLIMITED, config_from_pb

from .cbor_pieces import dumps_in_pieces, loads_in_pieces, release_in_pieces
from .pool_service import engine_of, engine_released
from .registry_state import check_format

if TYPE_CHECKING:  # pragma: no cover
    from .pool_service import PoolService

__all__ = ["PoolLoad", "loaded_apart", "on_thread", "prepare"]

T = TypeVar("T")

#: one pool built (or freed) at a time (the collector is paused while one is built)
_BUILDING = threading.Lock()


@dataclasses.dataclass
class PoolLoad:
    """A pool's state ready to load: ``value`` (registry_state.dump_pool's), ``encoded``
    (its CBOR: what the ``adopt`` record carries) and its engine built from it
    (pool_service.engine_of)."""

    value: dict[str, Any]
    encoded: bytes
    built: object

    def let_go(self, held: PoolService | None) -> None:
        """Free what the pool loaded no longer needs on a thread of its own, a piece at
        a time: the value's engine state and events, and the engine built unless
        ``held`` (the pool the registry holds now, if any) runs it. Dropped on the loop,
        their millions of objects were freed in one go (1,048,576 blocks: seconds, the
        loop held). Call it once the pool is loaded, or will not be."""
        pool = self.value.get("pool")
        parts: list[Any] = (
            [pool.pop("engine", None), pool.pop("events", None)] if isinstance(pool, dict) else []
        )
        built, self.built, self.encoded = self.built, None, b""
        unused = built is not None and (held is None or not held.runs(built))

        def release() -> None:
            with _BUILDING:
                for part in parts:
                    release_in_pieces(part)
                parts.clear()
                if unused:
                    for _ in engine_released(built):
                        pass

        threading.Thread(target=release, name="kvcoord-pool-release", daemon=True).start()


def prepare(encoded: bytes | None, value: dict[str, Any] | None, max_tokens: int) -> PoolLoad:
    """The :class:`PoolLoad` of a pool's ``encoded`` state, or of its ``value`` (the
    other is made), whose pool admits ``max_tokens`` per request when its config says
    no more (limits.max_tokens_per_request, as the registry makes its engine's config).
    Run on a thread (:func:`loaded_apart`).

    Raises:
        ValueError: not CBOR, another format or engine state version, or a state that
            does not fit its config (and KeyError, TypeError: not a pool's value).
    """
    with _BUILDING:
        collecting = gc.isenabled()
        gc.disable()
        try:
            if value is None:
                assert encoded is not None
                value = loads_in_pieces(encoded)
            check_format(value)
            assert value is not None
            if encoded is None:
                encoded = dumps_in_pieces(value)
            pool = value["pool"]
            config = config_from_pb(pb.PoolConfig.FromString(pool["config"]))
            if config.max_model_len == MAX_MODEL_LEN_UNLIMITED:
                config = dataclasses.replace(config, max_model_len=max_tokens)
            built = engine_of(config, pool["engine"])
        finally:
            gc.freeze()
            if collecting:
                gc.enable()
    return PoolLoad(value, encoded, built)


async def loaded_apart(encoded: bytes | None, value: dict[str, Any] | None, max_tokens: int) -> PoolLoad:
    """:func:`prepare` on a thread of its own; the loop goes on meanwhile. A
    cancellation of the caller leaves the thread to end by itself (nothing is loaded).

    Raises:
        as :func:`prepare`.
    """
    work: Callable[[], PoolLoad] = lambda: prepare(encoded, value, max_tokens)  # noqa: E731
    return await on_thread(work, "kvcoord-pool-load")


async def on_thread(work: Callable[[], T], name: str) -> T:
    """``work()`` on a daemon thread of its own called ``name``, awaited (a
    cancellation of the waiter leaves the thread to end by itself)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(value: T | None, exc: BaseException | None) -> None:
        if done.done():  # (cancelled: nobody waits)
            return
        if exc is None:
            done.set_result(value)  # type: ignore[arg-type]  # (work returned it)
        else:
            done.set_exception(exc)

    def run() -> None:
        value: T | None = None
        failed: BaseException | None = None
        try:
            value = work()
        except BaseException as exc:  # noqa: BLE001 - raised to the waiter
            failed = exc
        try:
            loop.call_soon_threadsafe(settle, value, failed)
        except RuntimeError:  # the loop is closed: nobody waits
            pass

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
