"""Tenants, roles and the one table that says which role every RPC needs.

Every caller is a :class:`Tenant`. :class:`AccessControl` finds it from the call's
credentials (a bearer token, else a name of the mTLS client certificate, typed by the
field it comes from: ``cn:`` subject CN, ``dns:`` DNS SAN, ``uri:`` URI SAN) and checks
it against :data:`RPC_RULES` before any handler runs. Tenants hold roles
on pools by name pattern (``fnmatch`` globs):

=============  ==================================================================
``administer`` CreatePool, DeletePool, ResetPrefixCache, InspectPool, CheckPool,
               ListSessions, the
               Step operations EvictBlocksOp and ResetPrefixCacheOp, and an exclusive
               Attach (it locks every other tenant out of the pool) or one with
               reset_prefix_cache
``use``        Attach, Heartbeat, Detach, FindLongestCacheHit, Allocate, Free, Step
``observe``    GetPool, GetStats, WatchEvents, ScorePools (on every pool it scores;
               ListPools shows only pools the tenant holds some role on)
=============  ==================================================================

A token listed only in ``[server] auth_tokens``, and every caller of a server with
neither tokens nor tenants, is :data:`FULL_ACCESS`: every role on every pool, the
pool's shared prefix cache. A session belongs to the tenant that attached it.

Tenants see only themselves: a pool's ``shared_cache_tenants`` (other tenants' names)
is shown only to the pool's administrators (:meth:`AccessControl.pool_config_for`).
InspectPool, CheckPool and ListSessions need the administer role, so only administrators
see every tenant's requests and sessions of a pool.

Plain Python: no gRPC types beyond the status codes of the errors raised.
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
import fnmatch
import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from .bounds import MAX_NAME_LENGTH
from .errors import ServiceError, Status
from .sessions import SessionTable

__all__ = [
    "EXCLUSIVE_ATTACH_ROLE",
    "FULL_ACCESS",
    "RPC_RULES",
    "STEP_OP_ROLES",
    "AccessControl",
    "Grant",
    "Role",
    "Rule",
    "Tenant",
    "checked_tenant",
    "current_tenant",
    "tenants_from_dict",
]


class Role(enum.Enum):
    ADMINISTER = "administer"
    USE = "use"
    OBSERVE = "observe"


@dataclasses.dataclass(frozen=True, slots=True)
class Grant:
    """``roles`` on every pool whose name matches one of ``pools`` (globs)."""

    pools: tuple[str, ...]
    roles: frozenset[Role]


@dataclasses.dataclass(frozen=True, slots=True)
class Tenant:
    """A set of credentials and what they may do.

    Args:
        name: the tenant's name ("" for the built-in full-access tenant).
        grants: roles on pools.
        tokens: bearer tokens (secrets: never printed).
        identities: mTLS client-certificate names, typed: ``cn:<subject CN>``,
            ``dns:<DNS SAN>`` or ``uri:<URI SAN>``.
        max_sessions: live sessions allowed (0: ``[limits] max_sessions_per_tenant``).
    """

    name: str
    grants: tuple[Grant, ...] = ()
    tokens: tuple[str, ...] = dataclasses.field(default=(), repr=False)
    identities: tuple[str, ...] = ()
    max_sessions: int = 0

    @property
    def full_access(self) -> bool:
        return self.name == ""

    @property
    def label(self) -> str:
        """The name for messages and logs."""
        return repr(self.name) if self.name else "(full access)"

    def roles_on(self, pool: str) -> frozenset[Role]:
        """Every role this tenant holds on ``pool``."""
        out: set[Role] = set()
        for g in self.grants:
            if any(fnmatch.fnmatchcase(pool, p) for p in g.pools):
                out |= g.roles
        return frozenset(out)


FULL_ACCESS = Tenant("", (Grant(("*",), frozenset(Role)),))

_CALLER: contextvars.ContextVar[Tenant] = contextvars.ContextVar("kvcoord_caller", default=FULL_ACCESS)
#: the tenant the check of the call being handled named (None before, or when it failed)
_CHECKED: contextvars.ContextVar[Tenant | None] = contextvars.ContextVar("kvcoord_checked", default=None)


def current_tenant() -> Tenant:
    """The tenant of the call being handled (full access outside a checked call)."""
    return _CALLER.get()


def checked_tenant() -> Tenant | None:
    """The tenant the call being handled was authenticated as; None when it was not
    (refused before authentication, or not a checked call). For the access log."""
    return _CHECKED.get()


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """What an RPC needs: ``role`` on the pool named by ``pool_field`` of the request
    (``None``: the pool of the session the request names; ``role`` ``None``: only an
    authenticated caller, the handler filters)."""

    role: Role | None
    pool_field: str | None = "pool"
    #: ``pool_field`` is a repeated field: the role is needed on every pool it names
    #: (none named: the handler keeps only the pools the tenant holds the role on)
    many: bool = False


_A, _U, _O = Role.ADMINISTER, Role.USE, Role.OBSERVE

#: RPC name -> what it needs. Every Allocator RPC is listed (a test checks it).
RPC_RULES: Mapping[str, Rule] = {
    "CreatePool": Rule(_A, "name"),
    "DeletePool": Rule(_A, "name"),
    "GetPool": Rule(_O, "name"),
    "ListPools": Rule(None, None),
    "Attach": Rule(_U),
    "Heartbeat": Rule(_U, None),
    "Detach": Rule(_U, None),
    "FindLongestCacheHit": Rule(_U),
    "Allocate": Rule(_U),
    "Free": Rule(_U),
    "Step": Rule(_U),
    "StepStream": Rule(_U),  # (each message is checked as a Step)
    "ResetPrefixCache": Rule(_A),
    "GetStats": Rule(_O),
    "InspectPool": Rule(_A),
    "WatchEvents": Rule(_O),
    "CheckPool": Rule(_A),
    "ScorePools": Rule(_O, "candidate_pools", many=True),
    "ListSessions": Rule(_A),
}

#: Step operations that need more than ``use`` (they touch other requests' blocks).
STEP_OP_ROLES: Mapping[str, Role] = {"evict_blocks": _A, "reset_prefix_cache": _A}

#: What an Attach with ``exclusive`` needs besides ``use``: the session keeps every
#: other session, of any tenant, off the pool.
EXCLUSIVE_ATTACH_ROLE = _A


def _digest(token: str | bytes) -> bytes:
    data = token.encode() if isinstance(token, str) else token
    return hashlib.sha256(data).digest()


class AccessControl:
    """Authentication (credentials -> tenant) and authorization (:data:`RPC_RULES`).

    Args:
        tenants: the configured tenants.
        auth_tokens: tokens of the full-access tenant (``[server] auth_tokens``).
        sessions: the server's sessions (a session belongs to one tenant).
    """

    def __init__(self, tenants: Sequence[Tenant], auth_tokens: Iterable[str], sessions: SessionTable) -> None:
        self.tenants = {t.name: t for t in tenants}
        self.sessions = sessions
        # Tokens are looked up by digest: a dict probe, no comparison of secrets.
        self._by_token: dict[bytes, Tenant] = {_digest(t): FULL_ACCESS for t in auth_tokens if t}
        self._by_identity: dict[str, Tenant] = {}
        for t in tenants:
            for token in t.tokens:
                self._by_token[_digest(token)] = t
            for ident in t.identities:
                self._by_identity[ident] = t
        #: credentials are required (auth_tokens or tenants are configured)
        self.required = bool(self._by_token or self._by_identity)

    # -- authentication ---------------------------------------------------------------
    def authenticate(
        self, metadata: Iterable[tuple[str, Any]] | None, auth_context: Callable[[], Mapping[str, Any]]
    ) -> Tenant:
        """The caller's tenant: its bearer token's, else its client certificate's.

        Raises:
            ServiceError: UNAUTHENTICATED (the message never contains the token).
        """
        if not self.required:
            return FULL_ACCESS
        for key, value in metadata or ():
            if key == "authorization":
                if isinstance(value, bytes):
                    value = value.decode("latin-1")
                if isinstance(value, str) and value.startswith("Bearer "):
                    tenant = self._by_token.get(_digest(value[len("Bearer ") :]))
                    if tenant is not None:
                        return tenant
                raise ServiceError(
                    Status.UNAUTHENTICATED,
                    "missing or invalid bearer token: the token sent is not one the server knows "
                    "(send 'authorization: Bearer <token>', client option token=...)",
                )
        if self._by_identity:
            for ident in certificate_names(auth_context()):
                tenant = self._by_identity.get(ident)
                if tenant is not None:
                    return tenant
        raise ServiceError(
            Status.UNAUTHENTICATED,
            "missing or invalid bearer token: send 'authorization: Bearer <token>' (client option token=...)"
            + (" or a client certificate naming a tenant" if self._by_identity else ""),
        )

    # -- authorization ----------------------------------------------------------------
    def authorize(self, tenant: Tenant, rpc: str, request: Any) -> None:
        """Check ``tenant`` may make this call.

        Raises:
            ServiceError: PERMISSION_DENIED naming the tenant, the pool and the role.
        """
        rule = RPC_RULES[rpc]
        session_id = getattr(request, "session_id", "")
        s = self.sessions.sessions.get(session_id) if session_id else None
        if s is not None and s.tenant != tenant.name:
            raise ServiceError(
                Status.DENIED,
                f"session {session_id[:64]!r} belongs to another tenant than {tenant.label}",
            )
        if rule.role is None or tenant.full_access:
            return
        if rule.many:
            assert rule.pool_field is not None
            for pool in getattr(request, rule.pool_field):
                self._require(tenant, rpc, pool, {rule.role})
            return
        if rule.pool_field is not None:
            pool = getattr(request, rule.pool_field)
        elif s is not None:
            pool = s.pool
        else:
            return  # no such session: the handler answers SESSION_EXPIRED
        held = tenant.roles_on(pool)
        needed = {rule.role}
        if rpc == "Step":
            for o in request.ops:
                extra = STEP_OP_ROLES.get(o.WhichOneof("op") or "")
                if extra is not None:
                    needed.add(extra)
        elif rpc == "Attach" and (request.exclusive or request.reset_prefix_cache):
            needed.add(EXCLUSIVE_ATTACH_ROLE)  # (a reset forgets every tenant's cached blocks)
        self._require(tenant, rpc, pool, needed, held)

    @staticmethod
    def _require(
        tenant: Tenant, rpc: str, pool: str, needed: set[Role], held: frozenset[Role] | None = None
    ) -> None:
        if held is None:
            held = tenant.roles_on(pool)
        missing = sorted(r.value for r in needed - held)
        if missing:
            raise ServiceError(
                Status.DENIED,
                f"tenant {tenant.label} lacks the {' and '.join(missing)} role on pool {pool[:128]!r} "
                f"({rpc} needs it)",
            )

    @staticmethod
    def bind(tenant: Tenant) -> None:
        """Make ``tenant`` the :func:`current_tenant` of the call being handled (the
        handler runs in the same task)."""
        _CALLER.set(tenant)
        _CHECKED.set(tenant)

    def holds(self, tenant: Tenant, role: Role, pool: str) -> bool:
        """True when ``tenant`` holds ``role`` on ``pool``."""
        return tenant.full_access or role in tenant.roles_on(pool)

    def visible(self, tenant: Tenant, pool: str) -> bool:
        """True when ``tenant`` holds some role on ``pool`` (ListPools shows it)."""
        return tenant.full_access or bool(tenant.roles_on(pool))

    @staticmethod
    def administers(tenant: Tenant, pool: str) -> bool:
        """True when ``tenant`` holds the administer role on ``pool``."""
        return tenant.full_access or Role.ADMINISTER in tenant.roles_on(pool)

    def pool_config_for(self, tenant: Tenant, pool: str, config: Any) -> Any:
        """The pool's configuration as ``tenant`` may see it: its administrators see it
        all; anyone else sees of ``shared_cache_tenants`` only ``"*"`` and its own name
        (whether its cache is shared), never other tenants' names. ``config`` is not
        changed (a copy is filtered)."""
        if self.administers(tenant, pool) or not config.shared_cache_tenants:
            return config
        seen = type(config)()
        seen.CopyFrom(config)
        kept = [t for t in config.shared_cache_tenants if t in ("*", tenant.name)]
        del seen.shared_cache_tenants[:]
        seen.shared_cache_tenants.extend(kept)
        return seen

    def max_sessions(self, tenant: Tenant, default: int) -> int:
        return tenant.max_sessions or default


#: identity type -> the gRPC auth-context property of a verified client certificate
#: that carries it: the subject CN, DNS SANs and URI SANs ("x509_subject_alternative_name"
#: would add email and IP SANs, which the contract does not name). Each has its own
#: namespace: a CN equal to another tenant's DNS name names nobody.
IDENTITY_TYPES: Mapping[str, str] = {"cn": "x509_common_name", "dns": "peer_dns", "uri": "peer_uri"}


def certificate_names(auth_context: Mapping[str, Any]) -> list[str]:
    """The typed names of a verified client certificate (gRPC's auth context):
    ``cn:<subject CN>``, ``dns:<DNS SAN>``, ``uri:<URI SAN>``."""
    names: list[str] = []
    for kind, key in IDENTITY_TYPES.items():
        for value in auth_context.get(key, ()):
            names.append(f"{kind}:" + (value.decode() if isinstance(value, bytes) else str(value)))
    return names


def _identities(value: Any, where: str) -> tuple[str, ...]:
    """A tenant's ``identities``: each typed (``cn:``, ``dns:`` or ``uri:``).

    An untyped name is refused rather than matched against every field (as before
    typing): a certificate's CN is often free text a CA does not verify, so a CN must
    never stand for a DNS or URI name the CA did verify.
    """
    names = _strings(value, where)
    for i, name in enumerate(names):
        kind, sep, rest = name.partition(":")
        if sep and kind in IDENTITY_TYPES and rest:
            continue
        if kind in ("email", "ip"):
            raise ValueError(
                f"{where}[{i}]: {name[:200]!r}: email and IP SANs name no tenant (cn, dns or uri)"
            )
        raise ValueError(
            f'{where}[{i}]: {name[:200]!r} names no certificate field: write "cn:{name[:200]}" (subject '
            f'CN), "dns:{name[:200]}" (DNS SAN) or "uri:{name[:200]}" (URI SAN); untyped identities, '
            "which matched any of the three, are refused"
        )
    return names


# -- configuration -------------------------------------------------------------------
_TENANT_KEYS = {"tokens", "identities", "grants", "max_sessions"}
_GRANT_KEYS = {"pools", "roles"}


def _strings(value: Any, where: str) -> tuple[str, ...]:
    # A lone string is refused, not taken as a list of one: the same mistake in a list
    # of secrets must never be guessed at (see config.string_list).
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        got = "a string" if isinstance(value, str) else type(value).__name__
        raise ValueError(f'{where}: must be a list of non-empty strings, got {got} (write ["..."])')
    return tuple(value)


def tenants_from_dict(
    d: Any, auth_tokens: Sequence[str] = (), auth_tokens_key: str = "server.auth_tokens"
) -> tuple[Tenant, ...]:
    """The ``[tenants]`` table: ``[tenants.<name>]`` with tokens, identities, grants.

    Args:
        d: the table.
        auth_tokens: the full-access tokens, which no tenant may hold too.
        auth_tokens_key: where those come from (named in the error).

    Raises:
        ValueError: names the key: an empty tenant name, unknown keys or roles, a
            string where a list is required, a token or identity given to two tenants
            (or a tenant token also in ``auth_tokens``).
    """
    if not isinstance(d, Mapping):
        raise ValueError("tenants: must be a table of [tenants.<name>] tables")
    out = []
    tokens: dict[str, str] = {t: auth_tokens_key for t in auth_tokens}
    identities: dict[str, str] = {}
    for name, t in d.items():
        where = f"tenants.{name}"
        if not isinstance(name, str) or not name.strip():
            # "" is the built-in full-access tenant's name (Tenant.full_access)
            raise ValueError(f"tenants.{name!r}: a tenant needs a non-empty name")
        if len(name) > MAX_NAME_LENGTH:
            # names reach messages, sessions, cache namespaces and the journal
            raise ValueError(
                f"tenants.{name[:32]!r}...: a tenant name has at most {MAX_NAME_LENGTH} characters"
            )
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: must be a table")
        unknown = set(t) - _TENANT_KEYS
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {sorted(unknown)} (known: {sorted(_TENANT_KEYS)})")
        if not t.get("tokens") and not t.get("identities"):
            raise ValueError(f"{where}: needs tokens or identities (else nobody can act as it)")
        grants = []
        if not isinstance(t.get("grants", []), list):
            raise ValueError(f"{where}.grants: must be a list of {{ pools = [...], roles = [...] }} tables")
        for i, g in enumerate(t.get("grants", [])):
            gwhere = f"{where}.grants[{i}]"
            if not isinstance(g, Mapping) or set(g) != _GRANT_KEYS:
                raise ValueError(f"{gwhere}: must have exactly the keys pools and roles")
            roles = _strings(g["roles"], f"{gwhere}.roles")
            bad = [r for r in roles if r not in {x.value for x in Role}]
            if bad:
                raise ValueError(f"{gwhere}.roles: unknown role(s) {bad} (administer, use, observe)")
            grants.append(Grant(_strings(g["pools"], f"{gwhere}.pools"), frozenset(Role(r) for r in roles)))
        max_sessions = t.get("max_sessions", 0)
        if isinstance(max_sessions, bool) or not isinstance(max_sessions, int) or max_sessions < 0:
            raise ValueError(f"{where}.max_sessions: must be an integer >= 0")
        tenant = Tenant(
            str(name),
            tuple(grants),
            _strings(t.get("tokens", []), f"{where}.tokens") if t.get("tokens") else (),
            _identities(t.get("identities", []), f"{where}.identities") if t.get("identities") else (),
            max_sessions,
        )
        for i, token in enumerate(tenant.tokens):
            if token in tokens:
                # Never print the token: say where both copies are.
                raise ValueError(f"{where}.tokens[{i}]: the same token is also given in {tokens[token]}")
            tokens[token] = f"{where}.tokens"
        for ident in tenant.identities:
            if ident in identities:
                raise ValueError(f"{where}.identities: {ident!r} is also an identity of {identities[ident]}")
            identities[ident] = where
        out.append(tenant)
    return tuple(out)
