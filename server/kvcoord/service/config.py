"""Server configuration: one TOML file (or the embedded default) plus environment overrides.

The tree is frozen dataclasses, validated on load; a bad file fails with the key
path and what was expected.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from kvcoord.engine import EngineError
from kvcoord.v1 import allocator_pb2 as pb
from kvcoord.wire import ConfigFileError, config_from_pb, pool_config_from_table, string_list, tables

from .access import Tenant, tenants_from_dict
from .bounds import check_request
from .errors import ServiceError
from .kv_events_config import KVEventsDecl, kv_events_from_list
from .registry import Limits
from .stalls import lease_outlasts_stalls, lease_rule, max_bound_seconds, min_lease_seconds
from .tls import PeerTLS, TLSFiles, check_tls_files, peer_tls_from_dict, tls_from_dict, tls_from_env

__all__ = [
    "ClusterSettings",
    "ConfigFileError",
    "PoolDecl",
    "ServerConfig",
    "ServerSettings",
    "default_config_text",
    "default_data_dir",
    "load_config",
]

ENV_LISTEN = "KVCOORD_LISTEN"
ENV_METRICS = "KVCOORD_METRICS_LISTEN"
ENV_LOG_LEVEL = "KVCOORD_LOG_LEVEL"
ENV_LOG_FORMAT = "KVCOORD_LOG_FORMAT"
ENV_CONFIG = "KVCOORD_CONFIG"
ENV_TOKENS = "KVCOORD_AUTH_TOKENS"
ENV_TLS_PREFIX = "KVCOORD_TLS_"  # CERT, KEY, CLIENT_CA
ENV_METRICS_TLS_PREFIX = "KVCOORD_METRICS_TLS_"  # CERT, KEY, CLIENT_CA
ENV_DATA_DIR = "KVCOORD_DATA_DIR"
ENV_DURABILITY = "KVCOORD_DURABILITY"
#: [server] journal_stall_seconds when unset
DEFAULT_STALL_SECONDS = 10.0
ENV_CLUSTER_ENDPOINTS = "KVCOORD_CLUSTER_ENDPOINTS"  # comma-separated host:port of the store
ENV_CLUSTER_NAME = "KVCOORD_CLUSTER_NAME"
ENV_REPLICA_ID = "KVCOORD_REPLICA_ID"
ENV_ADVERTISE = "KVCOORD_ADVERTISE_ADDRESS"
ENV_CLUSTER_JOURNAL = "KVCOORD_CLUSTER_JOURNAL"  # "local" | "store"


@dataclasses.dataclass(frozen=True, slots=True)
class ServerSettings:
    listen: tuple[str, ...] = ("127.0.0.1:50051",)
    metrics_listen: str = "127.0.0.1:9400"
    grace_seconds: float = 10.0
    #: gRPC receive/send limit: a larger message is refused before it is parsed
    max_message_bytes: int = 16 * 1024 * 1024
    keepalive_time_seconds: float = 30.0
    keepalive_timeout_seconds: float = 10.0
    session_lease_seconds: float = 30.0
    max_session_lease_seconds: float = 120.0
    log_level: str = "INFO"
    #: "text" (readable lines) or "json" (one JSON object per line; logs.py)
    log_format: str = "text"
    #: one log line per RPC: method, tenant, pool, status, duration (logs.py)
    access_log: bool = False
    auth_tokens: tuple[str, ...] = dataclasses.field(default=(), repr=False)  # secrets: never printed
    tls: TLSFiles = TLSFiles()
    metrics_tls: TLSFiles = TLSFiles()
    #: how long answers to keyed calls are kept for retries, and their byte budget
    idempotency_window_seconds: float = 300.0
    idempotency_max_bytes: int = 64 * 1024 * 1024
    #: the server's data directory: the journal (durability.py) and the lease marker
    #: (lease_marker.py). Programmatic default "" = none; `kvcoord serve` (load_config)
    #: gives a journaled server without one :func:`default_data_dir`
    data_dir: str = ""
    #: "journal": every acknowledged mutation is durable before its answer leaves
    #: (needs a data_dir); "none": state lives in memory only
    durability: str = "journal"
    #: fsync policy of the journal: FULL (survives power loss), NORMAL (survives a
    #: process crash; the last commits may be lost on power loss), OFF (no fsync)
    synchronous: str = "FULL"
    #: journal records between snapshots (bounds recovery time)
    snapshot_every: int = 20_000
    #: a journal commit or lease marker write outstanding this long (a hung disk or
    #: fsync) stops the server as a failed write does (exit 4); a pool's journal write
    #: to etcd (cluster journal "store") this long gives the pool up. Must be below
    #: session_lease_seconds when set; None (unset): 10 s (:attr:`stall_seconds`). With
    #: durable writes the default lease must outlast it (:class:`ServerConfig`)
    journal_stall_seconds: float | None = None
    #: without journaled state: how long after start no session may attach
    startup_grace_seconds: float = 0.0

    def __post_init__(self) -> None:
        if self.session_lease_seconds <= 0 or self.max_session_lease_seconds < self.session_lease_seconds:
            raise ConfigFileError(
                "server.session_lease_seconds must be > 0 and <= server.max_session_lease_seconds"
            )
        if self.idempotency_window_seconds < 2 * self.max_session_lease_seconds:
            raise ConfigFileError(
                "server.idempotency_window_seconds must be at least twice "
                "server.max_session_lease_seconds (clients retry within half the window)"
            )
        if self.idempotency_max_bytes <= 0 or self.startup_grace_seconds < 0:
            raise ConfigFileError("server.idempotency_max_bytes must be > 0 and startup_grace_seconds >= 0")
        if self.durability not in ("none", "journal"):
            raise ConfigFileError(f"server.durability must be 'none' or 'journal', got {self.durability!r}")
        if self.synchronous.upper() not in ("FULL", "NORMAL", "OFF"):
            raise ConfigFileError(f"server.synchronous must be FULL, NORMAL or OFF, got {self.synchronous!r}")
        if self.snapshot_every <= 0:
            raise ConfigFileError("server.snapshot_every must be > 0")
        stall = self.journal_stall_seconds
        if stall is not None:
            if isinstance(stall, bool) or not isinstance(stall, int | float) or not 0 < stall < float("inf"):
                raise ConfigFileError(f"server.journal_stall_seconds must be a number > 0, got {stall!r}")
            if stall >= self.session_lease_seconds:  # workers would lose leases while it waits
                raise ConfigFileError(
                    f"server.journal_stall_seconds ({stall:g}) must be below server.session_lease_seconds "
                    f"({self.session_lease_seconds:g}): the workers waiting on a stalled write must hear "
                    "before their leases end"
                )
        if self.max_message_bytes <= 0:
            raise ConfigFileError("server.max_message_bytes must be > 0")
        if self.log_format not in ("text", "json"):
            raise ConfigFileError(f"server.log_format must be 'text' or 'json', got {self.log_format!r}")
        if not isinstance(self.access_log, bool):
            raise ConfigFileError(f"server.access_log must be true or false, got {self.access_log!r}")

    @property
    def stall_seconds(self) -> float:
        """The stall bound in force: journal_stall_seconds, or when unset 10 s whatever
        the lease. (Not derived from a short lease: a bound of half a 1 s lease stopped
        servers whose commits a loaded machine delayed past it; a deployment with a
        data_dir and leases of 11.579 s or less sets the key below them: ServerConfig
        refuses the lease otherwise.)"""
        if self.journal_stall_seconds is not None:
            return float(self.journal_stall_seconds)
        return DEFAULT_STALL_SECONDS

    @property
    def journaled(self) -> bool:
        """True when acknowledged state survives a restart (journal mode with a data_dir)."""
        return self.durability == "journal" and bool(self.data_dir)


@dataclasses.dataclass(frozen=True, slots=True)
class ClusterSettings:
    """``[cluster]``: pools sharded over replicas, membership and ownership in etcd
    (ownership.py, cluster.py). No endpoints: a single node (every pool served here)."""

    #: the etcd endpoints (host:port); empty: no cluster
    endpoints: tuple[str, ...] = ()
    #: the key prefix of this cluster in the store (several clusters may share one)
    name: str = "kvcoord"
    #: this replica's stable id (its pools' claims and its data directory go with it);
    #: default: the host name
    replica_id: str = ""
    #: where clients reach this replica (host:port); default: the first TCP listener
    advertise_address: str = ""
    #: the membership lease: a replica unreachable for this long loses its pools
    lease_seconds: int = 10
    #: the deadline of each call to the store
    store_timeout_seconds: float = 5.0
    #: where pools' journals live: "local" (the data directory's only: a dead replica's
    #: pools wait for it) or "store" (each pool's records also in etcd, committed
    #: before the answer: another replica takes a dead one's pools over, store_journal.py)
    journal: str = "local"
    #: records of a pool between its snapshots in the store (journal = "store")
    store_snapshot_records: int = 1000
    #: how this replica dials the others (handovers) when [server.tls] is on (tls.py)
    peer_tls: PeerTLS = PeerTLS()

    def __post_init__(self) -> None:
        if self.lease_seconds < 2:
            raise ConfigFileError("cluster.lease_seconds must be at least 2")
        if self.journal not in ("local", "store"):
            raise ConfigFileError(f'cluster.journal must be "local" or "store", got {self.journal!r}')
        if self.store_snapshot_records < 1:
            raise ConfigFileError("cluster.store_snapshot_records must be >= 1")
        if self.store_timeout_seconds <= 0:
            raise ConfigFileError("cluster.store_timeout_seconds must be > 0")
        # (both travel in gRPC metadata, "<name>/<replica_id>": printable ASCII only)
        if not self.name or "/" in self.name or not _printable(self.name):
            raise ConfigFileError(
                f"cluster.name must be non-empty printable ASCII without '/' or spaces, got {self.name!r}"
            )
        if "/" in self.replica_id or self.replica_id == "*" or not _printable(self.replica_id):
            raise ConfigFileError(  # ("*" would be "<cluster>/*": any replica)
                f"cluster.replica_id must be printable ASCII without '/' or spaces, and not '*', got "
                f"{self.replica_id!r}"
            )
        for e in self.endpoints:
            host, _, port = e.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigFileError(f"cluster.endpoints: {e!r} is not host:port")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoints)


def _printable(text: str) -> bool:
    """Printable ASCII without spaces (what gRPC metadata carries as it is)."""
    return all("!" <= ch <= "~" for ch in text)


def _cluster(d: Mapping[str, Any]) -> ClusterSettings:
    known = {f.name for f in dataclasses.fields(ClusterSettings)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in known:
            raise ConfigFileError(f"cluster: unknown key {key!r} (known: {sorted(known)})")
        if key == "peer_tls":
            try:
                kwargs[key] = peer_tls_from_dict(value, "cluster.peer_tls")
            except ValueError as exc:
                raise ConfigFileError(str(exc)) from None
            continue
        kwargs[key] = string_list(value, f"cluster.{key}") if key == "endpoints" else value
    try:
        return ClusterSettings(**kwargs)
    except TypeError as exc:
        raise ConfigFileError(f"cluster: {exc}") from None


def _cluster_from_env(c: ClusterSettings, env: Mapping[str, str]) -> ClusterSettings:
    overrides: dict[str, Any] = {}
    if ENV_CLUSTER_ENDPOINTS in env:
        overrides["endpoints"] = tuple(e.strip() for e in env[ENV_CLUSTER_ENDPOINTS].split(",") if e.strip())
    for key, var in (("name", ENV_CLUSTER_NAME), ("replica_id", ENV_REPLICA_ID), ("advertise_address", ENV_ADVERTISE),
                     ("journal", ENV_CLUSTER_JOURNAL)):  # fmt: skip
        if env.get(var):
            overrides[key] = env[var].strip()
    return dataclasses.replace(c, **overrides) if overrides else c


@dataclasses.dataclass(frozen=True, slots=True)
class PoolDecl:
    name: str
    config: pb.PoolConfig


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    server: ServerSettings
    limits: Limits
    pools: tuple[PoolDecl, ...]
    #: tenants and their roles on pools (access.py); empty: tokens give full access
    tenants: tuple[Tenant, ...] = ()
    #: pools whose KV events are published in vLLM's format (kv_publisher.py)
    kv_events: tuple[KVEventsDecl, ...] = ()
    #: pools sharded over replicas (empty endpoints: a single node)
    cluster: ClusterSettings = ClusterSettings()

    def __post_init__(self) -> None:
        st = self.server
        if self.writes_can_stall and not lease_outlasts_stalls(st.session_lease_seconds, st.stall_seconds):
            # the default lease would end inside a stall the server waits out (stalls.py)
            given = "" if st.journal_stall_seconds is not None else ", unset: the default"
            raise ConfigFileError(
                f"server.session_lease_seconds ({st.session_lease_seconds:g}) is too short for "
                f"server.journal_stall_seconds ({st.stall_seconds:g}{given}) on a server whose durable "
                f'writes can stall (a data_dir, or cluster journal = "store"): {lease_rule(st.stall_seconds)}; '
                f"set session_lease_seconds above {min_lease_seconds(st.stall_seconds):g} or "
                f"journal_stall_seconds below {max_bound_seconds(st.session_lease_seconds):g}"
            )

    @property
    def writes_can_stall(self) -> bool:
        """True when durable writes may stall (the journal and lease marker in a data_dir,
        or a cluster's journal in the store): leases must outlast the stall bound."""
        return bool(self.server.data_dir) or (self.cluster.enabled and self.cluster.journal == "store")


def default_data_dir(env: Mapping[str, str]) -> str:
    """Where `kvcoord serve` keeps its journal when the configuration names no
    data_dir: ``$XDG_STATE_HOME/kvcoord``, else ``~/.local/state/kvcoord`` (absolute;
    the image sets KVCOORD_DATA_DIR=/var/lib/kvcoord).

    Raises:
        ConfigFileError: no home directory to put it in.
    """
    base = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(base):
        home = env.get("HOME", "") or os.path.expanduser("~")
        if not os.path.isabs(home):
            raise ConfigFileError(
                "server.data_dir is not set and there is no home directory for the default "
                '(~/.local/state/kvcoord): set server.data_dir or KVCOORD_DATA_DIR, or durability = "none"'
            )
        base = os.path.join(home, ".local", "state")
    return os.path.join(base, "kvcoord")


def _resolve_data_dir(cfg: ServerConfig, explicit: bool, where: str, env: Mapping[str, str]) -> ServerConfig:
    """A journaled server always has a data directory: the default when none is named;
    an explicitly empty one with durability "journal" is refused (it would keep nothing
    while the configuration promises durability)."""
    s = cfg.server
    if s.durability != "journal" or s.data_dir:
        return cfg
    if explicit:
        raise ConfigFileError(
            f'{where}: data_dir is empty but durability is "journal": name a directory, or set '
            'durability = "none" to keep nothing across restarts'
        )
    return dataclasses.replace(cfg, server=dataclasses.replace(s, data_dir=default_data_dir(env)))


def default_config_text() -> str:
    """The embedded default configuration file."""
    return resources.files("kvcoord.service").joinpath("default_config.toml").read_text(encoding="utf-8")


def _settings(d: Mapping[str, Any]) -> ServerSettings:
    known = {f.name for f in dataclasses.fields(ServerSettings)}
    kwargs: dict[str, Any] = {}
    for key, value in d.items():
        if key not in known:
            raise ConfigFileError(f"server: unknown key {key!r} (known: {sorted(known)})")
        if key in ("tls", "metrics_tls"):
            try:
                kwargs[key] = tls_from_dict(value, f"server.{key}")
            except ValueError as exc:
                raise ConfigFileError(str(exc)) from None
        else:
            kwargs[key] = string_list(value, f"server.{key}") if key in ("listen", "auth_tokens") else value
    try:
        s = ServerSettings(**kwargs)
    except TypeError as exc:
        raise ConfigFileError(f"server: {exc}") from None
    if not s.listen:
        raise ConfigFileError("server.listen: at least one address is required")
    _check_tls(s)
    return s


def _check_tls(s: ServerSettings) -> None:
    for key in ("tls", "metrics_tls"):
        try:
            check_tls_files(getattr(s, key), f"server.{key}")
        except ValueError as exc:
            raise ConfigFileError(str(exc)) from None


def _limits(d: Mapping[str, Any]) -> Limits:
    known = {f.name for f in dataclasses.fields(Limits)}
    for key, value in d.items():
        if key not in known:
            raise ConfigFileError(f"limits: unknown key {key!r} (known: {sorted(known)})")
        if not isinstance(value, int) or value <= 0:
            raise ConfigFileError(f"limits.{key}: must be a positive integer, got {value!r}")
    return Limits(**d)


def parse_config(text: str, source: str = "config") -> ServerConfig:
    """Parse and validate a configuration file's text.

    Raises:
        ConfigFileError: invalid TOML, an unknown key, an invalid pool, or a TLS file
            that is missing or does not parse.
    """
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigFileError(f"{source}: not valid TOML: {exc}") from None
    unknown = set(data) - {"server", "limits", "pools", "tenants", "kv_events", "cluster"}
    if unknown:
        raise ConfigFileError(
            f"{source}: unknown section(s) {sorted(unknown)} (known: server, limits, pools, tenants, "
            "kv_events, cluster)"
        )
    cluster = _cluster(data.get("cluster", {}))
    try:
        kv_events = kv_events_from_list(data.get("kv_events", []))
    except ValueError as exc:
        raise ConfigFileError(f"{source}: {exc}") from None
    settings = _settings(data.get("server", {}))
    limits = _limits(data.get("limits", {}))
    try:
        tenants = tenants_from_dict(data.get("tenants", {}), settings.auth_tokens)
    except ValueError as exc:
        raise ConfigFileError(f"{source}: {exc}") from None
    names = {t.name for t in tenants}
    for i, decl in enumerate(kv_events):
        if decl.tenant and decl.tenant not in names:  # (else it would publish nothing, ever)
            raise ConfigFileError(
                f"{source}: kv_events[{i}].tenant: {decl.tenant[:100]!r} is not a tenant of [tenants] "
                f"(known: {sorted(names)[:20]})"
            )
    pools = []
    names = set()
    for i, p in enumerate(tables(data.get("pools", []), "pools")):
        where = f"pools[{i}]"
        if not isinstance(p, Mapping):
            raise ConfigFileError(f"{where}: must be a table")
        name = p.get("name")
        if not isinstance(name, str) or not name:
            raise ConfigFileError(f"{where}.name: required")
        if name in names:
            raise ConfigFileError(f"{where}.name: pool {name!r} is declared twice")
        names.add(name)
        cfg = pool_config_from_table(p, f"{where} ({name})")
        try:
            check_request(pb.CreatePoolRequest(name=name, config=cfg), limits)  # as if created over the wire
            config_from_pb(cfg)
        except (EngineError, ServiceError) as exc:
            raise ConfigFileError(f"{where} ({name}): {exc}") from None
        if cfg.max_model_len > limits.max_tokens_per_request:
            raise ConfigFileError(
                f"{where} ({name}).max_model_len: {cfg.max_model_len} exceeds limits.max_tokens_per_request "
                f"{limits.max_tokens_per_request}"
            )
        pools.append(PoolDecl(name, cfg))
    return ServerConfig(settings, limits, tuple(pools), tenants, kv_events, cluster)


def load_config(path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Load ``path`` (or $KVCOORD_CONFIG, or the embedded default) and apply env overrides.

    Raises:
        ConfigFileError: as :func:`parse_config`; also a TLS file (from the file or the
            environment) that is missing or does not parse, named with its key.
    """
    env = os.environ if env is None else env
    path = path or env.get(ENV_CONFIG) or None
    if path:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as exc:
            raise ConfigFileError(f"cannot read config file {path}: {exc}") from None
        cfg = parse_config(text, str(path))
        source = str(path)
    else:
        text = default_config_text()
        cfg = parse_config(text, "embedded default")
        source = "embedded default"
    explicit_data_dir = "data_dir" in tomllib.loads(text).get("server", {})
    overrides: dict[str, Any] = {}
    if env.get(ENV_LISTEN):
        overrides["listen"] = tuple(a.strip() for a in env[ENV_LISTEN].split(",") if a.strip())
    if ENV_METRICS in env:
        overrides["metrics_listen"] = env[ENV_METRICS].strip()
    if env.get(ENV_TOKENS):
        overrides["auth_tokens"] = tuple(t.strip() for t in env[ENV_TOKENS].split(",") if t.strip())
    if ENV_DATA_DIR in env:
        overrides["data_dir"] = env[ENV_DATA_DIR].strip()
    if env.get(ENV_DURABILITY):
        overrides["durability"] = env[ENV_DURABILITY].strip()
    if env.get(ENV_LOG_LEVEL):
        overrides["log_level"] = env[ENV_LOG_LEVEL].strip().upper()
    if env.get(ENV_LOG_FORMAT):
        overrides["log_format"] = env[ENV_LOG_FORMAT].strip().lower()
    for key, prefix in (("tls", ENV_TLS_PREFIX), ("metrics_tls", ENV_METRICS_TLS_PREFIX)):
        tls = tls_from_env(getattr(cfg.server, key), env, prefix)
        if tls != getattr(cfg.server, key):
            overrides[key] = tls
    if "auth_tokens" in overrides:
        # the file's check (tenants_from_dict), for the tokens the environment gives
        held = {token: t.name for t in cfg.tenants for token in t.tokens}
        for i, token in enumerate(overrides["auth_tokens"]):
            if token in held:  # never print the token: say where both copies are
                raise ConfigFileError(
                    f"{ENV_TOKENS} (token {i + 1}): the same token is also given in tenants.{held[token]}.tokens"
                )
    if overrides:
        try:
            cfg = dataclasses.replace(cfg, server=dataclasses.replace(cfg.server, **overrides))
        except TypeError as exc:  # pragma: no cover - every key above is a field
            raise ConfigFileError(f"environment: {exc}") from None
        _check_tls(cfg.server)
    try:
        cluster = _cluster_from_env(cfg.cluster, env)
    except ConfigFileError as exc:
        raise ConfigFileError(f"environment: {exc}") from None
    if cluster != cfg.cluster:
        cfg = dataclasses.replace(cfg, cluster=cluster)
    if ENV_DATA_DIR in env:
        source, explicit_data_dir = ENV_DATA_DIR, True
    return _resolve_data_dir(cfg, explicit_data_dir, source, env)
