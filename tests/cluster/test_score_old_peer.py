"""A rolling upgrade: ScorePools reaches an upgraded replica, and another pool's owner
runs an earlier release, whose Replicas service has no ScoreForTenant (UNIMPLEMENTED).
Its pools come back unscored, OWNER_UNREACHABLE (the only reason the proto names for a
pool its owner cannot score), but the message said that owner "did not answer within
2.00 s" and to "score again shortly": an operator looked for a frozen or partitioned
replica. Now it names the earlier release and the upgrade.

Real etcd, two real ``kvcoord serve`` replicas; the earlier release played by a server
hook (durable_server.with_sitecustomize) that serves one replica's Replicas service
without ScoreForTenant, as that release's generated code did."""

from __future__ import annotations

from pathlib import Path

import durable_server
import earlier_release
import pytest
from etcd_process import Etcd
from kvcoord.client import NO_RETRY, KVCoordClient
from kvcoord.client.testing import ServerProcess, start_server
from test_replicas import placed, replica_config
from test_score_cluster import PROMPT, _cache, _prompt
from test_score_reserve_retry import created_and_placed

IDS = ["new", "old"]
NEW, OLD = placed("upgrade", "new", IDS), placed("upgrade", "old", IDS)


def test_an_owner_of_an_earlier_release_is_named_as_such(
    etcd: Etcd, tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable_server.with_sitecustomize(tmp_path, earlier_release.HOOK, monkeypatch)
    procs: list[ServerProcess] = []
    try:
        for r in IDS:
            extra = earlier_release.env_of("AdoptPool") if r == "old" else {}
            config = replica_config(etcd, r, tmp_path / r, request.node.name)
            procs.append(start_server(config, env={**durable_server.env(), **extra}))
        new, old = procs
        targets = [new.address, old.address]
        created_and_placed(targets, {NEW: "new", OLD: "old"})
        with KVCoordClient(targets, timeout=10.0) as c:
            _cache(c, OLD, PROMPT, "whole")
        with KVCoordClient(new.address, timeout=10.0, retry=NO_RETRY) as c:
            answer = c.score_pools(len(PROMPT), [_prompt()])
        assert [(s.pool, s.hit_tokens) for s in answer.scores] == [(NEW, 0)]
        assert [(u.pool, u.reason) for u in answer.unscored] == [(OLD, "OWNER_UNREACHABLE")]
        message = answer.unscored[0].message
        # (was: "the pool's owner at ... did not answer within 2.00 s (UNIMPLEMENTED: ...): score again shortly")
        assert "earlier kvcoord release" in message and old.address in message, message
        assert "did not answer" not in message, message
        with KVCoordClient(
            old.address, timeout=10.0, retry=NO_RETRY
        ) as c:  # asked itself, it scores its pool
            assert [
                (s.pool, s.hit_tokens) for s in c.score_pools(len(PROMPT), [_prompt()], [OLD]).scores
            ] == [(OLD, 40)]
    finally:
        for p in procs:
            p.stop()
