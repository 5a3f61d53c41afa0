"""Which etcd endpoints a replica's store connection tries, and in what order
(:class:`~kvcoord.service.cluster_store.ClusterStore`'s connections)."""

from __future__ import annotations

__all__ = ["candidates", "targets"]


def targets(endpoints: list[str], turn: int = 0) -> list[str]:
    """What to connect to, in order, starting at endpoint ``turn`` (modulo their
    number). Endpoints that are all IPv4 addresses become one gRPC target listing them
    all, so the channel moves to another store member by itself when the one it uses
    dies (pick-first over the list); names are tried one by one at start (a Kubernetes
    service name already leads to a live member)."""
    first = turn % len(endpoints) if endpoints else 0
    endpoints = endpoints[first:] + endpoints[:first]
    hosts = [e.rpartition(":")[0] for e in endpoints]
    if len(endpoints) > 1 and all(_is_ipv4(h) for h in hosts):
        return ["ipv4:" + ",".join(endpoints)]
    return endpoints


def candidates(endpoints: list[str], turn: int) -> list[str]:
    """The targets a new connection tries, in order, starting at endpoint ``turn``:
    :func:`targets`, and when that is one target listing them all, that list started
    at each endpoint in turn (its first is the one the channel connects to)."""
    out = targets(endpoints, turn)
    if len(out) == 1 and len(endpoints) > 1:
        return [targets(endpoints, turn + k)[0] for k in range(len(endpoints))]
    return out


def _is_ipv4(host: str) -> bool:
    parts = host.split(".")
    return len(parts) == 4 and all(p.isdigit() and int(p) < 256 for p in parts)
