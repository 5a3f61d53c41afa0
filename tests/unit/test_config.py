"""Server configuration: the embedded default, TOML files, environment overrides."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from kvcoord.service.config import ConfigFileError, default_config_text, load_config, parse_config
from kvcoord.wire import config_from_pb


def test_embedded_default_is_valid() -> None:
    """The default: one hybrid pool (full16 + sliding16 w4096) on loopback."""
    cfg = load_config(None, env={})
    assert cfg.server.listen == ("127.0.0.1:50051",)
    assert cfg.server.metrics_listen == "127.0.0.1:9400"
    (pool,) = cfg.pools
    engine_cfg = config_from_pb(pool.config)
    assert pool.name == "default" and engine_cfg.coordinator_kind == "hybrid"
    assert [type(g).__name__ for g in engine_cfg.groups] == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert parse_config(default_config_text()).server.data_dir == ""  # programmatic: none
    assert (
        dataclasses.replace(parse_config(default_config_text()).server, data_dir=cfg.server.data_dir)
        == cfg.server
    )


def test_a_journaled_server_always_has_an_absolute_data_dir(tmp_path: Path) -> None:
    """Issue 26 (10, 11): the embedded default and a config file without data_dir get
    an absolute default directory (not one relative to the working directory, not
    none); an explicitly empty data_dir with durability "journal" is refused, and
    durability "none" keeps nothing. (Before, the default was ./kvcoord-data and a file
    without data_dir ran with no journal, with only a warning.)"""
    env = {"HOME": str(tmp_path)}
    expected = str(tmp_path / ".local" / "state" / "kvcoord")
    assert load_config(None, env=env).server.data_dir == expected
    assert load_config(None, env={**env, "XDG_STATE_HOME": "/state"}).server.data_dir == "/state/kvcoord"
    f = tmp_path / "c.toml"
    f.write_text('[server]\nlisten = ["127.0.0.1:7000"]\n')
    s = load_config(f, env=env).server
    assert s.journaled and s.data_dir == expected
    f.write_text('[server]\ndata_dir = ""\n')
    with pytest.raises(ConfigFileError, match='data_dir is empty but durability is "journal"'):
        load_config(f, env=env)
    with pytest.raises(ConfigFileError, match="KVCOORD_DATA_DIR: data_dir is empty"):
        load_config(None, env={**env, "KVCOORD_DATA_DIR": ""})
    f.write_text('[server]\ndurability = "none"\n')
    assert not load_config(f, env=env).server.journaled


def test_environment_overrides() -> None:
    """KVCOORD_LISTEN, KVCOORD_METRICS_LISTEN and KVCOORD_LOG_LEVEL override [server]."""
    cfg = load_config(None, env={"KVCOORD_LISTEN": "0.0.0.0:1, unix:/tmp/k.sock", "KVCOORD_METRICS_LISTEN": "",
                                 "KVCOORD_LOG_LEVEL": "debug"})  # fmt: skip
    assert cfg.server.listen == ("0.0.0.0:1", "unix:/tmp/k.sock")
    assert cfg.server.metrics_listen == ""
    assert cfg.server.log_level == "DEBUG"


def test_config_file_from_env(tmp_path: Path) -> None:
    """KVCOORD_CONFIG names the file when --config is not given."""
    f = tmp_path / "c.toml"
    f.write_text('[server]\nlisten = ["127.0.0.1:7000"]\n[limits]\nmax_pools = 3\n')
    cfg = load_config(None, env={"KVCOORD_CONFIG": str(f)})
    assert cfg.server.listen == ("127.0.0.1:7000",) and cfg.limits.max_pools == 3 and cfg.pools == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("[server\n", "not valid TOML"),
        ("[bogus]\n", "unknown section"),
        ("[server]\nport = 1\n", "server: unknown key 'port'"),
        ("[server]\njournal_stall_seconds = 0\n", "server.journal_stall_seconds must be a number > 0"),
        ('[server]\njournal_stall_seconds = "5"\n', "server.journal_stall_seconds must be a number > 0"),
        ("[server]\njournal_stall_seconds = inf\n", "server.journal_stall_seconds must be a number > 0"),
        ("[limits]\nmax_pools = 0\n", "limits.max_pools: must be a positive integer"),
        ("[[pools]]\nnum_blocks = 4\n", "pools\\[0\\].name: required"),
        (
            '[[pools]]\nname = "a"\nnum_blocks = 4\nhash_block_size = 4\n[[pools.groups]]\ntype = "nope"\nblock_size = 4\n',
            "unknown group type 'nope'",
        ),
        (
            '[[pools]]\nname = "a"\nnum_blocks = 4\nhash_block_size = 4\nhash_algo = "sha256"\nhash_seed = "0"\n'
            'enable_caching = true\n[[pools.groups]]\ntype = "full"\nblock_size = 8\n',
            "hash_block_size == block_size",
        ),
        (
            '[[pools]]\nname = "a"\nnum_blocks = 4\nhash_block_size = 4\n[[pools]]\nname = "a"\n',
            "declared twice",
        ),
        ("[cluster.peer_tls]\nca = 1\n", "cluster.peer_tls: unknown key 'ca'"),
        (
            '[cluster.peer_tls]\ncert_file = "/x.pem"\n',
            "cluster.peer_tls: cert_file and key_file go together",
        ),
        ('[cluster.peer_tls]\nca_file = "/nonexistent/ca.pem"\n', "cluster.peer_tls.ca_file: cannot read"),
    ],
)
def test_bad_files_name_the_key(text: str, message: str) -> None:
    """Errors say which key is wrong and what was expected."""
    with pytest.raises(ConfigFileError, match=message):
        parse_config(text)


def test_missing_file() -> None:
    with pytest.raises(ConfigFileError, match="cannot read config file"):
        load_config("/nonexistent/kvcoord.toml", env={})


_POOL = '[[pools]]\nname = "p"\nnum_blocks = 4\nhash_block_size = 4\n[[pools.groups]]\ntype = "full"\nblock_size = 4\n'


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[server]\nauth_tokens = "Sup3rSecret"\n', r"server\.auth_tokens"),
        ('[server]\nlisten = "127.0.0.1:7000"\n', r"server\.listen"),
        ('[tenants.t]\ntokens = "Sup3rSecret"\n', r"tenants\.t\.tokens"),
        ('[tenants.t]\ntokens = ["t"]\nidentities = "worker-1"\n', r"tenants\.t\.identities"),
        (
            '[tenants.t]\ntokens = ["t"]\ngrants = [{ pools = "a-*", roles = ["use"] }]\n',
            r"grants\[0\]\.pools",
        ),
        (
            '[tenants.t]\ntokens = ["t"]\ngrants = [{ pools = ["a-*"], roles = "use" }]\n',
            r"grants\[0\]\.roles",
        ),
        ('[tenants.t]\ntokens = ["t"]\ngrants = "all"\n', r"tenants\.t\.grants"),
        (
            _POOL.replace("num_blocks = 4\n", 'num_blocks = 4\nshared_cache_tenants = "team-a"\n'),
            "shared_cache_tenants",
        ),
        ('[pools]\nname = "p"\n', "pools: must be a list of tables"),
    ],
)
def test_a_string_where_a_list_is_required_is_refused(text: str, key: str) -> None:
    """Every list-valued key refuses a lone string, naming the key, and never prints it
    (`auth_tokens = "secret"` made each of its characters a full-access token)."""
    with pytest.raises(ConfigFileError, match=key) as info:
        parse_config(text)
    assert "must be a list" in str(info.value) and "Sup3rSecret" not in str(info.value)


def test_an_empty_tenant_name_is_refused() -> None:
    """[tenants.""] would be the built-in full-access tenant, whatever its grants."""
    text = '[tenants.""]\ntokens = ["tok-readonly"]\ngrants = [{ pools = ["x-*"], roles = ["observe"] }]\n'
    with pytest.raises(ConfigFileError, match="non-empty name"):
        parse_config(text)


def test_an_environment_token_held_by_a_tenant_is_refused(tmp_path: Path) -> None:
    """KVCOORD_AUTH_TOKENS gets the file's check: a token both full-access and a
    tenant's is refused, naming where, never printing the token."""
    f = tmp_path / "c.toml"
    f.write_text('[tenants.t]\ntokens = ["dup-token"]\ngrants = []\n')
    with pytest.raises(ConfigFileError, match=r"KVCOORD_AUTH_TOKENS.*tenants\.t\.tokens") as info:
        load_config(f, env={"KVCOORD_AUTH_TOKENS": "other, dup-token"})
    assert "dup-token" not in str(info.value)
    assert load_config(f, env={"KVCOORD_AUTH_TOKENS": "other"}).server.auth_tokens == ("other",)


def test_peer_tls_names_the_files_replicas_dial_each_other_with(certs: Any) -> None:
    """[cluster.peer_tls]: checked files, kept as given (tls.peer_credentials uses them)."""
    cfg = parse_config(
        f'[cluster.peer_tls]\nca_file = "{certs.ca}"\ncert_file = "{certs.client_cert}"\n'
        f'key_file = "{certs.client_key}"\nserver_name = "localhost"\n'
    )
    peer = cfg.cluster.peer_tls
    assert (peer.ca_file, peer.cert_file, peer.server_name) == (
        str(certs.ca),
        str(certs.client_cert),
        "localhost",
    )
    assert parse_config("").cluster.peer_tls == type(peer)()


def test_the_stall_bound_stays_below_the_session_lease() -> None:
    """A journal (or lease marker) write outstanding for journal_stall_seconds stops the
    server so that the workers waiting on it hear before their leases end: a bound at or
    past the session lease is refused, naming both keys; unset, it is derived from the
    lease: unset, it is 10 s whatever the lease (half of a 1 s lease stopped servers
    on a loaded machine). (Before, an explicit 60 s with 30 s leases loaded without a
    word, and the sessions expired while the server was stuck.)"""
    for text in (
        "[server]\nsession_lease_seconds = 30.0\njournal_stall_seconds = 30.0\n",
        "[server]\nsession_lease_seconds = 4.0\njournal_stall_seconds = 10.0\n",
    ):
        with pytest.raises(
            ConfigFileError, match=r"server\.journal_stall_seconds .*server\.session_lease_seconds"
        ):
            parse_config(text)
    assert parse_config("[server]\nsession_lease_seconds = 4.0\n").server.stall_seconds == 10.0
    assert parse_config("[server]\nsession_lease_seconds = 60.0\n").server.stall_seconds == 10.0
    s = parse_config("[server]\nsession_lease_seconds = 4.0\njournal_stall_seconds = 3.5\n").server
    assert s.stall_seconds == 3.5
    assert load_config(None, env={"HOME": "/tmp"}).server.stall_seconds == 10.0


def test_the_default_lease_outlasts_every_stall_a_durable_server_waits_out(tmp_path: Path) -> None:
    """A durable write is waited for journal_stall_seconds and then once more at most
    min(1 s, bound) (stalls.py); a worker trusts 95 % of its lease. So on a server whose
    writes can stall (a data_dir, or cluster journal = "store") the default lease must
    satisfy lease x 0.95 > bound + min(1 s, bound), the bound unset being its 10 s
    default: else a stall the server tolerates outlives the sessions it serves. Refused
    naming both numbers and the way out. (Before, only an explicit bound was checked,
    and only against the lease itself: a 3 s lease with the unset 10 s bound, or with a
    2 s one, loaded without a word.) Without durable writes nothing stalls: no rule."""
    data = f'data_dir = "{tmp_path}"\n'
    for text, names in (
        (f"[server]\n{data}session_lease_seconds = 3.0\n",
         ("session_lease_seconds (3)", "journal_stall_seconds (10, unset: the default)",
          "(10 s) + 1 s = 11 s", "above 11.579", "below 1.849")),
        (f"[server]\n{data}session_lease_seconds = 3.0\njournal_stall_seconds = 2.0\n",
         ("session_lease_seconds (3)", "journal_stall_seconds (2)", "(2 s) + 1 s = 3 s", "above 3.158")),
        (f"[server]\n{data}session_lease_seconds = 1.0\njournal_stall_seconds = 0.5\n",
         ("journal_stall_seconds (0.5)", "(0.5 s) + 0.5 s = 1 s", "below 0.475")),
        (f"[server]\n{data}session_lease_seconds = 11.5\n", ("(10 s) + 1 s = 11 s",)),
        ('[server]\nsession_lease_seconds = 5.0\n[cluster]\nendpoints = ["127.0.0.1:2379"]\njournal = "store"\n',
         ("session_lease_seconds (5)", "cluster journal")),
    ):  # fmt: skip
        with pytest.raises(ConfigFileError) as refused:
            parse_config(text)
        assert all(n in str(refused.value) for n in names), str(refused.value)
    for text in (
        f"[server]\n{data}session_lease_seconds = 3.0\njournal_stall_seconds = 1.8\n",
        f"[server]\n{data}session_lease_seconds = 1.0\njournal_stall_seconds = 0.45\n",
        f"[server]\n{data}session_lease_seconds = 11.6\n",
        "[server]\nsession_lease_seconds = 3.0\n",  # no data_dir: no durable write
        '[server]\nsession_lease_seconds = 5.0\n[cluster]\nendpoints = ["127.0.0.1:2379"]\n',  # local
    ):
        parse_config(text)
    # a file without data_dir gets the default directory: held to the rule too
    f = tmp_path / "c.toml"
    f.write_text("[server]\nsession_lease_seconds = 3.0\n")
    with pytest.raises(ConfigFileError, match=r"unset: the default"):
        load_config(str(f), env={"HOME": str(tmp_path)})
