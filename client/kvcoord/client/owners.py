"""Which replica to call for a pool: the client's side of a sharded cluster.

A cluster's replicas each serve a disjoint set of pools; a replica called for a pool it
does not serve answers FAILED_PRECONDITION, reason NOT_OWNER, naming the owner's
address. :class:`Routes` is what a client knows: the replica set it was given (a list
of ``host:port``, or a DNS name whose A records are the replicas, e.g. a Kubernetes
headless Service), each pool's owner as last learned, and each session's pool (calls
that carry only a session id go where its pool lives). It does no I/O except resolving
names; the clients (client.py) call it around every RPC.

**When an owner dies.** Until its claim lapses (a lease) the other replicas still name
it, and it refuses connections. An address that did not answer is marked down: it is
tried after every live one (resolving the names again keeps it at the back) until it
answers, and a redirect naming it is not followed for :data:`RECHECK_DOWN` seconds:
the call waits a short pause and asks a live replica again (:meth:`Routes.failed`
says ``"settle"``), so the first attempt after the takeover goes where the live
replicas point. A replica that answers OWNER_CHANGING (it is taking the pool over,
rebuilding it, or handing it over) stays the pool's owner and is asked again after
the same short pause.

**Named replicas.** A redirect names the owner as ``<cluster>/<replica id>``, and so
does every pool description a replica answers with (Attach, GetPool, CreatePool,
ListPools): each call to that address names it (:attr:`Routes.named`, sent as the
``kvcoord-replica`` metadata), and a server there that is not that replica refuses it
(WRONG_REPLICA: the replica stopped and another server, perhaps of another cluster with
a pool of the same name, has its address now). That refusal applied nothing: the call
goes to another replica at once, whatever its kind.

**Threads.** A blocking client is called from several threads at once (a manager's
sender thread and the scheduler's): every method that changes the table holds one lock,
so two threads learning at once neither lose an update nor break the table (an address
listed twice, a session map iterated while it shrinks). Reads (:meth:`Routes.route`,
:meth:`Routes.pool_of`) take no lock: they read one field, which is always whole
(the address list is replaced, never changed in place: a reader never sees it
between an address's removal and its return at the end).

A single ``host:port`` is a replica set of one: a single-node server never redirects,
so nothing changes for it.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import (
    GracePeriodError,
    KVCoordError,
    NotOwnerError,
    OwnerChangingError,
    UnavailableError,
    WrongReplicaError,
    never_sent,
)

__all__ = ["AGAIN", "MAX_HOPS", "SETTLE", "Routes", "parse_targets", "resolve"]

#: the answers that describe their pool (PoolInfo: the replica that answered, by name)
_DESCRIBED = frozenset({"Attach", "GetPool", "CreatePool"})
#: NOT_OWNER redirects followed for one call (a pool moving twice under a call is rare;
#: more means the replicas disagree, which is reported rather than chased)
MAX_HOPS = 4
#: re-resolve DNS names at most this often (seconds)
RESOLVE_EVERY = 1.0
#: a redirect naming an address marked down is followed again this long after the
#: mark (seconds): a replica restarted at the same address is found again
RECHECK_DOWN = 1.0
#: :meth:`Routes.failed`: call again at once (a redirect, another replica to ask)
AGAIN = "again"
#: :meth:`Routes.failed`: the replica set is changing hands: a short pause, then again
SETTLE = "settle"
#: sessions whose pool is remembered (the oldest are forgotten: a session that expired
#: without Detach leaves its entry)
MAX_SESSIONS = 100_000

#: rpc -> the request field naming its pool ("" : none)
_POOL_FIELD = {
    "CreatePool": "name",
    "GetPool": "name",
    "DeletePool": "name",
    "ListPools": "",
    "ScorePools": "",
}


def parse_targets(targets: str | Sequence[str]) -> list[str]:
    """The entries of a replica set: a list, or one string of comma-separated entries.

    Raises:
        ValueError: no entry.
    """
    items = targets.split(",") if isinstance(targets, str) else list(targets)
    out = [t.strip() for t in items if t and t.strip()]
    if not out:
        raise ValueError("no target address given")
    return out


def _is_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    return True


def resolve(entry: str) -> list[str]:
    """The addresses behind one entry: a DNS name with several A records is each of
    them (``ip:port``); a literal, a unix socket, a name with one record or one that
    does not resolve (yet) stays as written (gRPC resolves it per call)."""
    if entry.startswith("unix:") or "://" in entry:
        return [entry]
    host, sep, port = entry.rpartition(":")
    if not sep or _is_literal(host) or not port.isdigit():
        return [entry]
    try:
        infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return [entry]
    ips = sorted({str(info[4][0]) for info in infos})
    return [f"{ip}:{port}" for ip in ips] if len(ips) > 1 else [entry]


class Routes:
    """A replica set and what the client learned about it.

    Args:
        targets: the replica set (see :func:`parse_targets`).
        resolver: one entry -> its addresses (default :func:`resolve`).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        targets: str | Sequence[str],
        resolver: Callable[[str], list[str]] = resolve,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.entries = parse_targets(targets)
        #: held by every method that changes the table (see the module docstring);
        #: reentrant: unreachable() resolves the names again under it
        self._lock = threading.RLock()
        self.resolver = resolver
        self.clock = clock
        self.addresses: list[str] = []
        #: address -> when it last failed to answer (cleared when it answers)
        self.down: dict[str, float] = {}
        self._resolved_at = -float("inf")
        self.refresh()
        #: pool -> the address of its owner, as last learned (a redirect, an answer)
        self.owner: dict[str, str] = {}
        #: session id -> its pool
        self.session_pool: dict[str, str] = {}
        #: address -> the replica ("<cluster>/<replica id>") last named there (a redirect,
        #: or an answer's PoolInfo.replica_name): calls sent there name it, and any other
        #: server there refuses them (WRONG_REPLICA)
        self.named: dict[str, str] = {}

    @property
    def primary(self) -> str:
        """Where calls naming no pool go (the first address)."""
        return self.addresses[0]

    def refresh(self) -> None:
        """Resolve the entries again (at most every :data:`RESOLVE_EVERY` seconds);
        addresses learned from redirects are kept, and addresses marked down stay
        after every live one."""
        with self._lock:
            now = self.clock()
            if now - self._resolved_at < RESOLVE_EVERY:
                return
            self._resolved_at = now
            fresh: list[str] = []
            for entry in self.entries:
                fresh.extend(a for a in self.resolver(entry) if a not in fresh)
            learned = [a for a in self.addresses if a not in fresh]
            self.addresses = sorted(fresh + learned, key=lambda a: a in self.down)

    def pool_of(self, rpc: str, request: Any) -> str:
        """The pool a call is about ("" when it names none or an unknown session). A
        call of a session that names no pool (Heartbeat, Detach) is given its
        session's, when known: in a cluster only the pool's owner judges the session."""
        fields = request.DESCRIPTOR.fields_by_name
        field = _POOL_FIELD.get(rpc, "pool")
        if field and field in fields and (getattr(request, field) or "session_id" not in fields):
            return str(getattr(request, field))
        pool = self.session_pool.get(getattr(request, "session_id", "") if "session_id" in fields else "", "")
        if pool and field in fields:
            setattr(request, field, pool)
        return pool

    def route(self, pool: str) -> str:
        """The address to call for ``pool``: its known owner, else the first address."""
        return self.owner.get(pool) or self.primary

    def answered(self, rpc: str, request: Any, response: Any, pool: str, address: str) -> None:
        """A call succeeded at ``address``: remember the pool's owner, a new session's
        pool, and the replica a pool's description names as the one that answered."""
        with self._lock:
            self.down.pop(address, None)
            if pool:
                self.owner[pool] = address
            if rpc in _DESCRIBED:
                self._name(address, response.pool.replica_name)
            if rpc == "Attach":
                self.session_pool[response.session_id] = request.pool
                while len(self.session_pool) > MAX_SESSIONS:
                    del self.session_pool[next(iter(self.session_pool))]
            elif rpc == "Detach":
                self.session_pool.pop(request.session_id, None)

    def listed(self, pool: str, address: str, replica: str = "") -> None:
        """``address`` listed ``pool`` among the pools it serves: its owner
        (``replica``: the name the listing gave the replica that answered)."""
        with self._lock:
            self.owner[pool] = address
            self._name(address, replica)

    def _name(self, address: str, replica: str) -> None:
        """``replica`` ("<cluster>/<replica id>"; "" none: a single node, or a replica of
        an earlier release) is at ``address``: calls sent there name it."""
        if replica:
            self.named[address] = replica
        else:
            self.named.pop(address, None)

    def redirected(self, pool: str, owner: str, by: str = "", replica: str = "") -> bool:
        """The replica at ``by`` named ``owner`` as ``pool``'s (``replica``: its
        "<cluster>/<replica id>", named in the calls sent there from now on). False when
        ``owner`` is marked down (less than :data:`RECHECK_DOWN` seconds ago): not
        followed, the naming replica's view is behind (the dead owner's claim has not
        lapsed)."""
        with self._lock:
            self.down.pop(by, None)
            self._name(owner, replica)
            marked = self.down.get(owner)
            if marked is not None and self.clock() - marked < RECHECK_DOWN:
                if self.owner.get(pool) == owner:
                    del self.owner[pool]
                return False
            self.owner[pool] = owner
            if owner not in self.addresses:
                self.addresses = [*self.addresses, owner]
            return True

    def changing(self, pool: str, address: str) -> None:
        """``address`` answered that ``pool`` is changing owner there: it stays the
        pool's owner (it serves the pool or names the next owner shortly)."""
        with self._lock:
            self.down.pop(address, None)
            self.owner[pool] = address

    def unreachable(self, pool: str, address: str) -> None:
        """``address`` did not answer for ``pool``: forget it as the owner, mark it
        down (tried after the others until it answers), and resolve the names again
        (the replica set may have changed: a pod rescheduled, a replica added)."""
        with self._lock:
            if self.owner.get(pool) == address:
                del self.owner[pool]
            if len(self.addresses) > 1:
                self.down[address] = self.clock()
                if address in self.addresses:
                    self.addresses = [a for a in self.addresses if a != address] + [address]
            self.refresh()

    def wrong_replica(self, pool: str, address: str) -> None:
        """The server at ``address`` refused a call as meant for another replica than it is
        (WRONG_REPLICA): treated as unreachable, and from now on calls there name any
        replica of the cluster the refused name was of (``<cluster>/*``): a replica of that
        cluster given the address since (a recycled pod IP) serves them again, and any
        other server still refuses them (was: the old name, refused there for good)."""
        with self._lock:
            named = self.named.get(address, "")
            if named and not named.endswith("/*"):
                self.named[address] = f"{named.partition('/')[0]}/*"
        self.unreachable(pool, address)

    def failed(self, err: KVCoordError, pool: str, address: str, hops: int, kind: str) -> str:
        """What to do after an attempt at ``address`` failed with ``err``: :data:`AGAIN`
        (a redirect to follow, or another replica to ask at once), :data:`SETTLE`
        (the set is changing hands: a short pause, then ask again) or "" (the retry
        policy decides). ``kind`` is the call's (``_requests.RPCS``); at most
        :data:`MAX_HOPS` calls in a row go out without a pause.

        A redirect to a live owner is followed (any call: NOT_OWNER applied nothing);
        one to an owner marked down is not, and an unkeyed mutation ("once") is then
        answered with the NotOwnerError. An owner that did not answer is forgotten and
        marked down; a read, a keyed call or an Attach (sent again under its
        attach_key: the session a lost answer named, as a keyed call's answer) is sent
        at once to the replica now first (its answer says where the pool is; was: an
        Attach waited a backoff of its retry policy first, and with none left failed)."""
        if isinstance(err, WrongReplicaError):  # (a call naming no pool too: ScorePools, ListPools)
            self.wrong_replica(pool, address)
            return AGAIN if hops < MAX_HOPS and self.route(pool) != address else ""
        if not pool:
            return ""
        repeatable = kind in ("read", "keyed", "attach")
        if isinstance(err, NotOwnerError) and err.owner:
            if hops >= MAX_HOPS:
                return ""
            if self.redirected(pool, err.owner, address, err.owner_replica):
                return AGAIN
            return SETTLE if repeatable else ""
        if isinstance(err, OwnerChangingError):
            self.changing(pool, address)
            return SETTLE if repeatable else ""
        if isinstance(err, UnavailableError) and not isinstance(err, GracePeriodError):
            self.unreachable(pool, address)
            # A stopped owner's address may refuse connections or swallow packets (the
            # read then ends in DEADLINE_EXCEEDED, which no retry policy repeats): a
            # read, keyed call or Attach is safe to send again, and another replica
            # routes it. A call that never reached the replica (no connection), or that
            # a server refused as meant for another replica (WRONG_REPLICA: the
            # redirect's address has another server now), applied nothing: it is safe
            # to send anywhere, whatever its kind.
            if (repeatable or never_sent(err)) and hops < MAX_HOPS and self.route(pool) != address:
                return AGAIN
        return ""
