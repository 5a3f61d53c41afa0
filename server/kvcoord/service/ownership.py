"""Which replica serves which pool: the rules, in plain Python (no store, no I/O).

A cluster of kvcoord replicas shares its membership and ownership through a
replicated store (etcd: :mod:`.cluster_store` does the I/O). This module holds what the
replicas decide from what the store says:

* **Members** are the live replicas: a replica id and the address clients reach it
  at. A member is live while its key exists in the store, under a lease it keeps
  alive.
* **Placement** is rendezvous (highest random weight) hashing of the pool name over
  the live members: every member scores ``blake2b(replica id, pool)`` and the highest
  score wins. Adding a member moves only the pools it wins; removing one moves only
  the pools it held. Every replica computes the same answer from the same members.
* **Ownership** is a claim: the pool's owner key in the store, created in a
  compare-and-swap transaction under the claimant's lease. A replica serves a pool
  only while it holds that pool's claim, whatever placement says: placement decides
  who *should* claim an unclaimed pool (and, later, where a pool is handed over to),
  the claim decides who *does* serve it. So two replicas never serve one pool, even
  while their views of the membership differ.

:class:`Ownership` is one replica's view; :meth:`Ownership.check` is the rule every
pool call passes through before it reaches the pool.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections.abc import Callable, Iterable, Mapping

from .errors import REPLICA_METADATA_KEY, ErrorReason, ServiceError, Status

__all__ = [
    "Claim",
    "Member",
    "Ownership",
    "check_addressed",
    "decode_claim",
    "decode_member",
    "encode_claim",
    "encode_member",
    "moved_pools",
    "owner_of",
    "replica_name",
    "score",
]


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Member:
    """A live replica: its id (stable across restarts) and its advertised address."""

    replica_id: str
    address: str


@dataclasses.dataclass(frozen=True, slots=True)
class Claim:
    """A pool's ownership as the store holds it.

    ``term`` is the store revision that created the claim: it grows with every new
    claim of the pool (by anyone), so a later owner always holds a higher term.
    """

    pool: str
    replica_id: str
    address: str
    term: int


def score(replica_id: str, pool: str) -> int:
    """The rendezvous weight of ``replica_id`` for ``pool`` (the same on every host)."""
    digest = hashlib.blake2b(
        replica_id.encode() + b"\x00" + pool.encode(), digest_size=8, person=b"kvcoord-hrw"
    ).digest()
    return int.from_bytes(digest, "big")


def owner_of(pool: str, members: Iterable[Member]) -> Member | None:
    """The member that should own ``pool`` (``None`` without members): the highest
    :func:`score`, ties broken by the larger replica id."""
    best: Member | None = None
    best_key = (-1, "")
    for m in members:
        key = (score(m.replica_id, pool), m.replica_id)
        if key > best_key:
            best, best_key = m, key
    return best


def moved_pools(pools: Iterable[str], before: Iterable[Member], after: Iterable[Member]) -> dict[str, tuple[Member | None, Member | None]]:  # fmt: skip
    """The pools whose placement differs between two memberships: pool -> (old, new)."""
    old, new = list(before), list(after)
    out = {}
    for pool in pools:
        a, b = owner_of(pool, old), owner_of(pool, new)
        if (a and a.replica_id) != (b and b.replica_id):
            out[pool] = (a, b)
    return out


def encode_member(member: Member) -> bytes:
    return json.dumps({"replica": member.replica_id, "address": member.address}).encode()


def decode_member(value: bytes) -> Member:
    """Raises: ValueError: not a member record."""
    d = json.loads(value)
    if (
        not isinstance(d, dict)
        or not isinstance(d.get("replica"), str)
        or not isinstance(d.get("address"), str)
    ):
        raise ValueError(f"not a kvcoord member record: {value[:200]!r}")
    return Member(d["replica"], d["address"])


def encode_claim(replica_id: str, address: str) -> bytes:
    return json.dumps({"replica": replica_id, "address": address}).encode()


def decode_claim(pool: str, value: bytes, term: int) -> Claim:
    """Raises: ValueError: not a claim record."""
    m = decode_member(value)
    return Claim(pool, m.replica_id, m.address, term)


class Ownership:
    """One replica's view of the cluster, and the rule every pool call obeys.

    Args:
        me: this replica.
        clock: monotonic seconds (what :attr:`valid_until` is counted in).
        cluster: the cluster's name (a redirect names its owner as
            ``"<cluster>/<replica id>"``: :func:`replica_name`).
    """

    def __init__(self, me: Member, clock: Callable[[], float] = time.monotonic, cluster: str = "") -> None:
        self.me = me
        self.clock = clock
        self.cluster = cluster
        #: the live members by replica id, as last read from the store
        self.members: dict[str, Member] = {}
        #: every pool's claim, as last read from the store
        self.claims: dict[str, Claim] = {}
        #: pool -> store revision of the last claim change this replica made or saw
        self._changed_at: dict[str, int] = {}
        #: pools that exist in the cluster (the store's catalog): a pool listed here
        #: that nobody claims is not "not found" but unavailable
        self.catalog: set[str] = set()
        #: until when this replica's lease is sure to be alive (the send time of its
        #: last successful renewal plus the lease's TTL): after it, it serves no pool,
        #: since another replica may already hold its claims
        self.valid_until = 0.0
        #: pools this replica is handing over: served by nobody until the new owner
        #: claims them (callers retry)
        self.moving: set[str] = set()

    @property
    def lease_valid(self) -> bool:
        return self.clock() < self.valid_until

    def lease_lost(self) -> None:
        """This replica's lease ended (the store said so): nothing is served until it is
        registered again, and the claims it held ended with it. Never served again from
        this view once registered (its lease valid) before the claims are read again (was:
        a pool taken over meanwhile was answered from the old copy, reads showing the
        state before the takeover)."""
        self.valid_until = 0.0
        self.claims = {p: c for p, c in self.claims.items() if c.replica_id != self.me.replica_id}

    # -- what the store says -----------------------------------------------------
    def set_members(self, members: Iterable[Member]) -> None:
        self.members = {m.replica_id: m for m in members}

    def set_claims(self, claims: Iterable[Claim], revision: int | None = None) -> None:
        """The claims as read from the store at ``revision``. A change this replica
        made (:meth:`learned`) after that revision is kept: a read that started before
        a claim was taken over must not bring the old holder back."""
        fresh = {c.pool: c for c in claims}
        if revision is not None:
            for pool, rev in list(self._changed_at.items()):
                if rev <= revision:
                    del self._changed_at[pool]
                elif pool in self.claims:
                    fresh[pool] = self.claims[pool]
                else:
                    fresh.pop(pool, None)
        self.claims = fresh

    def learned(self, pool: str, claim: Claim | None, revision: int) -> None:
        """This replica changed (or read) ``pool``'s claim at store ``revision``."""
        if claim is None:
            self.claims.pop(pool, None)
        else:
            self.claims[pool] = claim
        self._changed_at[pool] = max(revision, self._changed_at.get(pool, 0))

    def set_catalog(self, pools: Iterable[str]) -> None:
        self.catalog = set(pools)

    # -- decisions -----------------------------------------------------------------
    def placed_here(self, pool: str) -> bool:
        """Placement (rendezvous over the live members) names this replica."""
        owner = owner_of(pool, self.members.values())
        return owner is not None and owner.replica_id == self.me.replica_id

    def holds(self, pool: str) -> bool:
        """This replica holds ``pool``'s claim (and its lease is valid)."""
        c = self.claims.get(pool)
        return self.lease_valid and c is not None and c.replica_id == self.me.replica_id

    def term(self, pool: str) -> int:
        """The term of ``pool``'s claim (0 when unclaimed)."""
        c = self.claims.get(pool)
        return c.term if c is not None else 0

    def owned(self) -> list[str]:
        """The pools this replica holds, in name order."""
        return sorted(p for p in self.claims if self.holds(p))

    def hand_overs(self) -> dict[str, Member]:
        """The pools this replica holds that placement now puts on another live
        member (one joined): pool -> where to hand it over."""
        out = {}
        for pool in self.owned():
            target = owner_of(pool, self.members.values())
            if target is not None and target.replica_id != self.me.replica_id and pool not in self.moving:
                out[pool] = target
        return out

    def leaving(self) -> dict[str, Member]:
        """Where each pool this replica holds goes when it leaves: placement over the
        other live members (none: the pool stays unclaimed until this replica is back)."""
        others = [m for m in self.members.values() if m.replica_id != self.me.replica_id]
        out = {}
        for pool in self.owned():
            target = owner_of(pool, others)
            if target is not None:
                out[pool] = target
        return out

    def may_adopt(self, pool: str, from_replica: str) -> bool:
        """Placement puts ``pool`` here once ``from_replica`` is left out (it hands its
        pool over because a member joined, or because it leaves)."""
        target = owner_of(pool, [m for m in self.members.values() if m.replica_id != from_replica])
        return target is not None and target.replica_id == self.me.replica_id

    def orphans(self) -> list[str]:
        """Pools of the cluster's catalog nobody claims that placement puts here (their
        owner is gone): with the journal in the store, this replica takes them over."""
        return sorted(
            p for p in self.catalog if p not in self.claims and p not in self.moving and self.placed_here(p)
        )

    def should_claim(self, local_pools: Iterable[str]) -> list[str]:
        """Pools this replica holds state of, that nobody claims: it claims them
        (a restart recovering its journal, a claim lost with an expired lease)."""
        return sorted(p for p in local_pools if p not in self.claims)

    def check(self, pool: str, local: bool) -> None:
        """Pass when this replica serves ``pool``; otherwise raise what the caller must do.

        ``local``: this replica holds state of the pool. A pool nobody claims is served
        by nobody: when placement names this replica and it holds no state of it the
        call goes on (CreatePool claims first; any other call finds no pool), otherwise
        the caller is sent to the placed member, or told to retry while this replica
        claims the state it holds.

        Raises:
            ServiceError: FAILED_PRECONDITION with NOT_OWNER and the owner's address
                (the claim holder, else the placed member); UNAVAILABLE when this
                replica's lease may have ended or no member is known; UNAVAILABLE with
                OWNER_CHANGING (the caller keeps asking this replica) while the pool moves
                here or away: handed over, claimed, rebuilt, or in the catalog with nobody
                claiming it and placed here (its owner is gone).
        """
        if not self.lease_valid:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"replica {self.me.replica_id!r} cannot reach the cluster store: it serves no pool until "
                "its membership lease is renewed (retry; another replica may own the pool)",
            )
        claim = self.claims.get(pool)
        if pool in self.moving:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {pool[:200]!r} is changing owner at replica {self.me.replica_id!r} (being handed over, "
                "claimed or rebuilt): retry here",
                ErrorReason.OWNER_CHANGING,
            )
        if claim is not None:
            if claim.replica_id == self.me.replica_id:
                return
            raise not_owner(pool, claim.replica_id, claim.address, self.me.replica_id, self.cluster)
        placed = owner_of(pool, self.members.values())
        if placed is None:
            raise ServiceError(Status.UNAVAILABLE, "the cluster has no live member (the store lists none)")
        if placed.replica_id != self.me.replica_id:
            raise not_owner(pool, placed.replica_id, placed.address, self.me.replica_id, self.cluster)
        if local:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"replica {self.me.replica_id!r} holds pool {pool[:200]!r} but has not claimed it yet: retry",
                ErrorReason.OWNER_CHANGING,
            )
        if pool in self.catalog:
            raise ServiceError(
                Status.UNAVAILABLE,
                f"pool {pool[:200]!r} exists in the cluster but no live replica holds it (its owner "
                f"stopped without handing it over): replica {self.me.replica_id!r} takes it over (with the "
                "journal in the store) or waits for its owner to come back: retry here",
                ErrorReason.OWNER_CHANGING,
            )

    def snapshot(self) -> Mapping[str, object]:
        """What an operator sees (GetStats / logs): members, held pools."""
        return {
            "replica": self.me.replica_id,
            "members": sorted(self.members),
            "owned": self.owned(),
            "lease_valid": self.lease_valid,
        }


def not_owner(pool: str, replica_id: str, address: str, me: str, cluster: str = "") -> ServiceError:
    """The redirect: FAILED_PRECONDITION, NOT_OWNER, naming the owner (its address in
    the ``kvcoord-owner`` trailer and the message, its :func:`replica_name` in
    ``kvcoord-owner-replica``: the client names it in the calls it sends there)."""
    return ServiceError(
        Status.PRECONDITION,
        f"pool {pool[:200]!r} is served by replica {replica_id!r} at {address}, not by {me!r}: "
        "send the call there",
        ErrorReason.NOT_OWNER,
        owner=address,
        owner_replica=replica_name(cluster, replica_id),
    )


def replica_name(cluster: str, replica_id: str) -> str:
    """How a replica is named to clients: ``"<cluster>/<replica id>"``."""
    return f"{cluster}/{replica_id}"


def check_addressed(metadata: Iterable[tuple[str, str | bytes]], me: str) -> None:
    """A call whose request ``metadata`` may name the replica it is meant for
    (``kvcoord-replica``: as a redirect or a pool description named the replica at that
    address; ``"<cluster>/*"``: any replica of a cluster, as a client given the cluster's
    name sends before it knows which one an address is; absent: none) reached the server
    ``me`` (its :func:`replica_name`; "" outside a cluster). A call meant for another
    replica came to an address that replica no longer has (it stopped or moved, and this
    server listens there now, perhaps in another cluster with a pool of the same name):
    it is refused before anything is read or changed, so its client never attaches to,
    allocates from or hits in a pool that is not the one it was sent to.

    Raises:
        ServiceError: UNAVAILABLE, WRONG_REPLICA.
    """
    named = next((v for k, v in metadata if k == REPLICA_METADATA_KEY), "")
    if isinstance(named, bytes):
        named = named.decode(errors="replace")
    if not named or named == me:
        return
    if named.endswith("/*") and me and me.partition("/")[0] == named[:-2]:
        return  # any replica of this replica's cluster
    raise ServiceError(
        Status.UNAVAILABLE,
        f"this call is meant for replica {named[:300]!r}, which this server is not: the address it was "
        "sent to is not that replica's any more (nothing was applied; ask another replica of the set)",
        ErrorReason.WRONG_REPLICA,
    )
