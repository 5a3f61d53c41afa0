"""A worker's session: attached once, renewed in the background, fenced by its lease.

The server frees a session's requests when the session is not renewed within its
lease, counting from when it *received* the last call. The client counts from when
it *sent* the last call that was answered, so its idea of the lease always ends
first: once that moment has passed, the client must not use the block ids it holds
(another worker may get them) and :meth:`SessionKeeper.vouch` raises.

The keeper renews the lease every third of it on a daemon thread, across idle
periods of any length; every answered call renews it too.

A call answered later than 0.95 x the lease after it was sent (a Step waiting on a
stalled journal write, while the renewals, which do not wait for it, were answered) is
trusted only when the keeper held a lease proof at every instant from its send to its
answer's arrival: :meth:`SessionKeeper.proven`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire.leases import LEASE_MARGIN

from .api import retry_horizon
from .errors import (
    FencedError,
    FenceUnprovenError,
    KVCoordError,
    LeaseExpiredError,
    SessionExpiredError,
    UnavailableError,
)

__all__ = ["SessionKeeper"]

logger = logging.getLogger(__name__)

#: unbroken runs of lease proof a session keeps (older ones are forgotten: a call sent
#: in one of them and answered now is then not trusted, a loud loss, never a guess)
PROOF_RUNS = 16


class SessionKeeper:
    """One attached session of a pool.

    Args:
        client: a :class:`KVCoordClient` (thread-safe; the keeper calls heartbeat on it).
        attach: performs the Attach call and returns the AttachResponse; called with the
            fence of the session held before (None at the first Attach, or when it
            carries no journal position), which the Attach sends as
            ``previous_fence``: a worker attaching again after a loss proves a restored
            data directory as its other calls do (a restore found between its Detach
            and its Attach otherwise hands it blocks the lost history's workers hold).
        clock: monotonic seconds.
        renew: start the background renewal thread.
    """

    def __init__(
        self,
        client: Any,
        attach: Callable[[pb.Fence | None], Any],
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
        #: the unbroken runs of lease proof of this session (see :meth:`proven`), oldest
        #: first, disjoint: [(from, until)]
        self.proofs: list[tuple[float, float]] = []
        #: the error that ended this session, if it ended (set by the renewal thread)
        self.lost: KVCoordError | None = None
        self.renewals = 0
        self.attach()
        self._thread: threading.Thread | None = None
        if renew:
            self._thread = threading.Thread(target=self._run, name="kvcoord-session", daemon=True)
            self._thread.start()

    def attach(self) -> Any:
        """(Re-)attach: a new session, lease and fence.

        Raises:
            FenceUnprovenError: the server refused the fence of the session held before
                (a position it never issued: corrupted, or told without its tag; it
                proves nothing, and nothing changed). The keeper forgets that position
                first (:meth:`unproven`): kept, every later Attach would send it and be
                refused the same way, and the worker could never attach again. The next
                Attach sends no previous fence.
        """
        sent = self.clock()
        previous = self.fence if self.fence.position else None
        try:
            response = self._attach(previous)
        except FenceUnprovenError as err:
            if previous is not None:
                self.unproven(err)
            raise
        with self._lock:
            self.session_id = response.session_id
            self.fence = response.fence
            self.lease = float(response.lease_seconds)
            self.exclusive = bool(response.exclusive)
            #: the server's AttachResponse.capabilities ("decode_op": it applies DecodeOp)
            self.capabilities = frozenset(getattr(response, "capabilities", ()))
            self.valid_until = sent + self.lease * (1 - LEASE_MARGIN)
            self.proofs = [(sent, self.valid_until)]  # a new session: no proof of the old one counts
            self.lost = None
        self.client.retry_horizon = retry_horizon(response)
        # a larger Step is sent as several (0: a server before the field, never split by it)
        self.client.step_piece_ops = int(getattr(response, "max_ops_per_step", 0))
        self._wake.set()
        return response

    def start_again(self) -> Any:
        """A new session after this one was lost (its requests with it), for every mode.
        The server may still hold the old one (only this client gave up on its lease):
        end it first, so its requests are freed now and an exclusive session can be
        taken again at once; then attach. A Detach the server answered with an error
        (the session gone already, ...) is as good. One that did not reach it (the
        client retries a Detach never sent, as long as its retry policy allows), or
        whose outcome is unknown, is not for a shared session: the old session may
        still hold the lost requests' ids, and their recompute under the same ids in a
        new shared session would be refused (PERMISSION_DENIED) until its lease ran
        out there. An exclusive session attaches anyway: the server refuses the new
        exclusive Attach while the old session lives (POOL_EXCLUSIVE) and ends it if
        its lease ran out.

        Raises:
            KVCoordError: the new session could not be made (the caller tries again,
                Detach first: the old session's id is kept until an Attach succeeds).
        """
        if self.session_id:
            try:
                self.client.detach(self.session_id, self.fence)
            except UnavailableError:
                if not self.exclusive:
                    raise  # unreachable, or its outcome unknown: the next call tries again
            except KVCoordError:
                pass  # answered: gone already, or not this client's to end
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

    def unproven(self, err: FenceUnprovenError) -> None:
        """The server refused this keeper's fence FENCE_UNPROVEN (``err``): its position
        is forgotten (with its tag; the instance, incarnation and term are kept), so no
        later call sends it again. It could prove nothing: the server verified it
        against what its journal issued and changed nothing. Logged as an error: a
        corrupted fence, or one told by a kvcoord that did not tag positions, is worth
        an operator's look (a restore it might have proven goes unseen by this worker)."""
        with self._lock:
            held, position = self.fence, self.fence.position
            # a new message: the refused one may be held elsewhere (an answer, a request)
            self.fence = pb.Fence(instance_id=held.instance_id, incarnation=held.incarnation, term=held.term)
        logger.error(
            "session %s...: the server refused the fence's journal position %d (%s); it is "
            "forgotten, the next Attach names no previous fence",
            self.session_id[:16],
            position,
            err,
        )

    def renewed(self, sent_at: float, session_id: str | None = None) -> None:
        """An answered session call sent at ``sent_at`` renewed the lease (``session_id``:
        the session it was sent for; an answer for a session replaced since renews nothing)."""
        with self._lock:
            if session_id is not None and session_id != self.session_id:
                return
            until = sent_at + self.lease * (1 - LEASE_MARGIN)
            self.valid_until = max(self.valid_until, until)
            # Its proof [sent_at, until) joins every run it overlaps (answers may come in
            # any order: a late one can close a break between two runs).
            start, kept = sent_at, []
            for a, b in self.proofs:
                if a < until and start < b:
                    start, until = min(start, a), max(until, b)
                else:
                    kept.append((a, b))
            kept.append((start, until))
            kept.sort()
            self.proofs = kept[-PROOF_RUNS:]

    def check_answer(self, sent_at: float, session_id: str) -> None:
        """An answer (now) to a call of session ``session_id`` sent at ``sent_at``.

        Raises:
            LeaseExpiredError: it came later than 0.95 x the lease after its send and
                the lease was not proven without a break meanwhile (:meth:`proven`).
        """
        arrived = self.clock()
        late = arrived >= sent_at + self.lease * (1 - LEASE_MARGIN)
        if late and not self.proven(sent_at, arrived, session_id):
            raise LeaseExpiredError(
                "the answer came after the session's lease could have ended (no unbroken lease proof from "
                "the call's send to its answer)"
            )

    def proven(self, sent_at: float, arrived: float, session_id: str) -> bool:
        """Whether the session ``session_id``'s lease was proven without a break from
        ``sent_at`` (a call's send) until ``arrived`` (its answer's arrival): then the
        answer may be trusted however late it came.

        Why that is enough: the server counts a lease from when it *receives* a call and
        ends the session once a whole lease passed with none received; an ended session
        never comes back. A renewal sent at s and answered proves the session was live
        when the server received it (at r >= s): so it was not ended before r, nor
        before r + lease > s + 0.95 x lease; each answered renewal is a proof running
        over [s, s + 0.95 x lease). A renewal sent before the previous proof ran out
        continues its run; one unbroken run covering [sent_at, arrived] leaves no
        instant in between at which the server could have ended the session (and given
        its blocks to another) unseen by this client. A break (no renewal answered that
        was sent in time: the server unreachable or restarting, answers lost) is not
        bridged, even by renewals answered later: the lease was not proven in it, and no
        answer across it is trusted (deploy/README.md, "Upgrade with sessions live").
        """
        with self._lock:
            if session_id != self.session_id:
                return False
            return any(a <= sent_at and arrived < b for a, b in self.proofs)

    def vouch(self) -> None:
        """Raise unless the lease is certainly still running.

        Raises:
            the error that ended the session, or LeaseExpiredError.
        """
        lost = self.lost
        if lost is None and self.clock() >= self.valid_until:
            # No renewal was acknowledged in time: try once now, synchronously.
            self.heartbeat()
            lost = self.lost
            if lost is None and self.clock() >= self.valid_until:
                raise LeaseExpiredError(
                    f"session {self.session_id[:16]}...: no lease renewal acknowledged for "
                    f"{self.lease:.1f} s; its block ids may belong to someone else now"
                )
        if lost is not None:
            raise lost

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
        self.renewed(sent, session_id)

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
