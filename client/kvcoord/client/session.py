"""A worker's session: attached once, renewed in the background, fenced by its lease.

The server frees a session's requests when the session is not renewed within its
lease, counting from when it *received* the last call. The client counts from when
it *sent* the last call that was answered, so its idea of the lease always ends
first: once that moment has passed, the client must not use the block ids it holds
(another worker may get them) and :meth:`SessionKeeper.vouch` raises.

The keeper renews the lease every third of it on a daemon thread, across idle
periods of any length; every answered call renews it too.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb

from .errors import FencedError, KVCoordError, LeaseExpiredError, SessionExpiredError

__all__ = ["SessionKeeper"]

logger = logging.getLogger(__name__)

#: Part of the lease kept as a safety margin against clock-rate differences.
LEASE_MARGIN = 0.05


class SessionKeeper:
    """One attached session of a pool.

    Args:
        client: a :class:`KVCoordClient` (thread-safe; the keeper calls heartbeat on it).
        attach: performs the Attach call and returns the AttachResponse.
        clock: monotonic seconds.
        renew: start the background renewal thread.
    """

    def __init__(
        self,
        client: Any,
        attach: Callable[[], Any],
        clock: Callable[[], float] = time.monotonic,
        renew: bool = True,
    ) -> None:
        self.client = client
        self._attach = attach
        self.clock = clock
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self.session_id = ""
        self.fence = pb.Fence()
        self.lease = 0.0
        self.exclusive = False
        self.capabilities: frozenset[str] = frozenset()
        self.valid_until = 0.0
        #: the error that ended this session, if it ended (set by the renewal thread)
        self.lost: KVCoordError | None = None
        self.renewals = 0
        self.attach()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(target=self._run, name="kvcoord-session", daemon=True)
            self._thread.start()

    def attach(self) -> Any:
        """(Re-)attach: a new session, lease and fence."""
        sent = self.clock()
        response = self._attach()
        with self._lock:
            self.session_id = response.session_id
            self.fence = response.fence
            self.lease = float(response.lease_seconds)
            self.exclusive = bool(response.exclusive)
            #: the server's AttachResponse.capabilities ("decode_op": it applies DecodeOp)
            self.capabilities = frozenset(getattr(response, "capabilities", ()))
            self.valid_until = sent + self.lease * (1 - LEASE_MARGIN)
            self.lost = None
        self.client.retry_horizon = max(1.0, float(response.idempotency_window_seconds) / 2)
        # a larger Step is sent as several (0: a server before the field, never split by it)
        self.client.step_piece_ops = int(getattr(response, "max_ops_per_step", 0))
        self._wake.set()
        return response

    def start_again(self) -> Any:
        """A new session after this one was lost (its requests with it), for every mode.
        The server may still hold the old one (only this client gave up on its lease):
        end it first, so its requests are freed now and an exclusive session can be
        taken again at once; then attach.

        Raises:
            KVCoordError: the new session could not be made (the caller tries again).
        """
        if self.session_id:
            try:
                self.client.detach(self.session_id, self.fence)
            except KVCoordError:
                pass  # gone already, or unreachable (then its lease ends it)
        return self.attach()

    def adopt(self, fence: pb.Fence) -> None:
        """Take the fence of an answer from a server that recovered this session's pool
        (same incarnation, another instance: the block ids held are still valid), and
        the highest journal position the server reported (``Fence.position``, with the
        ``position_tag`` that proves the server gave it): every later call sends it back,
        so a server restored from an older copy of its data directory learns it is
        behind and fences this worker instead of handing its blocks to another."""
        if fence.incarnation != self.fence.incarnation:
            return
        if fence.term < self.fence.term:
            # a late answer of a deposed owner (a pool's owner changed in a cluster): what
            # it answered was committed before the new owner's term began, but its fence
            # is not taken, so calls keep naming the newest term (a deposed owner refuses
            # them rather than answer)
            return
        if fence.instance_id != self.fence.instance_id or fence.position > self.fence.position:
            with self._lock:
                self.fence = fence

    def renewed(self, sent_at: float) -> None:
        """An answered session call sent at ``sent_at`` renewed the lease."""
        with self._lock:
            self.valid_until = max(self.valid_until, sent_at + self.lease * (1 - LEASE_MARGIN))

    def vouch(self) -> None:
        """Raise unless the lease is certainly still running.

        Raises:
            the error that ended the session, or LeaseExpiredError.
        """
        lost = self.lost
        if lost is not None:
            raise lost
        if self.clock() >= self.valid_until:
            # No renewal was acknowledged in time: try once now, synchronously.
            self.heartbeat()
            lost = self.lost
            if lost is not None:
                raise lost
            if self.clock() >= self.valid_until:
                raise LeaseExpiredError(
                    f"session {self.session_id[:16]}...: no lease renewal acknowledged for "
                    f"{self.lease:.1f} s; its block ids may belong to someone else now"
                )

    def heartbeat(self) -> None:
        """Renew now; records a lost session in ``lost`` (never raises)."""
        sent = self.clock()
        session_id = self.session_id
        try:
            response = self.client.heartbeat(session_id, self.fence)
        except (SessionExpiredError, FencedError) as err:
            with self._lock:
                if self.session_id == session_id:  # not a session replaced meanwhile
                    self.lost = err
            return
        except KVCoordError as err:  # transient: the next attempt may succeed
            logger.warning("session renewal failed: %s", err)
            return
        except Exception as err:  # noqa: BLE001 - e.g. the channel was closed under us
            logger.warning("session renewal failed: %r", err)
            return
        if self.session_id != session_id:
            return  # renewed a session that was replaced meanwhile
        self.renewals += 1
        self.adopt(response.fence)
        self.renewed(sent)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            interval = max(0.05, self.lease / 3)
            if self._wake.wait(interval) or self._stop.is_set():
                continue
            if getattr(self.client, "closed", False):
                return  # the client was closed under the manager: nothing to renew with
            if self.lost is None:
                self.heartbeat()

    def close(self) -> None:
        """Stop renewing (the session itself ends on Detach or at lease expiry)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
