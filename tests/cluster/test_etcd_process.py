"""The cluster tests' etcd starts even when a port it was given is taken before it
binds it (another process's connection, another test's etcd): it used to exit 1
("address already in use") and fail every test of the module at its fixture."""

from __future__ import annotations

import socket
from pathlib import Path

import etcd_process
import pytest
from etcd_process import Etcd, free_ports


def test_etcd_starts_again_on_other_ports_when_one_is_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        picks: list[list[int]] = []

        def first_taken(n: int) -> list[int]:
            ports = free_ports(n)
            if not picks:
                ports[0] = taken.getsockname()[1]  # taken between the pick and etcd's bind
            picks.append(ports)
            return ports

        monkeypatch.setattr(etcd_process, "free_ports", first_taken)
        etcd = Etcd(tmp_path)
        try:
            assert len(picks) == 2 and etcd.port == picks[1][0]
        finally:
            etcd.stop()
