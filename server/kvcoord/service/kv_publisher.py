"""Each pool's KV events in vLLM's own wire format, on ZMQ (``[[kv_events]]``).

Routers that index vLLM engines' prefix caches (llm-d's KV-cache manager, Dynamo's KV
router, SGLang's gateway) subscribe to every engine's ZMQ publisher
(``--kv-events-config '{"publisher": "zmq", ...}'``). A kvcoord pool already knows
every block the engines sharing it cache, so one publisher per pool replaces one per
engine, speaking the same protocol as the vLLM release the pool follows (its semantics
profile: vLLM 0.16.0 for ``vllm-0.16`` pools, 0.33.0 for ``vllm-0.33`` pools):

* a PUB socket (an XPUB, which is a PUB to subscribers and also tells the publisher
  of each subscription), each message three frames: the topic (UTF-8, may be empty),
  the batch sequence number (8 bytes, big-endian, counting from 0 at the first
  start) and the payload; each (re)subscription is answered with an empty batch
  under the next number, so a subscriber learns at once whether it missed any (the
  empty batch is not kept for replay);
* the payload is msgpack of ``KVEventBatch``, encoded as vLLM 0.16 or 0.33 does
  (kv_event_format.py);
* an optional ROUTER replay socket: a request ``[b"", start_seq (8 bytes)]`` (from a
  DEALER, or a REQ's envelope) is answered with every buffered batch numbered
  ``start_seq`` or more, one message each, then an end marker: in 0.16
  ``[b"", seq, payload]`` and ``[b"", -1 (8 bytes, signed), b""]``; in 0.33 the
  topic frame comes first, as on the PUB socket: ``[b"", topic, seq, payload]`` and
  ``[b"", b"", -1, b""]``. ``buffer_steps`` bounds the batches kept, not their bytes;
  the answers refer to the kept payloads (no copy per peer). A request older than
  the oldest batch kept (the subscriber missed batches this process no longer has,
  or never had: an earlier process's, before a restart) is answered with one batch
  instead: ``AllBlocksCleared``, then every block the batches sent leave stored, as
  ``BlockStored``, under the number of the newest batch sent (whose state it is). The
  replay answers in the format of the pool's current profile (a pool deleted and
  created again under the other profile is announced with ``AllBlocksCleared``; a
  subscriber of one vLLM release cannot follow it past that, as it could not follow
  an engine upgraded in place).

Only committed events are published (what ``WatchEvents`` would deliver), in journal
order, so a subscriber that misses nothing holds exactly the pool's prefix-cache map.
A publisher thread owns the sockets: the event loop only hands it each batch, and a
PUB socket drops what a slow subscriber cannot take (its high-water mark), so no
subscriber ever slows a Step. A pool deleted (or deleted and created again) is
announced with ``AllBlocksCleared``.

Across a server restart (a server with a data directory) the batch numbers go on: the
publisher reserves numbers ahead in a small file of the data directory, written and
synced before it uses them, and a restarted publisher starts past every number
reserved before and past the wall clock in microseconds (the file may come from a
restored, older volume: kv_events_config.py), so no number ever names two different
batches on the PUB socket (a
replay's snapshot above stands for every batch up to its number) and a subscriber sees
the restart as a gap, which it fills from the replay socket: with the snapshot, as the
restarted process has none of the batches it missed (until this process's first batch
is sent, the answer is the end marker alone). A publisher's first batch of a pool (after
a restart, or the pool came to this replica) is ``AllBlocksCleared`` then the events
the pool keeps: any index applying it holds exactly the pool's map when they are its
whole history; when older ones were dropped, it is a gap (logged and counted in
``kvcoord_event_gaps_total{stream="zmq"}``) and removals of blocks stored before the
kept events are left out. A server without a data directory loses its pools in a
restart and numbers from 0 again, as a restarted vLLM engine does.

A batch that cannot be sent (a failed reservation write, say) is lost, logged and
counted (``kvcoord_event_gaps_total{stream="zmq"}``); the next batch starts with
``AllBlocksCleared`` and the publisher goes on.

What each publisher is handed, read from its pool's event journal, and the tasks doing
that for every ``[[kv_events]]`` pool, are kv_event_feed.py's. pyzmq and msgspec are the
optional extra ``kvcoord[zmq]``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvcoord.engine import AllBlocksCleared, KVCacheEvent
from kvcoord.engine.profiles import VLLM_016

from .kv_event_format import encode_batch
from .kv_event_index import PublishedBlocks, StoredSinceGap
from .kv_events_config import (
    RESERVE_SEQUENCES,
    KVEventsDecl,
    SequenceReservation,
    clock_floor,
    kv_events_from_list,
    reservation_path,
)
from .logs import ids

__all__ = [
    "RESERVE_SEQUENCES", "KVEventPublisher", "KVEventsDecl",
    "SequenceReservation", "encode_batch", "kv_events_from_list", "reservation_path",
]  # fmt: skip

logger = logging.getLogger(__name__)

#: the replay socket's end-of-replay sequence number: -1, signed, 8 bytes
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """One pool's PUB (and replay ROUTER) sockets, served by a thread of their own.

    :meth:`submit` (any thread; never blocks) queues one batch; the thread encodes it,
    numbers it, sends it and keeps it for replay. A batch that cannot be sent (its
    number's reservation cannot be written, say, on a full disk) is lost, never the
    thread: it is logged and counted (``on_lost``), and the next batch sent starts with
    ``AllBlocksCleared``, since its subscribers see no gap in the numbers. Should the
    thread stop all the same, :meth:`submit` drops (and counts) instead of queueing
    for nobody.

    Args:
        decl: the publisher's settings.
        data_dir: the server's data directory, where batch numbers are reserved so
            they go on across restarts (None: from 0 at every start).
        profile: the pool's semantics profile when it exists at the start.
        on_lost: told the pool's name for each batch lost (from the publisher's
            thread, or from :meth:`submit`'s once the thread is gone).

    Raises:
        ImportError: pyzmq or msgspec is missing (install ``kvcoord[zmq]``).
        zmq.ZMQError: an endpoint cannot be bound or connected.
        ValueError: the reservation file is damaged.
    """

    def __init__(
        self,
        decl: KVEventsDecl,
        data_dir: str | Path | None = None,
        profile: str = VLLM_016,
        on_lost: Callable[[str], None] = lambda pool: None,
    ) -> None:
        try:
            import msgspec  # noqa: F401 - the thread's encoder, checked before binding anything
            import zmq
        except ImportError as exc:
            raise ImportError(
                f"[[kv_events]] for pool {decl.pool!r} needs pyzmq and msgspec: pip install 'kvcoord[zmq]' ({exc})"
            ) from exc

        self.decl = decl
        self._zmq = zmq
        self._reservation = (
            # (past the clock after a restart: the file may be a restored copy's)
            SequenceReservation(reservation_path(data_dir, decl.pool), decl.pool, clock_floor())
            if data_dir
            else None
        )
        ctx: Any = zmq.Context.instance()
        # XPUB: a PUB socket to every subscriber (vLLM's SUB sockets connect unchanged)
        # that also hands this thread each subscription, so a subscriber that
        # (re)connects gets a batch number at once (see _joined)
        self._pub = ctx.socket(zmq.XPUB)
        self._pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._pub.set_hwm(decl.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        ep = decl.endpoint
        if "*" in ep or "::" in ep or ep.startswith(("ipc://", "inproc://")):
            self._pub.bind(ep)
        else:
            self._pub.connect(ep)
        #: the PUB address, its port resolved when bound to a wildcard port
        self.endpoint: str = self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or ep
        self._replay: Any = None
        self.replay_endpoint = ""
        if decl.replay_endpoint:
            self._replay = ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            # room for a whole replay and its end marker (a ROUTER drops past its
            # high-water mark; libzmq acknowledges reads only every half of it): a lower
            # limit would cut replays short, and a queued message costs little (below)
            self._replay.setsockopt(zmq.SNDHWM, 2 * (decl.buffer_steps + 1))
            # a replay's messages refer to the buffered payloads (copy=False in
            # _serve_replay) whatever their size: a peer that asks and never reads
            # holds references, not a copy of the whole buffer each
            self._replay.copy_threshold = 0
            self._replay.bind(decl.replay_endpoint)
            self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = decl.topic.encode()
        self._queue: queue.SimpleQueue[tuple[list[KVCacheEvent], str] | None] = queue.SimpleQueue()
        #: the format of the batches sent last (the pool's profile), which the replay
        #: socket answers in; ``profile``: the pool's when it exists at the start, else
        #: the default, until :func:`follow` sees the pool (follow_profile)
        self.profile = profile
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=decl.buffer_steps)
        #: the newest number whose batch the buffer dropped (-1: none; after a restart,
        #: at least the last number before this process's first): a replay from it or
        #: before cannot be answered whole, and is answered with a snapshot of the
        #: blocks sent (_serve_replay)
        self.dropped_through = -1
        self._published = PublishedBlocks() if self._replay is not None else None
        #: the next batch's sequence number (from the reservation across restarts)
        self.next_sequence = self._reservation.start if self._reservation is not None else 0
        #: this process's first number. The numbers before it (an earlier process's)
        #: name batches this one never had, and the pool's re-sent events need not
        #: reach back to them (its event buffer may have dropped removals since): a
        #: replay from one of them is answered as one the buffer dropped, with a snapshot
        self._first_sequence = self.next_sequence
        if self.next_sequence > 0:
            self.dropped_through = self.next_sequence - 1
        self.events_sent = 0
        #: batches lost (not sent), and whether the next batch sent must start with a
        #: clear because of it
        self.batches_lost = 0
        self._lost = False
        #: since the clear a lost batch calls for: removals of blocks stored before it
        #: are left out (its subscribers dropped those blocks with the clear)
        self._since_loss = StoredSinceGap()
        self._on_lost = on_lost
        self._thread = threading.Thread(target=self._run, name=f"kv-events-{decl.pool}", daemon=True)
        self._thread.start()

    @property
    def buffered_bytes(self) -> int:
        """The payloads kept for replay, in bytes (``buffer_steps`` bounds their number)."""
        return sum(len(payload) for _, payload in list(self._buffer))

    def submit(self, events: list[KVCacheEvent], profile: str = VLLM_016) -> None:
        """Queue one batch (not empty) for publishing, in the format of the vLLM release
        the pool's semantics ``profile`` follows; dropped and counted when the thread
        has stopped (nothing would take it off the queue)."""
        if not self._thread.is_alive():
            self._count_lost()
            return
        self._queue.put((events, profile))

    def follow_profile(self, profile: str) -> None:
        """The pool now follows ``profile``: the replay socket answers in its framing
        from now on, even before the pool's first batch (queued after what was submitted
        before, so earlier batches keep their format)."""
        if self._thread.is_alive():  # (else nothing would take it off the queue)
            self._queue.put(([], profile))

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                if self._pub.poll(0):
                    self._joined()
                try:
                    item = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if item is None:
                    return
                self.profile = item[1]
                if item[0]:  # else only the profile (follow_profile)
                    self._send_or_lose(item[0])
        except Exception:  # logged: a dead publisher must be visible (submit counts its drops)
            logger.exception(
                "KV event publisher of pool %s stopped", self.decl.pool, extra=ids(pool=self.decl.pool)
            )
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _count_lost(self) -> None:
        self.batches_lost += 1
        self._on_lost(self.decl.pool)

    def _send_or_lose(self, events: list[KVCacheEvent]) -> None:
        """Send one batch; when that fails, log and count it, and make the next batch
        start with a clear (the lost batch used no number: subscribers see no gap), the
        removals of blocks stored before that clear left out from then on."""
        try:
            self._send(events)
        except Exception:
            logger.exception(
                "pool %s: a KV event batch could not be sent (lost; the next batch starts with a clear)",
                self.decl.pool,
                extra=ids(pool=self.decl.pool),
            )
            self._lost = True
            self._since_loss.start()
            self._count_lost()

    def _send(self, events: list[KVCacheEvent]) -> None:
        d = self.decl
        if events:
            events = self._since_loss.keep(events)
            if not events:  # only removals of blocks its subscribers dropped
                return
        if self._lost:  # a batch was lost since the last sent: its subscribers start over
            events = [AllBlocksCleared(), *events]
        payload = encode_batch(time.time(), events, d.data_parallel_rank, d.int_hashes, self.profile)
        seq = self.next_sequence
        if self._reservation is not None:
            self._reservation.allow(seq)  # synced before the number leaves this process
        # NOBLOCK: a PUB socket drops for a subscriber at its high-water mark instead
        # of waiting; EAGAIN is not expected from PUB, but never wait on a subscriber.
        with contextlib.suppress(self._zmq.Again):
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=self._zmq.NOBLOCK)
        self.next_sequence = seq + 1
        self._lost = False
        if self._published is not None:
            self._published.apply(events)
        if events:  # an empty batch (a subscription's, _joined) takes no replay slot
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped_through = self._buffer[0][0]
            self._buffer.append((seq, payload))
        self.events_sent += len(events)

    def _joined(self) -> None:
        """Subscriptions arrived: send an empty batch with the next number.

        PUB/SUB drops what is sent before a subscriber's connection is up, so a
        subscriber (re)connecting to a publisher that just started could miss the
        restart's first batch and see no gap until the pool's next event. The empty
        batch shows it its place at once: a gap it fills from the replay socket. Other
        subscribers just see the next number with no events. The empty batch is not
        kept for replay (a replay skips its number, as any subscriber accepts), so
        subscription churn pushes no batch out of the replay buffer."""
        joined = False
        while True:
            try:
                frame = self._pub.recv(self._zmq.NOBLOCK)
            except self._zmq.Again:
                break
            joined = joined or frame[:1] == b"\x01"  # subscribe (b"\x00": unsubscribe)
        if joined:
            self._send_or_lose([])

    def _serve_replay(self) -> None:
        """Answer one replay request: every kept batch numbered ``start_seq`` or more,
        then the end marker. When the buffer dropped a batch numbered ``start_seq`` or
        more, or an earlier process (before a restart) sent it, the subscriber missed
        events nothing can give it any more (and the kept batches remove blocks it
        never saw stored, or leave stored blocks removed since): the answer is one batch
        instead, ``AllBlocksCleared`` then every block the batches sent leave stored, as
        ``BlockStored``, numbered as the newest batch sent (whose state it is: the
        next live batch follows it), then the end marker."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning(
                "pool %s: ignored a malformed KV event replay request",
                self.decl.pool,
                extra=ids(pool=self.decl.pool),
            )
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        send = self._replay.send_multipart
        nb = self._zmq.NOBLOCK
        # vLLM 0.33 puts the topic frame (the end marker's empty) before each number
        head = (client, b"") if self.profile == VLLM_016 else (client, b"", self._topic)
        end = (client, b"") if self.profile == VLLM_016 else (client, b"", b"")
        kept = [(seq, payload) for seq, payload in self._buffer if seq >= first]
        if first <= self.dropped_through and self._published is not None:
            if self.next_sequence == self._first_sequence:
                # nothing sent by this process yet: no number of its own can carry the
                # snapshot (the one before is an earlier process's); the subscriber
                # asks again when it meets this process's first batch
                with contextlib.suppress(self._zmq.Again):
                    send((*end, END_OF_REPLAY, b""), flags=nb)
                return
            d = self.decl
            events = self._published.snapshot()
            snapshot = encode_batch(time.time(), events, d.data_parallel_rank, d.int_hashes, self.profile)
            kept = [(self.next_sequence - 1, snapshot)]
        with contextlib.suppress(self._zmq.Again):
            for seq, payload in kept:
                # copy=False: the peer's queue refers to the buffered bytes
                send((*head, seq.to_bytes(8, "big"), payload), flags=nb, copy=False)
            send((*end, END_OF_REPLAY, b""), flags=nb)
