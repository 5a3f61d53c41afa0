"""Suite-wide collection rule: the integration suite needs a running deployment.

`make test` (scripts/test.sh) starts the container and Prometheus and sets
KVCOORD_TARGET; without it, tests/integration is not collected (run `make integration`).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING

# before anything imports gRPC: journaled servers in this process fork for snapshots
# (kvcoord/service/__init__.py), which gRPC's fork handlers can crash
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import pytest

if TYPE_CHECKING:
    from certs import CertFiles

collect_ignore = [] if os.environ.get("KVCOORD_TARGET") else ["integration"]
# tests/with_vllm need vLLM (scripts/install_vllm.sh makes a venv; scripts/test_vllm.sh runs them there)
# (named with_vllm: a tests/vllm directory would shadow the vllm package on the test path)
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("with_vllm")


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """A CA, server and client certificates (and a stranger CA), generated once per run."""
    from certs import write_certs  # needs `cryptography`, which the vLLM venv does not have

    return write_certs(tmp_path_factory.mktemp("certs"))
