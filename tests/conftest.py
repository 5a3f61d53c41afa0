"""Suite-wide collection rules: the integration suite needs a running deployment, and
long tests start first on pytest-xdist's workers.

`make test` (scripts/test.sh) starts the container and Prometheus and sets
KVCOORD_TARGET; without it, tests/integration is not collected (run `make integration`).
Tests marked ``long`` (15 s or more in CI) are run first by every worker under
``--dist worksteal``, and their files are handed out first under ``--dist loadfile``
(tests/long_first.py says why and how).
"""

from __future__ import annotations

import importlib.util
import os
from typing import TYPE_CHECKING, Any

# before anything imports gRPC: journaled servers in this process fork for snapshots
# (kvcoord/service/__init__.py), which gRPC's fork handlers can crash
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")

import pytest
from long_first import loadfile_order, worksteal_order

if TYPE_CHECKING:
    from certs import CertFiles

collect_ignore = [] if os.environ.get("KVCOORD_TARGET") else ["integration"]
# tests/with_vllm need vLLM (scripts/install_vllm.sh makes a venv; scripts/test_vllm.sh runs them there)
# (named with_vllm: a tests/vllm directory would shadow the vllm package on the test path)
if importlib.util.find_spec("vllm") is None:
    collect_ignore.append("with_vllm")


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(pytest-xdist's controller) tell every worker the --dist mode: a worker's own is "no"."""
    node.workerinput["kvcoord_dist"] = node.config.getoption("dist")


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (parametrized fixtures)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On an xdist worker (every worker collects, and orders alike): long tests first."""
    workerinput = getattr(config, "workerinput", {})
    workers = workerinput.get("workercount", 0)
    dist = workerinput.get("kvcoord_dist")
    if workers < 2:
        return
    if dist == "worksteal":
        items[:] = worksteal_order(items, _is_long, workers)
    elif dist == "loadfile":
        items[:] = loadfile_order(items, _is_long, lambda item: item.path)


def _is_long(item: pytest.Item) -> bool:
    return item.get_closest_marker("long") is not None


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertFiles:
    """A CA, server and client certificates (and a stranger CA), generated once per run."""
    from certs import write_certs  # needs `cryptography`, which the vLLM venv does not have

    return write_certs(tmp_path_factory.mktemp("certs"))
