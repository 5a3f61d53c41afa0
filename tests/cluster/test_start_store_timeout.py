"""A replica whose cluster store does not answer while it joins (registered, then the
read of the cluster's members and claims timed out) refuses to start with the
documented status 3, "cannot start", which its supervisor restarts on.

Was: the store client's ConnectionTimeoutError rose out of the start as a traceback
(exit status 1), seen at a 6 % CPU quota in test_cluster_crash_points.

Real etcd, a real ``kvcoord serve``; a server hook (durable_server.with_sitecustomize)
makes the first read of the view time out as the store client does (aetcd's
ConnectionTimeoutError, "Deadline Exceeded")."""

from __future__ import annotations

from pathlib import Path

import durable_server
import pytest
from etcd_process import Etcd
from kvcoord.client.testing import start_server
from test_replicas import replica_config

HOOK = """
import aetcd.exceptions
import kvcoord.service.cluster_store as cs

refresh = cs.ClusterStore.refresh
calls = []


async def _refresh(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 1:  # the start's read of the view
        raise aetcd.exceptions.ConnectionTimeoutError("Deadline Exceeded")
    return await refresh(self, *args, **kwargs)


cs.ClusterStore.refresh = _refresh
"""


def test_a_store_that_times_out_while_a_replica_joins_is_exit_3(
    etcd: Etcd, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    durable_server.with_sitecustomize(tmp_path, HOOK, monkeypatch)
    config = replica_config(etcd, "r0", tmp_path / "r0", "start-store-timeout")
    with pytest.raises(RuntimeError) as refused:
        start_server(config, env=durable_server.env()).stop()
    text = str(refused.value)
    assert text.startswith("kvcoord server exited with 3:"), text
    assert "cannot start: the cluster store failed while this replica joined" in text, text
    assert "ConnectionTimeoutError" in text and "Traceback" not in text, text
