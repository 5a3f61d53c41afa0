"""Which replica to call for a pool: the client's side of a sharded cluster.

A cluster's replicas each serve a disjoint set of pools; a replica called for a pool it
does not serve answers FAILED_PRECONDITION, reason NOT_OWNER, naming the owner's
address. :class:`Routes` is what a client knows: the replica set it was given (a list
of ``host:port``, or a DNS name whose A records are the replicas, e.g. a Kubernetes
headless Service), each pool's owner as last learned, and each session's pool (calls
that carry only a session id go where its pool lives). It does no I/O except resolving
names; the clients (client.py) call it around every RPC.

A single ``host:port`` is a replica set of one: a single-node server never redirects,
so nothing changes for it.
"""

from __future__ import annotations

import ipaddress
import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MAX_HOPS", "Routes", "parse_targets", "resolve"]

#: NOT_OWNER redirects followed for one call (a pool moving twice under a call is rare;
#: more means the replicas disagree, which is reported rather than chased)
MAX_HOPS = 4
#: re-resolve DNS names at most this often (seconds)
RESOLVE_EVERY = 1.0
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
        self.resolver = resolver
        self.clock = clock
        self.addresses: list[str] = []
        self._resolved_at = -float("inf")
        self.refresh()
        #: pool -> the address of its owner, as last learned (a redirect, an answer)
        self.owner: dict[str, str] = {}
        #: session id -> its pool
        self.session_pool: dict[str, str] = {}

    @property
    def primary(self) -> str:
        """Where calls naming no pool go (the first address)."""
        return self.addresses[0]

    def refresh(self) -> None:
        """Resolve the entries again (at most every :data:`RESOLVE_EVERY` seconds);
        addresses learned from redirects are kept."""
        now = self.clock()
        if now - self._resolved_at < RESOLVE_EVERY:
            return
        self._resolved_at = now
        fresh: list[str] = []
        for entry in self.entries:
            fresh.extend(a for a in self.resolver(entry) if a not in fresh)
        learned = [a for a in self.addresses if a not in fresh]
        self.addresses = fresh + learned

    def pool_of(self, rpc: str, request: Any) -> str:
        """The pool a call is about ("" when it names none or an unknown session)."""
        field = _POOL_FIELD.get(rpc, "pool")
        if field and field in request.DESCRIPTOR.fields_by_name:
            return str(getattr(request, field))
        session_id = (
            getattr(request, "session_id", "") if "session_id" in request.DESCRIPTOR.fields_by_name else ""
        )
        return self.session_pool.get(session_id, "")

    def route(self, pool: str) -> str:
        """The address to call for ``pool``: its known owner, else the first address."""
        return self.owner.get(pool) or self.primary

    def answered(self, rpc: str, request: Any, response: Any, pool: str, address: str) -> None:
        """A call succeeded at ``address``: remember the pool's owner and a new session's pool."""
        if pool:
            self.owner[pool] = address
        if rpc == "Attach":
            self.session_pool[response.session_id] = request.pool
            while len(self.session_pool) > MAX_SESSIONS:
                del self.session_pool[next(iter(self.session_pool))]
        elif rpc == "Detach":
            self.session_pool.pop(request.session_id, None)

    def redirected(self, pool: str, owner: str) -> None:
        """A replica named ``owner`` as ``pool``'s."""
        self.owner[pool] = owner
        if owner not in self.addresses:
            self.addresses.append(owner)

    def unreachable(self, pool: str, address: str) -> None:
        """``address`` did not answer for ``pool``: forget it as the owner, try the
        others first next time, and resolve the names again (the replica set may
        have changed: a pod rescheduled, a replica added)."""
        if self.owner.get(pool) == address:
            del self.owner[pool]
        if address in self.addresses and len(self.addresses) > 1:
            self.addresses.remove(address)
            self.addresses.append(address)
        self.refresh()
