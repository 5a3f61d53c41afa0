"""Tenants and per-pool roles over real gRPC: every RPC x every role x every tenant."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from certs import SAN_NAMES
from helpers import hashes, new_request
from kvcoord.client import KVCoordClient, TLSOptions
from kvcoord.client.errors import PermissionDeniedError
from kvcoord.service.access import RPC_RULES, STEP_OP_ROLES
from kvcoord.service.config import ConfigFileError, parse_config
from kvcoord.service.testing import InProcessServer
from kvcoord.service.tls import TLSFiles
from kvcoord.v1 import allocator_pb2 as pb
from tenancy import ROOT_TOKEN, TENANTS, TOKENS, Raw, pool_toml, server_state

DENIED, UNAUTH = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED

#: The role each RPC needs, written out independently of access.RPC_RULES.
REQUIRED: dict[str, str | None] = {
    "CreatePool": "administer",
    "DeletePool": "administer",
    "GetPool": "observe",
    "ListPools": None,
    "Attach": "use",
    "Heartbeat": "use",
    "Detach": "use",
    "FindLongestCacheHit": "use",
    "Allocate": "use",
    "Free": "use",
    "Step": "use",
    "StepStream": "use",
    "ResetPrefixCache": "administer",
    "GetStats": "observe",
    "InspectPool": "administer",
    "WatchEvents": "observe",
    "CheckPool": "administer",
    "ScorePools": "observe",
    "ListSessions": "administer",
}

#: Roles of each caller on the a-* pools; None: not authenticated.
CALLERS: dict[str, tuple[str | None, frozenset[str] | None]] = {
    "root": (ROOT_TOKEN, frozenset({"administer", "use", "observe"})),
    "admin": (TOKENS["admin"], frozenset({"administer", "use", "observe"})),
    "user": (TOKENS["user"], frozenset({"use"})),
    "watcher": (TOKENS["watcher"], frozenset({"observe"})),
    "other": (TOKENS["other"], frozenset()),
    "anonymous": (None, None),
    "wrong-token": ("not-a-token", None),
}


@pytest.fixture
def tenant_server(make_server: Callable[..., InProcessServer]) -> InProcessServer:
    return make_server(TENANTS + pool_toml("a-pool") + pool_toml("b-pool"))


@pytest.fixture
def raw(tenant_server: InProcessServer) -> Iterator[Raw]:
    r = Raw(tenant_server.address)
    yield r
    r.close()


def test_every_rpc_has_a_rule() -> None:
    """RPC_RULES names every Allocator RPC, with the role the access model documents."""
    methods = {m.name for m in pb.DESCRIPTOR.services_by_name["Allocator"].methods}
    assert set(RPC_RULES) == methods == set(REQUIRED)
    for rpc, rule in RPC_RULES.items():
        assert (rule.role.value if rule.role else None) == REQUIRED[rpc], rpc
    assert {k: v.value for k, v in STEP_OP_ROLES.items()} == {
        "evict_blocks": "administer",
        "reset_prefix_cache": "administer",
    }


def _session(raw: Raw, token: str | None, can_use: bool, fallback: str) -> tuple[str, pb.Fence]:
    """A session of the caller when it may attach, else another tenant's."""
    if can_use:
        r = raw.ok(
            "Attach",
            pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
            token,
        )
        return r.session_id, r.fence
    return fallback, pb.Fence()


_rids = itertools.count()


def _request(rpc: str, caller: str, sid: str, fence: pb.Fence) -> Any:
    rid = f"{caller}-{next(_rids)}"
    tokens = list(range(100, 108))
    if rpc == "CreatePool":
        cfg = pb.PoolConfig(
            num_blocks=16,
            hash_block_size=4,
            hash_algo="sha256_cbor",
            hash_seed="0",
            enable_caching=True,
            groups=[pb.KVCacheGroupSpec(full=pb.FullAttentionSpec(block_size=4))],
        )
        return pb.CreatePoolRequest(name=f"a-new-{caller}", config=cfg)
    if rpc == "DeletePool":
        return pb.DeletePoolRequest(name="a-tmp")
    if rpc == "GetPool":
        return pb.GetPoolRequest(name="a-pool")
    if rpc == "ListPools":
        return pb.ListPoolsRequest()
    if rpc == "Attach":
        return pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
    if rpc == "Heartbeat":
        return pb.HeartbeatRequest(session_id=sid, fence=fence)
    if rpc == "Detach":
        return pb.DetachRequest(session_id=sid)
    if rpc == "FindLongestCacheHit":
        return pb.FindLongestCacheHitRequest(pool="a-pool", block_hashes=hashes(tokens), num_tokens=8)
    if rpc == "Allocate":
        op = pb.AllocateOp(request=new_request(rid, tokens), num_new_tokens=8)
        return pb.AllocateRequest(pool="a-pool", session_id=sid, op=op)
    if rpc == "Free":
        return pb.FreeRequest(pool="a-pool", session_id=sid, request_ids=["never-registered"])
    if rpc in ("Step", "StepStream"):  # (StepStream: one Step on the stream)
        op = pb.Operation(sync=pb.SyncOp(request=new_request(rid, tokens)))
        return pb.StepRequest(pool="a-pool", session_id=sid, ops=[op])
    if rpc == "ScorePools":
        prompt = pb.HashedPrompt(
            hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", block_hashes=hashes(tokens)
        )
        return pb.ScorePoolsRequest(candidate_pools=["a-pool"], num_tokens=8, prompts=[prompt])
    if rpc in ("ResetPrefixCache", "GetStats", "InspectPool", "CheckPool", "ListSessions"):
        return getattr(pb, f"{rpc}Request")(pool="a-pool")
    assert rpc == "WatchEvents"
    return pb.WatchEventsRequest(pool="a-pool")


def _sessions(server: InProcessServer) -> list[tuple[str, str]]:
    reg = server.running.servicer.registry  # type: ignore[union-attr]
    return server.call(lambda: sorted((s.session_id, s.tenant) for s in reg.sessions.sessions.values()))  # type: ignore[no-any-return]


def test_every_rpc_for_every_role_and_tenant(tenant_server: InProcessServer, raw: Raw) -> None:
    """Each RPC succeeds past the access check exactly for callers holding its role;
    others get PERMISSION_DENIED (UNAUTHENTICATED without a known token), and a refused
    call changes nothing: every pool's InspectPool/GetStats/GetPool and the sessions."""
    admin_sid, admin_fence = _session(raw, TOKENS["admin"], True, "")
    held = pb.AllocateOp(request=new_request("held", list(range(8))), num_new_tokens=8)
    raw.ok(
        "Allocate",
        pb.AllocateRequest(pool="a-pool", session_id=admin_sid, op=held, fence=admin_fence),
        TOKENS["admin"],
    )
    for rpc, (caller, (token, roles)) in itertools.product(REQUIRED, CALLERS.items()):
        if raw.call("GetPool", pb.GetPoolRequest(name="a-tmp"), ROOT_TOKEN)[0] != grpc.StatusCode.OK:
            raw.ok(
                "CreatePool",
                pb.CreatePoolRequest(
                    name="a-tmp", config=raw.ok("GetPool", pb.GetPoolRequest(name="a-pool")).pool.config
                ),
            )
        can_use = roles is not None and "use" in roles
        sid, fence = _session(raw, token, can_use, admin_sid)
        request = _request(rpc, caller, sid, fence)
        before = (server_state(raw), _sessions(tenant_server))
        code, answer = raw.call(rpc, request, token)
        need = REQUIRED[rpc]
        if roles is None:
            expected: grpc.StatusCode | None = UNAUTH
        elif rpc in ("Heartbeat", "Detach", "Allocate", "Free", "Step", "StepStream") and not can_use:
            expected = DENIED  # another tenant's session (and no use role)
        elif need is not None and need not in roles:
            expected = DENIED
        else:
            expected = None
        where = f"{rpc} by {caller}: {code} {answer if code != grpc.StatusCode.OK else ''}"
        if expected is None:
            assert code not in (DENIED, UNAUTH), where
            answered = (grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND)
            if rpc == "WatchEvents" and caller not in ("admin", "root"):
                # a watcher of its own namespace, where nothing happened: the stream waits
                answered += (grpc.StatusCode.DEADLINE_EXCEEDED,)
            assert code in answered, where
        else:
            assert code == expected, where
            assert ROOT_TOKEN not in str(answer) and (token is None or token not in str(answer)), where
            assert (server_state(raw), _sessions(tenant_server)) == before, f"{where}: state changed"


def test_allowed_calls_answer_normally(raw: Raw) -> None:
    """The tenant with every role gets the ordinary answers (the check is not a refusal
    in disguise): attach, allocate with a hit, free."""
    token = TOKENS["admin"]
    sid = raw.ok(
        "Attach",
        pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
        token,
    ).session_id
    op = pb.AllocateOp(request=new_request("r1", list(range(12))), num_new_tokens=12)
    r = raw.ok("Allocate", pb.AllocateRequest(pool="a-pool", session_id=sid, op=op), token)
    assert [len(g.block_ids) for g in r.result.new_block_ids] == [3]
    raw.ok("Free", pb.FreeRequest(pool="a-pool", session_id=sid, request_ids=["r1"]), token)
    hit = raw.ok(
        "FindLongestCacheHit",
        pb.FindLongestCacheHitRequest(pool="a-pool", block_hashes=hashes(list(range(12))), num_tokens=13),
        token,
    )
    assert hit.hit.num_tokens == 12
    assert raw.ok("CheckPool", pb.CheckPoolRequest(pool="a-pool"), token).violations == []


def test_step_operations_that_touch_other_requests_need_administer(raw: Raw) -> None:
    """EvictBlocksOp / ResetPrefixCacheOp inside a Step need administer: a user's Step
    carrying one is refused whole (nothing applied); an administrator's is applied."""
    for caller, expected in (("user", DENIED), ("admin", grpc.StatusCode.OK)):
        token = TOKENS[caller]
        sid = raw.ok(
            "Attach",
            pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
            token,
        ).session_id
        for extra in (
            pb.Operation(evict_blocks=pb.EvictBlocksOp(block_ids=[1])),
            pb.Operation(reset_prefix_cache=pb.ResetPrefixCacheOp()),
        ):
            ops = [
                pb.Operation(sync=pb.SyncOp(request=new_request(f"s-{caller}-{next(_rids)}", [1, 2, 3]))),
                extra,
            ]
            before = server_state(raw)
            code, _ = raw.call("Step", pb.StepRequest(pool="a-pool", session_id=sid, ops=ops), token)
            assert code == expected, caller
            if expected == DENIED:
                assert server_state(raw) == before


def _attach(
    raw: Raw, caller: str, exclusive: bool = False, client_name: str = ""
) -> tuple[grpc.StatusCode, Any]:
    request = pb.AttachRequest(
        pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0",
        exclusive=exclusive, client_name=client_name,
    )  # fmt: skip
    return raw.call("Attach", request, TOKENS[caller])


def test_another_tenants_request_id_answers_as_an_unknown_one(raw: Raw) -> None:
    """Freeing a live request of another tenant answers exactly as an unknown id
    (NOT_FOUND, the same message shape; with if_held both are no-ops), so request ids
    cannot be probed across tenants; another session of the same tenant still hears
    PERMISSION_DENIED."""
    code, admin = _attach(raw, "admin")
    assert code == grpc.StatusCode.OK
    op = pb.AllocateOp(request=new_request("admin-req-42", list(range(8))), num_new_tokens=8)
    raw.ok("Allocate", pb.AllocateRequest(pool="a-pool", session_id=admin.session_id, op=op), TOKENS["admin"])
    user = _attach(raw, "user")[1].session_id
    answers = []
    for rid in ("admin-req-42", "admin-req-43"):
        code, message = raw.call(
            "Free", pb.FreeRequest(pool="a-pool", session_id=user, request_ids=[rid]), TOKENS["user"]
        )
        answers.append((code, message.replace(rid, "<id>")))
        # inside a Step: the same status, reason and position (an unknown one's)
        free = pb.Operation(free=pb.FreeOp(request_id=rid))
        r = raw.ok(
            "Step", pb.StepRequest(pool="a-pool", session_id=user, ops=[free]), TOKENS["user"]
        ).results[0]
        answers.append((r.status_code, r.status_message.replace(rid, "<id>"), r.reason, r.position.exists))
        held = pb.Operation(free=pb.FreeOp(request_id=rid, if_held=True))
        step = raw.ok("Step", pb.StepRequest(pool="a-pool", session_id=user, ops=[held]), TOKENS["user"])
        assert step.results[0].status_code == 0, rid
    assert answers[:2] == answers[2:] and answers[0][0] == grpc.StatusCode.NOT_FOUND, answers
    assert answers[1][3] is False
    inspect = pb.InspectPoolRequest(pool="a-pool", all_requests=True)
    assert "admin-req-42" in {r.request_id for r in raw.ok("InspectPool", inspect, TOKENS["admin"]).requests}
    other = _attach(raw, "admin")[1].session_id
    code, message = raw.call(
        "Free", pb.FreeRequest(pool="a-pool", session_id=other, request_ids=["admin-req-42"]), TOKENS["admin"]
    )
    assert code == DENIED and "another session" in message


def test_exclusive_attach_needs_administer_and_names_no_other_tenants_client(raw: Raw) -> None:
    """An exclusive session locks every other tenant out of a pool, so it needs the
    administer role; the refusal others hear names the holder's client only to its own
    tenant."""
    code, message = _attach(raw, "user", exclusive=True)
    assert code == DENIED and "administer" in message
    assert _attach(raw, "admin", exclusive=True, client_name="admin-host-17")[0] == grpc.StatusCode.OK
    code, message = _attach(raw, "user")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "admin-host-17" not in message, message
    code, message = _attach(raw, "admin")
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "admin-host-17" in message


def test_list_pools_shows_only_pools_with_a_role(raw: Raw) -> None:
    """ListPools lists the pools a tenant holds some role on; full access sees all."""

    def names(token: str) -> list[str]:
        return [p.name for p in raw.ok("ListPools", pb.ListPoolsRequest(), token).pools]

    assert names(ROOT_TOKEN) == ["a-pool", "b-pool"]
    assert names(TOKENS["user"]) == ["a-pool"]
    assert names(TOKENS["watcher"]) == ["a-pool"]
    assert names(TOKENS["other"]) == ["b-pool"]


def test_pools_outside_the_grants_are_denied_whether_or_not_they_exist(raw: Raw) -> None:
    """GetPool / GetStats / WatchEvents of a pool without a role are PERMISSION_DENIED,
    for an existing pool and an unknown one alike (existence does not leak); an unknown
    pool inside the grants is NOT_FOUND."""
    token = TOKENS["other"]
    for name in ("a-pool", "a-missing"):
        assert raw.call("GetPool", pb.GetPoolRequest(name=name), token)[0] == DENIED
        assert raw.call("GetStats", pb.GetStatsRequest(pool=name), token)[0] == DENIED
        assert raw.call("WatchEvents", pb.WatchEventsRequest(pool=name), token)[0] == DENIED
    assert raw.call("GetPool", pb.GetPoolRequest(name="b-missing"), token)[0] == grpc.StatusCode.NOT_FOUND


def test_an_unknown_pool_names_no_other_pool(raw: Raw) -> None:
    """NOT_FOUND for a missing pool inside the caller's grants lists no pool: tenant
    other may not learn that a-pool exists, through GetPool or Attach."""
    token = TOKENS["other"]
    attach = pb.AttachRequest(pool="b-missing", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
    for rpc, request in (("GetPool", pb.GetPoolRequest(name="b-missing")), ("Attach", attach)):
        code, message = raw.call(rpc, request, token)
        assert code == grpc.StatusCode.NOT_FOUND and "b-missing" in message, rpc
        assert "a-pool" not in message and "b-pool" not in message, message


def test_a_session_cannot_be_used_by_another_tenant(make_server: Callable[..., InProcessServer]) -> None:
    """Two tenants with the use role on one pool: the second cannot heartbeat, detach,
    step, allocate or free with the first one's session id; nothing changes."""
    cfg = TENANTS.replace('roles = ["use"] }]', 'roles = ["use", "observe"] }]')
    server = make_server(cfg + pool_toml("a-pool"))
    raw = Raw(server.address)
    try:
        sid = raw.ok(
            "Attach",
            pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0"),
            TOKENS["admin"],
        ).session_id
        op = pb.AllocateOp(request=new_request("mine", list(range(8))), num_new_tokens=8)
        raw.ok("Allocate", pb.AllocateRequest(pool="a-pool", session_id=sid, op=op), TOKENS["admin"])
        before = server_state(raw)
        thief = TOKENS["user"]
        calls = [
            ("Heartbeat", pb.HeartbeatRequest(session_id=sid)),
            ("Detach", pb.DetachRequest(session_id=sid)),
            ("Free", pb.FreeRequest(pool="a-pool", session_id=sid, request_ids=["mine"])),
            (
                "Step",
                pb.StepRequest(
                    pool="a-pool", session_id=sid, ops=[pb.Operation(free=pb.FreeOp(request_id="mine"))]
                ),
            ),
            (
                "Allocate",
                pb.AllocateRequest(
                    pool="a-pool",
                    session_id=sid,
                    op=pb.AllocateOp(request=new_request("x", [1]), num_new_tokens=1),
                ),
            ),
        ]
        for rpc, request in calls:
            code, message = raw.call(rpc, request, thief)
            assert code == DENIED and "another tenant" in message, rpc
        assert server_state(raw) == before
    finally:
        raw.close()


def test_mtls_identity_names_the_tenant(make_server: Callable[..., InProcessServer], certs: Any) -> None:
    """Without a token, the client certificate's CN (worker-1 -> tenant user) decides;
    a token, when sent, takes precedence."""
    tls = TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    server = make_server(TENANTS + pool_toml("a-pool") + pool_toml("b-pool"), tls=tls)
    options = TLSOptions(certs.ca, certs.client_cert, certs.client_key, server_name_override="localhost")
    with KVCoordClient(server.address, tls=options, timeout=10) as c:
        assert [p.name for p in c.list_pools().pools] == ["a-pool"]  # tenant user
    with KVCoordClient(server.address, tls=options, token=TOKENS["other"], timeout=10) as c:
        assert [p.name for p in c.list_pools().pools] == ["b-pool"]


def test_only_dns_and_uri_sans_name_a_tenant(make_server: Callable[..., InProcessServer], certs: Any) -> None:
    """As documented, a client certificate names a tenant by its subject CN or a DNS or
    URI SAN (typed dns: / uri:); an email or IP SAN names none (and cannot be listed)."""
    tls = TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    tenants = "".join(
        f'[tenants.{kind}]\nidentities = ["{kind}:{SAN_NAMES[kind]}"]\n'
        'grants = [{ pools = ["a-*"], roles = ["observe"] }]\n'
        for kind in ("dns", "uri")
    )
    for kind in ("email", "ip"):
        with pytest.raises(ConfigFileError, match="email and IP SANs name no tenant"):
            parse_config(f'[tenants.x]\nidentities = ["{kind}:{SAN_NAMES[kind]}"]\n')
    server = make_server(tenants + pool_toml("a-pool"), tls=tls)
    seen = _pools_seen_by(server, certs, certs.san_clients)
    assert seen == {"dns": ["a-pool"], "uri": ["a-pool"], "email": None, "ip": None}


def _pools_seen_by(
    server: InProcessServer, certs: Any, clients: dict[str, tuple[Path, Path]]
) -> dict[str, list[str] | None]:
    """The pools ListPools shows each client certificate (None: it names no tenant)."""
    seen: dict[str, list[str] | None] = {}
    for who, (cert, key) in clients.items():
        options = TLSOptions(certs.ca, cert, key, server_name_override="localhost")
        with KVCoordClient(server.address, tls=options, timeout=10) as c:
            try:
                seen[who] = [p.name for p in c.list_pools().pools]
            except PermissionDeniedError:  # UNAUTHENTICATED
                seen[who] = None
    return seen


def test_tenant_config_is_validated() -> None:
    """Unknown keys and roles, a token shared by two tenants (or with auth_tokens), and a
    tenant without credentials are refused naming the key, never printing a token."""
    bad = {
        "[tenants.x]\ntokens = ['t']\ncolour = 1": "unknown key",
        "[tenants.x]\ntokens = ['t']\ngrants = [{pools = ['*'], roles = ['own']}]": "unknown role",
        "[tenants.x]\ntokens = ['s3cr3t']\n[tenants.y]\ntokens = ['s3cr3t']": r"tenants\.y\.tokens\[0\]",
        "[server]\nauth_tokens = ['s3cr3t']\n[tenants.y]\ntokens = ['s3cr3t']": "server.auth_tokens",
        "[tenants.x]\ngrants = []": "needs tokens or identities",
    }
    for text, words in bad.items():
        with pytest.raises(ConfigFileError, match=words) as info:
            parse_config(text)
        assert "s3cr3t" not in str(info.value)
    cfg = parse_config(TENANTS)
    assert [t.name for t in cfg.tenants] == ["admin", "user", "watcher", "other"]
    assert "tok-admin" not in repr(cfg)


def test_default_config_documents_tenants() -> None:
    """The embedded default config, README and deploy docs describe [tenants]."""
    root = Path(__file__).resolve().parents[2]
    for path in ("README.md", "deploy/README.md", "server/kvcoord/service/default_config.toml"):
        text = (root / path).read_text()
        assert "[tenants." in text and "shared_cache_tenants" in text, path


def test_identities_are_typed_by_certificate_field(
    make_server: Callable[..., InProcessServer], certs: Any
) -> None:
    """A certificate whose subject CN equals a tenant's DNS name is not that tenant: CN,
    DNS and URI names are separate namespaces (cn:, dns:, uri:). Untyped identities
    are refused at load with the typed spellings in the message."""
    tls = TLSFiles(str(certs.server_cert), str(certs.server_key), str(certs.ca))
    dns = SAN_NAMES["dns"]
    tenant = (
        f'[tenants.web]\nidentities = ["dns:{dns}"]\ngrants = [{{ pools = ["a-*"], roles = ["observe"] }}]\n'
    )
    server = make_server(tenant + pool_toml("a-pool"), tls=tls)
    clients = {"cn-like-dns": certs.cn_clients[dns], "dns-san": certs.san_clients["dns"]}
    seen = _pools_seen_by(server, certs, clients)
    assert seen == {"cn-like-dns": None, "dns-san": ["a-pool"]}
    with pytest.raises(ConfigFileError, match=f'write "cn:{dns}" .*"dns:{dns}" .*"uri:{dns}"'):
        parse_config(f'[tenants.x]\nidentities = ["{dns}"]\n')


def test_pool_config_shows_other_tenants_only_to_administrators(
    make_server: Callable[..., InProcessServer],
) -> None:
    """shared_cache_tenants names other tenants: GetPool, ListPools and Attach show it
    whole to the pool's administrators (and the full-access tenant); anyone else sees
    only "*" and its own name."""
    extra = 'shared_cache_tenants = ["user", "other", "*"]'
    server = make_server(TENANTS + pool_toml("a-pool", extra))
    raw = Raw(server.address)
    try:
        attach = pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
        for caller, expected in (
            ("root", ["user", "other", "*"]),
            ("admin", ["user", "other", "*"]),
            ("watcher", ["*"]),
        ):
            token = ROOT_TOKEN if caller == "root" else TOKENS[caller]
            got = raw.ok("GetPool", pb.GetPoolRequest(name="a-pool"), token).pool.config
            assert list(got.shared_cache_tenants) == expected, caller
            (listed,) = [
                p for p in raw.ok("ListPools", pb.ListPoolsRequest(), token).pools if p.name == "a-pool"
            ]
            assert list(listed.config.shared_cache_tenants) == expected, caller
        attached = raw.ok("Attach", attach, TOKENS["user"]).pool.config
        assert list(attached.shared_cache_tenants) == ["user", "*"]
        # the pool itself is unchanged: the administrator still sees every name
        got = raw.ok("GetPool", pb.GetPoolRequest(name="a-pool"), TOKENS["admin"]).pool.config
        assert list(got.shared_cache_tenants) == ["user", "other", "*"]
    finally:
        raw.close()


def test_exclusive_refusal_does_not_count_other_tenants_sessions(
    make_server: Callable[..., InProcessServer],
) -> None:
    """An exclusive Attach refused because of other sessions tells the caller how many
    of them are its own, never how many other tenants hold."""
    server = make_server(TENANTS + pool_toml("a-pool"))
    raw = Raw(server.address)
    try:
        attach = pb.AttachRequest(pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0")
        for _ in range(3):
            raw.ok("Attach", attach, TOKENS["user"])
        exclusive = pb.AttachRequest(
            pool="a-pool", hash_algo="sha256_cbor", hash_block_size=4, hash_seed="0", exclusive=True
        )
        code, message = raw.call("Attach", exclusive, TOKENS["admin"])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "3" not in message and "sessions of other tenants" in message, message
        raw.ok("Attach", attach, TOKENS["admin"])
        code, message = raw.call("Attach", exclusive, TOKENS["admin"])
        assert code == grpc.StatusCode.FAILED_PRECONDITION
        assert "3" not in message and "sessions of other tenants and 1 of yours" in message, message
    finally:
        raw.close()
